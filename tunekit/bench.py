"""Benchmarks: the training step with everything else removed, timed properly, saved with its context.

`measure_step` runs warm-up steps first (allocator growth, kernel selection, autotuning), synchronizes the
GPU around every timed step and reports the median, which one slow step (a GC pause, a recompile) cannot
move. Batches are random token ids filling every position, so the numbers compare with published
figures at the same shape; the model is random-init unless `model` names real weights.

Each result is one JSON file. Every file has the top-level keys `name`, `preset`, `gpu`, `world_size`,
`tokens_per_s` (per GPU), `peak_memory_gb` and `date`, plus the step times, MFU, the resolved config and the
package versions, so any tool can read any result and trace it to its settings.

MFU (model FLOPs utilisation, https://arxiv.org/abs/2204.02311 appendix B) counts the FLOPs the model needs
— not the recomputation that checkpointing adds — against the GPU's dense bf16 peak from its datasheet.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from tunekit import checkpoint, memory
from tunekit.config import TuneConfig, config_dict

REQUIRED_KEYS = ("name", "preset", "gpu", "world_size", "tokens_per_s", "peak_memory_gb", "date")
# Dense bf16 tensor-core peaks from vendor datasheets (FLOP/s), matched by substring of the device name.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12,
             "RTX 4090": 165e12, "RTX 3090": 71e12, "A6000": 155e12}


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor() or 'unknown'})"


def peak_flops(name: str) -> float | None:
    for key, value in PEAK_BF16.items():
        if key in name:
            return value
    return None


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "cuda": torch.version.cuda}
    for pkg in ("torch", "transformers", "peft", "accelerate", "datasets", "bitsandbytes", "flash-attn",
                "liger-kernel"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def flops_per_token(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                    seq: int, method: str, lora_params: int = 0) -> float:
    """Training FLOPs per token for a Llama-shaped model.

    Forward: 2 FLOPs per weight per token for every matmul (attention projections, MLP, LM head) plus
    causal attention scores and values, 2 * seq * hidden per layer (half of the full 4 * seq * hidden).
    Backward: full fine-tuning computes input *and* weight gradients (2x forward); with frozen base weights
    (LoRA, QLoRA) only input gradients (1x forward) — so a LoRA step needs 2/3 the FLOPs of a full one.
    Attention has no weights: its backward is 2x forward either way."""
    kv = hidden // heads * kv_heads
    matmul = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate) + hidden * vocab
    attn = layers * 2 * seq * hidden
    weight_passes = 3 if method == "full" else 2
    return 2 * matmul * weight_passes + attn * 3 + 6 * lora_params


PACKED_DOCS = 4  # samples per row in a packed benchmark batch


def packed_positions(rows: int, length: int, docs: int = PACKED_DOCS) -> torch.Tensor:
    """Position ids of rows that each pack `docs` equal samples: 0..n-1 repeated, so attention is masked
    per sample (the last sample takes the remainder)."""
    size = -(-length // docs)
    return (torch.arange(length) % size).expand(rows, length).clone()


def measure_step(step_fn, warmup: int, steps: int, device: str) -> list[float]:
    """Seconds per call of `step_fn` for `steps` calls after `warmup` untimed ones."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        step_fn()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step_fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def run_bench(cfg: TuneConfig, name: str = "", verbose: bool = True) -> dict:
    """Build the model of `cfg`, time its training step, and return a result dict (see module docstring)."""
    from tunekit import train as tr
    from tunekit.model import count_parameters

    device, dtype = tr.resolve_runtime(cfg)
    vocab = cfg.vocab_size or len(tr.build_tokenizer(cfg))
    torch.manual_seed(cfg.seed)
    memory.reset_peak_memory(device)
    t0 = time.perf_counter()
    model, optimizer, scheduler, options = tr.build_training(cfg, vocab, device, dtype, 10**9, verbose)
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(cfg.seed)
    micro = []
    for _ in range(cfg.grad_accum):
        ids = torch.randint(0, vocab, (cfg.batch_size, cfg.max_length), generator=g)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if cfg.packing == "pack":  # PACKED_DOCS equal samples a row, attending only within themselves
            batch["position_ids"] = packed_positions(cfg.batch_size, cfg.max_length)
        micro.append(tr.to_device(batch, device))

    def step():
        tr.train_step(model, micro, optimizer, scheduler, cfg.max_grad_norm, **options)

    # The step's peak, not the load's: a 4-bit load materializes bf16 weights on the way (13.5 GB for 7B).
    load_peak, _ = memory.peak_memory_gb(device)
    memory.reset_peak_memory(device)
    try:
        times = measure_step(step, cfg.bench_warmup, cfg.bench_steps, device)
    except torch.OutOfMemoryError:
        raise RuntimeError(oom_advice(cfg)) from None
    alloc, reserved = memory.peak_memory_gb(device)
    median = statistics.median(times)
    tokens = cfg.batch_size * cfg.grad_accum * cfg.max_length
    trainable, total = count_parameters(model)
    fpt = flops_per_token(cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads or cfg.num_heads,
                          cfg.intermediate_size, vocab, cfg.max_length, cfg.method,
                          trainable if cfg.method != "full" else 0)
    gpu = gpu_name()
    peak = peak_flops(gpu) if device == "cuda" else None
    achieved = fpt * tokens / median
    result = {
        "name": name or cfg.preset, "preset": cfg.preset, "gpu": gpu, "world_size": 1,
        "tokens_per_s": round(tokens / median, 1), "peak_memory_gb": round(alloc, 3),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "memory_measure": "torch.cuda.max_memory_allocated" if device == "cuda" else "process peak RSS",
        "peak_reserved_gb": round(reserved, 3), "load_peak_gb": round(load_peak, 3), "step_time_s": round(median, 5),
        "step_times_s": [round(t, 5) for t in times], "tokens_per_step": tokens,
        "model_tflops_per_s": round(achieved / 1e12, 2), "mfu": round(achieved / peak, 4) if peak else None,
        "params_total": total, "params_trainable": trainable, "build_s": round(build_s, 1),
        "weights": cfg.model or "random-init",
        "data": "random token ids, every position a target" + (
            f"; rows packed with {PACKED_DOCS} samples each" if cfg.packing == "pack" else ""),
        "config": config_dict(cfg), "versions": versions(),
    }
    if verbose:
        print(format_table([result]))
    return result


# ---- what fits -----------------------------------------------------------------------------------------


def allocatable_bytes(device: str = "cuda") -> float:
    """What the caching allocator may hand out: the GPU's memory, or the cap `limit_memory` set."""
    if device != "cuda" or not torch.cuda.is_available():
        return float("inf")
    total = torch.cuda.get_device_properties(0).total_memory
    return total * getattr(limit_memory, "fraction", 1.0)


def limit_memory(gb: float | None) -> None:
    """Let this process allocate at most `gb` GB on the GPU, as if it had a smaller one: PyTorch raises
    out-of-memory beyond it (`torch.cuda.set_per_process_memory_fraction`); 0 or None lifts the cap. For
    checking that a config fits a 24 GB card on an H200. The CUDA context is outside the cap: leave it
    room (~0.5-1 GB)."""
    total = torch.cuda.get_device_properties(0).total_memory
    limit_memory.fraction = min(1.0, gb * 1e9 / total) if gb else 1.0
    torch.cuda.set_per_process_memory_fraction(limit_memory.fraction)


def oom_advice(cfg: TuneConfig) -> str:
    """The message for an out-of-memory step: what the estimator says would fit instead."""
    config = config_dict(cfg)
    budget = allocatable_bytes()
    head = f"out of GPU memory at micro-batch {cfg.batch_size} x {cfg.max_length} tokens ({cfg.method}). "
    if not config["vocab_size"]:
        return head + "Lower --batch-size, or run `tunekit fit` to find the largest micro-batch that fits."
    best = memory.estimate_max_batch(config, budget)
    if best == 0:
        return head + memory.cannot_fit_message(config, budget)
    accum = memory.grad_accum_for(cfg.batch_size * cfg.grad_accum, best)
    return head + (f"The estimator suggests --batch-size {best} --grad-accum {accum} (same samples per step); "
                   "`tunekit fit` finds the largest micro-batch by trying it.")


def find_micro_batch(cfg: TuneConfig, target_batch: int = 0, memory_gb: float = 0.0, name: str = "",
                     limit: int = 256, verbose: bool = True) -> dict:
    """The largest micro-batch of full-length (`max_length`) sequences that runs a training step, found by
    trying it: double, then bisect, catching out-of-memory. Full-length rows are the worst case, so a
    real run's shorter batches fit too. With `target_batch`, also the gradient accumulation that reaches it.

    `memory_gb` caps the GPU memory first (`limit_memory`), to answer "would this fit a smaller GPU?".
    Returns a result dict (the bench keys, `micro_batch`, `grad_accum`, the trials, the estimator's answer)."""
    import gc

    from tunekit import train as tr

    device, dtype = tr.resolve_runtime(cfg)
    if device != "cuda":
        raise RuntimeError("tunekit fit tries steps until the GPU runs out of memory: it needs a CUDA GPU. "
                           "On CPU, `tunekit estimate` answers from the estimator alone.")
    if memory_gb:
        limit_memory(memory_gb)
    vocab = cfg.vocab_size or len(tr.build_tokenizer(cfg))
    torch.manual_seed(cfg.seed)
    model, optimizer, scheduler, options = tr.build_training(cfg, vocab, device, dtype, 10**9, verbose)
    trials: list[dict] = []

    def fits(b: int) -> bool:
        # The first trial runs twice: its first step creates the optimizer states, which every later step holds.
        ids = torch.randint(0, vocab, (b, cfg.max_length), device=device)
        batch = {"input_ids": ids, "labels": ids}
        memory.reset_peak_memory(device)
        t0 = time.perf_counter()
        try:
            for _ in range(1 if trials else 2):
                tr.train_step(model, [batch], optimizer, scheduler, cfg.max_grad_norm, **options)
            torch.cuda.synchronize()
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        del ids, batch
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        peak = memory.peak_memory_gb(device)[0]
        trials.append({"batch": b, "fits": ok, "peak_gb": round(peak, 3), "seconds": round(time.perf_counter() - t0, 2)})
        if verbose:
            print(f"fit: micro-batch {b}: {'fits' if ok else 'out of memory'} (peak {peak:.2f} GB)")
        return ok

    best = memory.largest_fitting(fits, limit)
    budget = allocatable_bytes(device)
    config = {**config_dict(cfg), "vocab_size": vocab}
    if best == 0:
        raise RuntimeError(memory.cannot_fit_message(config, budget))
    accum = memory.grad_accum_for(target_batch, best) if target_batch else cfg.grad_accum
    peak = max(t["peak_gb"] for t in trials if t["fits"] and t["batch"] == best)
    result = {
        "name": name or f"fit_{cfg.preset}", "preset": cfg.preset, "gpu": gpu_name(), "world_size": 1,
        "tokens_per_s": None, "peak_memory_gb": peak,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "micro_batch": best, "grad_accum": accum, "global_batch": best * accum, "target_batch": target_batch,
        "memory_cap_gb": memory_gb or None, "allocatable_gb": round(budget / 1e9, 2),
        "estimate_micro_batch": memory.estimate_max_batch(config, budget, limit), "trials": trials,
        "config": config_dict(cfg), "versions": versions(),
    }
    if verbose:
        print(f"fit: largest micro-batch {best} x {cfg.max_length} (estimator: {result['estimate_micro_batch']}); "
              f"--batch-size {best} --grad-accum {accum} gives {best * accum} samples a step")
    return result


def reusable(path: str | Path, cfg: TuneConfig) -> dict | None:
    """The result saved at `path` if it was produced with this config on a GPU of this name, else None."""
    path = Path(path)
    if not path.exists():
        return None
    old = json.loads(path.read_text())
    return old if old.get("config") == config_dict(cfg) and old.get("gpu") == gpu_name() else None


def run_many(configs: dict[str, TuneConfig], out: str | Path, reuse: bool = True, memory_gb: float = 0.0,
             verbose: bool = True) -> dict[str, dict]:
    """Bench each named config in this process, one after another, saving `<out>/<name>.json`.

    With `reuse`, a saved result is read back instead of re-run when its config is the same and it came
    from a GPU of the same name (the line says so and gives its date). A config that runs out of memory
    is not saved: its entry is `{"name", "error"}` with the estimator's advice. `memory_gb` caps the GPU
    memory for these runs (`limit_memory`). Returns {name: result}."""
    import gc

    out = Path(out)
    results: dict[str, dict] = {}
    if memory_gb:
        limit_memory(memory_gb)
    try:
        for name, cfg in configs.items():
            path = out / f"{name}.json"
            if reuse and (old := reusable(path, cfg)):
                results[name] = old
                if verbose:
                    print(f"{name}: reusing the result of {old['date']} ({path.name})")
                continue
            try:
                results[name] = run_bench(cfg, name, verbose=False)
                save_result(results[name], out)
            except RuntimeError as e:
                if "out of GPU memory" not in str(e):
                    raise
                results[name] = {"name": name, "error": str(e)}
            finally:
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            if verbose:
                r = results[name]
                print(f"{name}: " + (r["error"].splitlines()[0] if "error" in r else
                                     f"{r['tokens_per_s']:,.0f} tok/s, peak {r['peak_memory_gb']:.2f} GB"))
    finally:
        if memory_gb:
            limit_memory(None)
    return results


def save_result(result: dict, out: str | Path) -> Path:
    """Write one result; `out` is a .json path or a folder (then `<folder>/<name>.json`)."""
    out = Path(out)
    path = out if out.suffix == ".json" else out / f"{result['name']}.json"
    checkpoint.atomic_write_json(path, result)
    return path


def load_results(*paths: str | Path) -> list[dict]:
    """Read result files (or every *.json in given folders), checking each has the required keys."""
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(p.glob("*.json")) if p.is_dir() else [p])
    results = []
    for f in files:
        try:
            r = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}: line {e.lineno}: not valid JSON ({e.msg})") from None
        missing = [k for k in REQUIRED_KEYS if k not in r]
        if missing:
            raise ValueError(f"{f}: not a tunekit result, missing keys {missing}")
        r["_file"] = str(f)
        results.append(r)
    return results


def format_table(results: list[dict]) -> str:
    """A markdown table: one row a result."""
    def mfu(r: dict) -> str:
        return "" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"

    def setup(r: dict) -> str:
        c = r.get("config", {})
        parts = [c.get("method", "?"), f"b{c.get('batch_size', '?')}x{c.get('max_length', '?')}"]
        if c.get("grad_accum", 1) > 1:
            parts.append(f"accum {c['grad_accum']}")
        if c.get("grad_ckpt"):
            parts.append("ckpt")
        return ", ".join(parts)

    head = ("| name | setup | gpu | tok/s per GPU | step s | peak alloc GB | MFU | date |\n"
            "|---|---|---|---|---|---|---|---|")
    rows = [f"| {r['name']} | {setup(r)} | {r['gpu']} | {r['tokens_per_s']:,.0f} | "
            f"{r.get('step_time_s', float('nan')):.3f} | {r['peak_memory_gb']:.2f} | {mfu(r)} | {r['date'][:10]} |"
            for r in results]
    return "\n".join([head, *rows])


def plot_results(results: list[dict], reference: dict[str, float] | None = None, title: str = ""):
    """Bars of tok/s and peak memory per result; `reference` adds labelled horizontal lines (tok/s)."""
    import matplotlib.pyplot as plt

    names = [r["name"] for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 0.5 * len(names) + 2))
    ax1.barh(names, [r["tokens_per_s"] for r in results], color="tab:blue")
    ax1.set_xlabel("tokens/s per GPU (higher is better)")
    for label, value in (reference or {}).items():
        ax1.axvline(value, ls="--", color="gray")
        ax1.text(value, len(names) - 0.5, f" {label}", rotation=90, va="top", fontsize=8, color="gray")
    ax2.barh(names, [r["peak_memory_gb"] for r in results], color="tab:orange")
    ax2.set_xlabel("peak allocated memory, GB (lower is better)")
    ax2.set_yticks([])
    fig.suptitle(title or f"{results[0]['gpu']}" if results else title)
    fig.tight_layout()
    return fig
