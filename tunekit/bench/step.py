"""The training step with everything else removed, timed properly (`bench.timing`), saved with its context.

`measure_step` runs warm-up steps first (allocator growth, kernel selection, autotuning), synchronizes the
GPU around every timed step and reports the median, which one slow step (a GC pause, a recompile) cannot
move. How many steps it times is decided by the spread it measures, not by habit: at least `bench_steps`,
then more until the median's standard error is under `bench_target_error` of it (or `bench_max_steps` is
reached). A batch-1 step, launch-bound, scatters by 10-30% from step to step on the H200; a batch-8 step by
under 1%: the first needs several times more steps for the same confidence. Each result records the
spread (`step_time_spread`, the interquartile range over the median) and the median's relative error.

Between runs in separate processes a configuration moves by more than within one run; `measure_noise`
measures that (the same config benched in N fresh processes), and `results.compare` calls a difference
smaller than either spread "same within noise".

Batches are random token ids filling every position, so the numbers compare with published figures at the
same shape; the model is random-init unless `model` names real weights. Each result is one JSON file written
through `results.new_result` (the shared header: config, versions, GPU, date, commit and code hash).

MFU (model FLOPs utilisation, https://arxiv.org/abs/2204.02311 appendix B) counts the FLOPs the model needs
— not the recomputation that checkpointing adds — against the GPU's dense bf16 peak from its datasheet.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from tunekit import distributed, memory, speedups
from tunekit.bench.fit import oom_advice
from tunekit.bench.timing import (
    PACKED_DOCS,
    compile_cache_state,
    flops_per_token,
    measure_step,
    median_error,
    packed_positions,
    peak_flops,
    spread,
)
from tunekit.build import build_training, resolve_runtime, with_config_threads
from tunekit.config import TuneConfig
from tunekit.model import count_parameters
from tunekit.optim import optimizer_state_bytes
from tunekit.prepare import build_tokenizer
from tunekit.results import format_table, gpu_name, new_result, reusable, save_result
from tunekit.step import count_targets, to_device, train_step


def _runtime(cfg: TuneConfig, verbose: bool):
    """(device, dtype, vocabulary size, whether this process prints) for a benchmark of `cfg`; under torchrun
    the process group is up (every rank times its own share; each step synchronises them all)."""
    cfg.validate()  # fields may have been set after construction
    device, dtype = resolve_runtime(cfg)
    distributed.init(device)
    return device, dtype, cfg.vocab_size or len(build_tokenizer(cfg)), verbose and distributed.is_main()


def random_micro_batches(cfg: TuneConfig, vocab: int) -> list[torch.Tensor]:
    """The benchmark's fixed token ids: `grad_accum` micro-batches of `batch_size` x `max_length`, from a generator
    seeded with the config's seed (`compare` feeds every stack the same ones)."""
    g = torch.Generator().manual_seed(cfg.seed)
    return [torch.randint(0, vocab, (cfg.batch_size, cfg.max_length), generator=g) for _ in range(cfg.grad_accum)]


def _bench_step(cfg: TuneConfig, device: str, dtype: torch.dtype, vocab: int, verbose: bool):
    """(model, optimizer, scheduler, step): the config's training pieces and one optimizer step of them on
    fixed random tokens (every position a target; packed rows when `packing` is pack); `step()` returns the
    step's loss."""
    torch.manual_seed(cfg.seed)
    model, optimizer, scheduler, options = build_training(cfg, vocab, device, dtype, 10**9, verbose)
    micro, targets = [], 0
    for ids in random_micro_batches(cfg, vocab):
        batch = {"input_ids": ids, "labels": ids.clone()}
        if cfg.packing == "pack":  # PACKED_DOCS equal samples a row, attending only within themselves
            batch["position_ids"] = packed_positions(cfg.batch_size, cfg.max_length)
        targets += count_targets([batch])  # on the host, once: as `tunekit train` counts each step's
        micro.append(to_device(batch, device, memory.host_embedded(model)))
    targets = distributed.all_reduce_sum(targets)

    def step() -> torch.Tensor:  # the step's loss (not synchronised: reading it is the caller's choice)
        return train_step(model, micro, optimizer, scheduler, cfg.max_grad_norm, n_targets=targets,
                          **options)["loss"]

    return model, optimizer, scheduler, step


@with_config_threads
def run_bench(cfg: TuneConfig, name: str = "", verbose: bool = True, memory_cap_gb: float | None = None) -> dict:
    """Build the model of `cfg`, time its training step, and return a result dict (see module docstring).
    `memory_cap_gb` records the allocator cap the caller set (it sets none itself)."""
    device, dtype, vocab, verbose = _runtime(cfg, verbose)
    memory.reset_peak_memory(device)
    t0 = time.perf_counter()
    model, optimizer, _, step = _bench_step(cfg, device, dtype, vocab, verbose)
    build_s = time.perf_counter() - t0

    # The step's peak, not the load's (recorded as load_peak_gb): a 4-bit load quantizes bf16 weights on the
    # way, and a random-init model is built in bf16 first.
    load_peak, _ = memory.peak_memory_gb(device)
    memory.reset_peak_memory(device)
    cache = compile_cache_state() if cfg.compile != "none" else None  # before anything compiles
    warmup_times: list[float] = []
    try:
        with speedups.tf32(cfg.tf32, device):
            times = measure_step(step, cfg.bench_warmup, cfg.bench_steps, device, cfg.bench_max_steps,
                                 cfg.bench_target_error, warmup_times)
    except torch.OutOfMemoryError:
        raise RuntimeError(oom_advice(cfg)) from None
    alloc, reserved = memory.peak_memory_gb(device)
    median = statistics.median(times)
    tokens = cfg.batch_size * cfg.grad_accum * cfg.max_length
    trainable, total = count_parameters(model)
    fpt = flops_per_token(cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads or cfg.num_heads,
                          cfg.intermediate_size, vocab, cfg.max_length, cfg.method,
                          trainable if cfg.method != "full" else 0, cfg.head_dim)
    gpu = gpu_name()
    peak = peak_flops(gpu) if device == "cuda" else None
    achieved = fpt * tokens / median
    result = new_result(
        name or cfg.preset, cfg, round(tokens / median, 1), round(alloc, 3),
        call=f"bench.run_bench(TuneConfig(**config), name={name or cfg.preset!r})"
             + (f" under a {memory_cap_gb:g} GB allocator cap" if memory_cap_gb else ""),
        memory_measure="torch.cuda.max_memory_allocated" if device == "cuda" else "process peak RSS",
        peak_reserved_gb=round(reserved, 3), load_peak_gb=round(load_peak, 3), memory_cap_gb=memory_cap_gb,
        step_time_s=round(median, 5), step_time_spread=round(spread(times), 4),
        median_error=round(median_error(times), 4), step_times_s=[round(t, 5) for t in times],
        tokens_per_step=tokens, model_tflops_per_s=round(achieved / 1e12, 2),
        mfu=round(achieved / peak, 4) if peak else None, params_total=total, params_trainable=trainable,
        build_s=round(build_s, 1), first_step_s=round(warmup_times[0], 2) if warmup_times else None,
        warmup_step_times_s=[round(t, 3) for t in warmup_times], compile_cache=cache,
        optimizer_state_gb=round(optimizer_state_bytes(optimizer) / 1e9, 4),
        weights=cfg.model or "random-init",
        data="random token ids, every position a target" + (
            f"; rows packed with {PACKED_DOCS} samples each" if cfg.packing == "pack" else ""),
    )
    if verbose:
        print(format_table([result]))
    distributed.barrier()  # no rank tears the group down while another still talks to it
    return result


# ---- where a step's time goes -----------------------------------------------------------------------------

# Kernel/operator name fragments (lower case) for each category, tried in order; the rest is "elementwise,
# other" (adds, multiplies, reductions the other categories do not claim).
PROFILE_CATEGORIES = (
    ("attention", ("attention", "flash", "fmha", "sdpa", "flex", "cudnn_sdp", "softmax_fwd")),
    ("dequantize", ("dequant", "4bit", "nf4")),
    ("optimizer", ("adam", "lion", "multi_tensor", "_foreach_")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss", "_chunkedlmloss")),
    ("communication", ("nccl", "all_reduce", "allreduce", "reduce_scatter", "all_gather")),
    ("matmul", ("gemm", "matmul", "aten::mm", "aten::addmm", "aten::bmm", "cutlass", "xmma", "nvjet", "sm90_", "_mm")),
    ("fp8 quantize", ("amax", "e4m3", "float8")),  # scaling activations to FP8: a max over each row, then a cast
    ("norm, activation, rope", ("rms", "norm", "silu", "swiglu", "rotary", "rope")),
    ("copy, cast", ("copy", "cast", "fill", "memcpy", "memset")),
)

# Inductor's pointwise and reduction kernels (`triton_poi_`, `triton_red_`, `triton_per_`) are named after every
# operation fused into them, the matmul whose input they prepare included ("triton_red_fused__scaled_mm_..._amax_"
# quantizes an activation for an FP8 matmul): they are never a GEMM (its own kernel, or inductor's `triton_tem_`).
INDUCTOR_FUSED = ("triton_poi_", "triton_red_", "triton_per_")


def categorize(name: str) -> str:
    low = name.lower()
    fused = low.startswith(INDUCTOR_FUSED)
    return next((cat for cat, keys in PROFILE_CATEGORIES if not (fused and cat == "matmul")
                 and any(k in low for k in keys)), "elementwise, other")


def by_launcher(events, steps: int, top: int = 40) -> list[dict]:
    """GPU kernel time per step grouped by the operator that launched each kernel and whether it ran in the
    forward or the backward (an ancestor is an autograd `...Backward` function): where `aten::addmm` in the
    forward spends its time, memcpys included, which kernel names alone do not say. `events` are the profiler's
    (`prof.events()`): each launching CPU event carries its kernels (`.kernels`, durations in microseconds)."""
    from torch.autograd import DeviceType

    groups: dict[tuple[str, str], dict] = {}
    for e in events:
        if e.device_type != DeviceType.CPU or not getattr(e, "kernels", None):
            continue
        phase, p = "forward", e
        while p is not None:
            if "Backward" in p.name or p.name.startswith("autograd::engine"):
                phase = "backward"
                break
            p = p.cpu_parent
        g = groups.setdefault((e.name[:100], phase), {"seconds": 0.0, "launches": 0, "kernels": {}})
        for k in e.kernels:
            s = k.duration / 1e6 / steps
            g["seconds"] += s
            g["launches"] += 1
            g["kernels"][k.name[:100]] = g["kernels"].get(k.name[:100], 0.0) + s
    rows = [{"op": op, "phase": phase, "seconds": round(g["seconds"], 6), "launches": round(g["launches"] / steps, 1),
             "kernels": {n: round(v, 6) for n, v in sorted(g["kernels"].items(), key=lambda kv: -kv[1])[:3]}}
            for (op, phase), g in groups.items()]
    return sorted(rows, key=lambda r: -r["seconds"])[:top]


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::_grouped_mm")


def gemm_shapes(averages, steps: int, cuda: bool, top: int = 30) -> list[dict]:
    """The matrix products of a profile by input shapes (`key_averages(group_by_input_shape=True)` of a
    profile with `record_shapes`), time per step on the device (CUDA) or the CPU: which products are the
    base weights' and which LoRA's thin ones."""
    rows = [{"op": e.key, "shapes": str(e.input_shapes)[:160], "calls": round(e.count / steps, 1),
             "seconds": round((e.device_time_total if cuda else e.cpu_time_total) / 1e6 / steps, 6)}
            for e in averages if e.key in GEMM_OPS]
    return sorted((r for r in rows if r["seconds"] > 0), key=lambda r: -r["seconds"])[:top]


@with_config_threads
def profile_step(cfg: TuneConfig, steps: int = 3, warmup: int = 2, name: str = "", verbose: bool = True) -> dict:
    """Where one optimizer step of `cfg` spends its time: `torch.profiler` over `steps` steps after `warmup`,
    each kernel's own time (GPU kernels on CUDA, operators on CPU) summed by category (`PROFILE_CATEGORIES`,
    by name), as shares of the total, with the ten costliest kernels; on CUDA also the kernel time by the
    operator that launched it (`by_launcher`), and the matrix products by shape (`gemm_shapes`). The first
    thing to read before making a step faster."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    device, dtype, vocab, verbose = _runtime(cfg, verbose)
    *_, step = _bench_step(cfg, device, dtype, vocab, verbose)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with speedups.tf32(cfg.tf32, device):
        for _ in range(warmup):
            step()
        sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        t0 = time.perf_counter()
        with profile(activities=activities, record_shapes=True) as prof:
            for _ in range(steps):
                step()
            sync()
        wall = (time.perf_counter() - t0) / steps
    kernels = {}
    for e in prof.key_averages():
        # On CUDA the kernels themselves, not the operators that launched them (an operator's "self device
        # time" is its kernels' time again: counting both doubled the total), nor the ranges that only
        # annotate them (inductor's "## Call CompiledFxGraph ... ##" spans a compiled graph's kernels). On CPU
        # the operators' own time.
        if device == "cuda":
            kernel = e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False) \
                and not e.key.startswith("## ")
            own = e.self_device_time_total if kernel else 0.0
        else:
            own = e.self_cpu_time_total if e.key.startswith("aten::") else 0.0
        if own > 0:
            kernels[e.key] = kernels.get(e.key, 0.0) + own / 1e6 / steps
    total = sum(kernels.values())
    by_category: dict[str, float] = {}
    for k, v in kernels.items():
        by_category[categorize(k)] = by_category.get(categorize(k), 0.0) + v
    breakdown = sorted(({"category": c, "seconds": round(v, 6), "share": round(v / total, 4)}
                        for c, v in by_category.items()), key=lambda r: -r["seconds"])
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:10]
    launchers = by_launcher(prof.events(), steps) if device == "cuda" else []
    result = new_result(
        name or f"profile_{cfg.preset}", cfg, None, None,
        call=f"bench.profile_step(TuneConfig(**config), {steps}, {warmup}, name={name or 'profile_' + cfg.preset!r})",
        step_wall_s=round(wall, 5), kernel_s_per_step=round(total, 5),
        measure="GPU kernels' own time" if device == "cuda" else "CPU operators' own time",
        breakdown=breakdown, top=[{"kernel": k[:120], "seconds": round(v, 6), "category": categorize(k)} for k, v in top],
        by_launcher=launchers,
        gemms=gemm_shapes(prof.key_averages(group_by_input_shape=True), steps, device == "cuda"))
    if verbose:
        print(f"{result['name']}: {1e3 * wall:.1f} ms a step, {1e3 * total:.1f} ms in kernels ({result['measure']})")
        for r in breakdown:
            print(f"  {r['category']:<24} {1e3 * r['seconds']:9.2f} ms  {r['share']:6.1%}")
        if launchers:
            print("  by the operator that launched them:")
        for r in launchers[:8]:
            print(f"  {1e3 * r['seconds']:9.2f} ms  {r['launches']:6.0f} kernels  {r['op']} ({r['phase']})")
        print("  the costliest matrix products, by input shapes:")
        for g in result["gemms"][:5]:
            print(f"  {1e3 * g['seconds']:9.2f} ms  {g['calls']:6.0f} calls    {g['op']} {g['shapes']}")
    return result


# ---- the training loop itself, on real data ------------------------------------------------------------


# ---- an epoch from nothing (lesson 5) ---------------------------------------------------------------------


# ---- what fits -----------------------------------------------------------------------------------------


def run_many(configs: dict[str, TuneConfig], out: str | Path, reuse: bool = True, memory_gb: float = 0.0,
             verbose: bool = True) -> dict[str, dict]:
    """Bench each named config in this process, one after another, saving `<out>/<name>.json`.

    With `reuse`, a saved result is read back instead of re-run only when the same code made it
    (`results.reusable`: config, GPU, package versions and the library's code hash all match; the line says
    so and gives its commit and date). A config that runs out of memory is not saved: its entry is
    `{"name", "error"}` with the estimator's advice. `memory_gb` caps the GPU memory for these runs
    (`memory.memory_cap`) and is recorded in each result. Returns {name: result}."""
    import gc

    out = Path(out)
    results: dict[str, dict] = {}
    with memory.memory_cap(memory_gb):
        for name, cfg in configs.items():
            path = out / f"{name}.json"
            if reuse and (old := reusable(path, cfg)):
                results[name] = old
                if verbose:
                    print(f"{name}: reusing the result of {old['date']}, measured by the same code")
                continue
            try:
                results[name] = run_bench(cfg, name, verbose=False, memory_cap_gb=memory_gb or None)
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
                                     f"{r['tokens_per_s']:,.0f} tok/s (±{r['step_time_spread']:.0%} over "
                                     f"{len(r['step_times_s'])} steps), peak {r['peak_memory_gb']:.2f} GB"))
    return results


def measure_noise(preset: str, args: list[str], name: str, runs: int = 3, verbose: bool = True) -> dict:
    """Run-to-run noise: bench `tunekit bench --preset PRESET ARGS...` in `runs` fresh processes and return a
    result with each run's median and the spread between them, `(max - min) / median` of the medians — what
    separates two measurements of one config taken apart, which one run's step-to-step spread does not show."""
    import json
    import subprocess
    import sys
    import tempfile

    medians, files = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            path = Path(tmp) / f"run{i}.json"
            cmd = [sys.executable, "-m", "tunekit.cli", "bench", "--preset", preset, *args, "--name", f"{name}_run{i}",
                   "--out", str(path)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
            files.append(json.loads(path.read_text()))
            medians.append(files[-1]["step_time_s"])
    med = statistics.median(medians)
    result = new_result(
        name, TuneConfig(**files[0]["config"]), statistics.median(f["tokens_per_s"] for f in files), max(f["peak_memory_gb"] for f in files),
        call=f"bench.measure_noise({preset!r}, {args!r}, runs={runs})",
        runs=[{k: f[k] for k in ("tokens_per_s", "step_time_s", "step_time_spread", "median_error", "step_times_s")}
              for f in files],
        between_run_spread=round((max(medians) - min(medians)) / med, 4),
        within_run_spread=round(max(f["step_time_spread"] for f in files), 4),
    )
    if verbose:
        print(f"{name}: {runs} processes, medians {', '.join(f'{m:.4f}' for m in medians)} s: between runs "
              f"±{result['between_run_spread']:.1%}, within a run (IQR) up to {result['within_run_spread']:.1%}")
    return result
