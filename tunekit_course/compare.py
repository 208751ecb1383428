"""Side by side: one LoRA/QLoRA training step, the same shapes, on the same GPU, back to back, in three stacks
(`tunekit bench --compare`, issue 14).

- `hf_peft`: the plain Hugging Face stack as its docs write it — `AutoModelForCausalLM` with SDPA attention,
  peft's `LoraConfig` on every linear layer, `model(input_ids, labels=...).loss.backward()` (the logits
  materialized), torch's fused AdamW; QLoRA through `BitsAndBytesConfig` (NF4, double quant, bf16 compute),
  checkpointing through `gradient_checkpointing_enable`.
- `tunekit`: the config's own step, as `tunekit bench` times it (`bench._bench_step`).
- `unsloth`: Unsloth's `FastLanguageModel` with its LoRA (`get_peft_model`), its checkpointing when the config
  asks for it, the same optimizer. Unsloth needs packages of its own (datasets < 5), so it runs from a separate
  site folder (`--unsloth-site`, built by `python -m tunekit_course.unsloth_site`), offline, from a random-init
  model and tokenizer saved locally with the same seed as the other two.

Each stack runs in a fresh process (its GPU memory gone when it exits; Unsloth patches transformers on import),
starting from the same random weights and adapters (same seeds) and the same random token ids, every
position a target. Each is timed by `bench.measure_step` (warm-up untimed, the median step), its peak memory is
`torch.cuda.max_memory_allocated` after loading, and its first loss is recorded: the stacks must agree on it
(`loss_agreement`), or they are not computing the same thing. One result file holds the three rows and the
ratios; the chart goes beside it. Absolute figures drift from machine to machine; the ratios of one run are
the figures that count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from tunekit.build import with_config_threads
from tunekit.results import code_file

STACKS = ("hf_peft", "tunekit", "unsloth")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf_step(cfg, vocab: int, device: str, dtype: torch.dtype):
    """The plain HF + peft stack's `step()`: one optimizer step, returning the loss."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tunekit import model as mdl
    from tunekit.build import run_arch

    arch = run_arch(cfg, vocab)
    if cfg.method == "qlora":
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(str(mdl.save_random_init(arch, torch.bfloat16, cfg.seed)),
                                                     quantization_config=quant, dtype=torch.bfloat16,
                                                     attn_implementation="sdpa", device_map={"": device},
                                                     trust_remote_code=False)
    else:
        torch.manual_seed(cfg.seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(arch, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    torch.manual_seed(cfg.seed + 1)
    model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    if cfg.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()  # from_pretrained gives eval mode, where transformers skips checkpointing
    return _plain_loop(model, cfg, vocab, device, dtype)


def _plain_loop(model, cfg, vocab: int, device: str, dtype: torch.dtype):
    """The step a plain loop writes: the model's own loss (labels = inputs) on each of the bench's micro-batches,
    divided by their number, backward, fused AdamW. Returns the step's loss."""
    from tunekit.bench.step import random_micro_batches

    micro = [ids.to(device) for ids in random_micro_batches(cfg, vocab)]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                  fused=device == "cuda")
    autocast = dtype != torch.float32 and device == "cuda"

    def step() -> torch.Tensor:
        total = torch.zeros((), device=device)
        for ids in micro:
            with torch.autocast(device, dtype=dtype, enabled=autocast):
                loss = model(input_ids=ids, labels=ids).loss / len(micro)
            loss.backward()
            total += loss.detach()
        if cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return step


def unsloth_folder(cfg, vocab: int) -> Path:
    """A folder Unsloth loads offline: the random-init model of `cfg` (bf16, saved once with the config's seed:
    `model.save_random_init`) beside a tokenizer, its files linked, not copied."""
    from tunekit import model as mdl
    from tunekit.build import run_arch
    from tunekit.io import atomic_output, cache_dir
    from tunekit.prepare import build_tokenizer

    source = mdl.save_random_init(run_arch(cfg, vocab), torch.bfloat16, cfg.seed)
    folder = cache_dir() / "unsloth" / source.name
    if (folder / "tokenizer_config.json").exists():
        return folder
    tokenizer = build_tokenizer(cfg)
    with atomic_output(folder, keep_existing=True) as tmp:
        tmp.mkdir()
        for f in source.iterdir():
            (tmp / f.name).symlink_to(f.resolve())
        tokenizer.save_pretrained(tmp)
    return folder


def _unsloth_step(cfg, vocab: int, device: str, dtype: torch.dtype, folder: str):
    from unsloth import FastLanguageModel  # first: it patches transformers and peft on import

    torch.manual_seed(cfg.seed)
    model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=cfg.max_length, dtype=torch.bfloat16,
                                                 load_in_4bit=cfg.method == "qlora", fix_tokenizer=False,
                                                 use_gradient_checkpointing="unsloth" if cfg.grad_ckpt else False)
    model = FastLanguageModel.get_peft_model(model, r=cfg.lora_r, target_modules=LORA_TARGETS,
                                             lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, bias="none",
                                             use_gradient_checkpointing="unsloth" if cfg.grad_ckpt else False,
                                             random_state=cfg.seed + 1)
    FastLanguageModel.for_training(model)
    return _plain_loop(model, cfg, vocab, device, dtype)


def _versions() -> dict:
    import importlib.metadata as md

    out = {"torch": torch.__version__}
    for pkg in ("transformers", "peft", "bitsandbytes", "torchao", "unsloth", "unsloth_zoo"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def run_stack(stack: str, cfg, folder: str = "") -> dict:
    """Time one stack's step of `cfg` in this process: a row of the comparison (tok/s, peak memory, first
    loss, step times)."""
    return with_config_threads(lambda cfg: _run_stack(stack, cfg, folder))(cfg)


def _run_stack(stack: str, cfg, folder: str) -> dict:
    from tunekit import bench, memory
    from tunekit.bench.step import _bench_step
    from tunekit.bench.timing import measure_step, median_error, spread
    from tunekit.build import resolve_runtime
    from tunekit.prepare import build_tokenizer

    cfg.validate()
    device, dtype = resolve_runtime(cfg)
    vocab = cfg.vocab_size or len(build_tokenizer(cfg))
    memory.reset_peak_memory(device)
    t0 = time.perf_counter()
    if stack == "tunekit":
        *_, step = _bench_step(cfg, device, dtype, vocab, verbose=False)
    elif stack == "hf_peft":
        step = _hf_step(cfg, vocab, device, dtype)
    elif stack == "unsloth":
        step = _unsloth_step(cfg, vocab, device, dtype, folder)
    else:
        raise ValueError(f"stack {stack!r}: choose one of {', '.join(STACKS)}")
    build_s = time.perf_counter() - t0
    memory.reset_peak_memory(device)
    first: list[float] = []
    warm: list[float] = []

    def timed():  # each stack's step returns its loss; the first one is kept
        loss = step()
        if not first:
            first.append(float(loss))

    with bench.speedups.tf32(cfg.tf32 and stack == "tunekit", device):
        times = measure_step(timed, cfg.bench_warmup, cfg.bench_steps, device, cfg.bench_max_steps,
                                   cfg.bench_target_error, warm)
    alloc, _ = memory.peak_memory_gb(device)
    median = statistics.median(times)
    tokens = cfg.batch_size * cfg.grad_accum * cfg.max_length
    return {"stack": stack, "tokens_per_s": round(tokens / median, 1), "peak_memory_gb": round(alloc, 3),
            "step_time_s": round(median, 5), "step_time_spread": round(spread(times), 4),
            "median_error": round(median_error(times), 4), "step_times_s": [round(t, 5) for t in times],
            "first_step_s": round(warm[0], 2) if warm else None, "build_s": round(build_s, 1),
            "first_loss": first[0] if first else None, "versions": _versions()}


# ---- the comparison: one child process per stack -------------------------------------------------------


def default_unsloth_site() -> str:
    """$TUNEKIT_UNSLOTH_SITE, else the repo's `.unsite/` when `unsloth_site` built one, else ''."""
    from tunekit.config import REPO_ROOT

    return os.environ.get("TUNEKIT_UNSLOTH_SITE") or (str(REPO_ROOT / ".unsite") if (REPO_ROOT / ".unsite").is_dir() else "")


def _child(args: list[str], env: dict | None = None, timeout: float = 1800,
           module: str = "tunekit_course.compare") -> tuple[dict | None, str]:
    """Run `python -m MODULE ARGS --json FILE` (a stack of a side-by-side race, in a fresh process) and return
    (what it wrote, or None; why not)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, "-m", module, *args, "--json", str(out)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                                  check=False)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout:g} s: {' '.join(cmd)}"
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join(proc.stderr.strip().splitlines()[-12:])
            return None, f"exit {proc.returncode}: {' '.join(cmd)}\n{tail}"
        return json.loads(out.read_text()), ""


def unsloth_env(site: str) -> dict:
    """The environment of the Unsloth process: its site folder and tunekit on the path, nothing else added
    (not `.devsite`: Unsloth needs datasets < 5), the hub off."""
    from tunekit.config import REPO_ROOT

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(site).resolve()), str(REPO_ROOT)])}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", UNSLOTH_DISABLE_STATISTICS="1")
    return env


def run_compare(preset: str, fields: list[str], name: str = "", stacks: tuple[str, ...] = STACKS,
                unsloth_site: str | None = None, verbose: bool = True) -> dict:
    """Bench `stacks` on `tunekit bench --preset PRESET FIELDS...`, one fresh process each, back to back, and
    return one result: a row per stack (or why it was skipped or failed), tunekit's ratios to the others, and
    the largest relative difference between their first losses (`loss_agreement`)."""
    from tunekit.presets import resolve
    from tunekit.results import new_result

    cfg = resolve(preset, fields)
    unknown = [s for s in stacks if s not in STACKS]
    if unknown:
        raise ValueError(f"--stacks {','.join(unknown)}: choose from {', '.join(STACKS)}")
    if cfg.method not in ("lora", "qlora"):
        raise ValueError(f"--compare compares LoRA/QLoRA stacks; config method is {cfg.method!r}")
    site = default_unsloth_site() if unsloth_site is None else unsloth_site
    base = ["--preset", preset, *fields]
    rows = []
    for stack in stacks:
        t0 = time.perf_counter()
        if stack == "unsloth":
            if not site or not Path(site).is_dir():
                rows.append({"stack": stack, "skipped": f"no Unsloth site folder ({site or 'none given'}): build one "
                             "with `python -m tunekit_course.unsloth_site`, or pass --unsloth-site"})
                if verbose:
                    print(f"{stack:<8} skipped: {rows[-1]['skipped']}", flush=True)
                continue
            prepared, why = _child(["--prepare", *base])
            row, why = _child(["--stack", stack, "--folder", prepared["folder"], *base], unsloth_env(site)) \
                if prepared else (None, why)
        else:
            row, why = _child(["--stack", stack, *base])
        rows.append(row or {"stack": stack, "error": why})
        if verbose:
            print(f"{stack:<8} " + (f"{row['tokens_per_s']:>9,.0f} tok/s  peak {row['peak_memory_gb']:6.2f} GB  "
                                    f"first loss {row['first_loss']:.4f}" if row else f"failed: {why}")
                  + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    ok = {r["stack"]: r for r in rows if "tokens_per_s" in r}
    ratios = {f"{a}_vs_{b}": round(ok[a]["tokens_per_s"] / ok[b]["tokens_per_s"], 3)
              for a in ("tunekit", "unsloth") for b in ("hf_peft", "unsloth") if a != b and a in ok and b in ok}
    losses = [r["first_loss"] for r in ok.values()]
    agreement = (max(losses) - min(losses)) / abs(statistics.median(losses)) if len(losses) > 1 else None
    ours = ok.get("tunekit", {})
    return new_result(name or f"compare_{preset}", cfg, ours.get("tokens_per_s"), ours.get("peak_memory_gb"),
                      code_files=(code_file(__file__),), call=f"compare.run_compare({preset!r}, {fields!r}, stacks={tuple(stacks)!r})", stacks=rows,
                      ratios=ratios, loss_agreement=None if agreement is None else round(agreement, 5),
                      weights="random init, the same seed in every stack",
                      data="random token ids, every position a target; the same ids in every stack")


def plot_compare(result: dict):
    """Bars of tok/s and peak memory for each stack of a comparison."""
    import matplotlib.pyplot as plt

    rows = [r for r in result["stacks"] if "tokens_per_s" in r]
    names = [r["stack"] for r in rows]
    colors = ["tab:green" if n == "tunekit" else "tab:gray" for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 0.6 * len(rows) + 1.8))
    for ax, key, fmt in ((ax1, "tokens_per_s", "{:,.0f}"), (ax2, "peak_memory_gb", "{:.1f}")):
        ax.barh(names, [r[key] for r in rows], color=colors)
        for i, r in enumerate(rows):  # each bar's value at its end, room kept for it
            ax.text(r[key], i, " " + fmt.format(r[key]), va="center", fontsize=8)
        ax.set_xlim(0, 1.18 * max(r[key] for r in rows))
    ax1.set_xlabel("tokens/s (higher is better)")
    ax2.set_xlabel("peak allocated GB (lower is better)")
    ax2.set_yticks([])
    c = result["config"]
    fig.suptitle(f"{result['gpu']}: {c['method']} b{c['batch_size']}x{c['max_length']}"
                 f"{', ckpt' if c['grad_ckpt'] else ''}", fontsize=9)  # which run and commit: the result file
    fig.tight_layout()
    return fig


def save_chart(result: dict, path: str | Path) -> Path:
    """The comparison's chart as a PNG at `path`, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tunekit.io import atomic_output

    path = Path(path)
    fig = plot_compare(result)
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """One stack in this process (`--stack`), or the Unsloth folder prepared (`--prepare`): what `run_compare`
    runs as its children. Writes a JSON row to `--json`."""
    from tunekit.io import atomic_write_json
    from tunekit.presets import resolve

    p = argparse.ArgumentParser(prog="python -m tunekit_course.compare", allow_abbrev=False)
    p.add_argument("--stack", choices=STACKS)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--folder", default="")
    p.add_argument("--preset", required=True)
    p.add_argument("--json", required=True)
    args, fields = p.parse_known_args(argv)
    cfg = resolve(args.preset, fields)
    if args.prepare:
        from tunekit.prepare import build_tokenizer

        row = {"folder": str(unsloth_folder(cfg, cfg.vocab_size or len(build_tokenizer(cfg))))}
    else:
        row = run_stack(args.stack, cfg, args.folder)
    atomic_write_json(args.json, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
