"""Benchmarks: the training step with everything else removed, timed properly, saved with its context.

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

from tunekit import estimate, memory, speedups
from tunekit.config import TuneConfig, config_dict
from tunekit.results import gpu_name, new_result, reusable, save_result

# Dense bf16 tensor-core peaks from vendor datasheets (FLOP/s), matched by substring of the device name.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12,
             "RTX 4090": 165e12, "RTX 3090": 71e12, "A6000": 155e12}


def peak_flops(name: str) -> float | None:
    for key, value in PEAK_BF16.items():
        if key in name:
            return value
    return None


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


def median_error(times: list[float]) -> float:
    """The relative standard error of the median of `times`: 1.2533 sigma / sqrt(n) / median, with sigma
    estimated robustly from the median absolute deviation (one stray step does not inflate it)."""
    if len(times) < 3:
        return float("inf")
    med = statistics.median(times)
    sigma = 1.4826 * statistics.median(abs(t - med) for t in times)
    return 1.2533 * sigma / len(times) ** 0.5 / med


def spread(times: list[float]) -> float:
    """The interquartile range of `times` over their median (0 for fewer than 4)."""
    if len(times) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / statistics.median(times)


def measure_step(step_fn, warmup: int, steps: int, device: str, max_steps: int | None = None,
                 target_error: float = 0.0, warmup_times: list | None = None) -> list[float]:
    """Seconds per call of `step_fn`: `warmup` untimed calls, then at least `steps` timed ones, and more (up
    to `max_steps`) while the median's relative standard error is above `target_error`. The warm-up calls'
    own seconds (the first one compiles, under --compile) are appended to `warmup_times` when given."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        t0 = time.perf_counter()
        step_fn()
        sync()
        if warmup_times is not None:
            warmup_times.append(time.perf_counter() - t0)
    times: list[float] = []
    while len(times) < steps or (len(times) < (max_steps or steps) and median_error(times) > target_error):
        t0 = time.perf_counter()
        step_fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def compile_cache_state() -> dict:
    """Where inductor keeps its compiled kernels and whether that cache held anything yet (`cold`: a first
    compile; `warm`: one that reads earlier kernels back). Set TORCHINDUCTOR_CACHE_DIR to an empty folder for
    a cold measurement."""
    import getpass
    import os
    import tempfile

    folder = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or
                  Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")  # inductor's default
    cold = not folder.exists() or not any(folder.iterdir())
    return {"dir": str(folder), "state": "cold" if cold else "warm"}


def _runtime(cfg: TuneConfig, verbose: bool):
    """(device, dtype, vocabulary size, whether this process prints) for a benchmark of `cfg`; under torchrun
    the process group is up (every rank times its own share; each step synchronises them all)."""
    from tunekit import distributed
    from tunekit import train as tr

    cfg.validate()  # fields may have been set after construction
    device, dtype = tr.resolve_runtime(cfg)
    distributed.init(device)
    return device, dtype, cfg.vocab_size or len(tr.build_tokenizer(cfg)), verbose and distributed.is_main()


def random_micro_batches(cfg: TuneConfig, vocab: int) -> list[torch.Tensor]:
    """The benchmark's fixed token ids: `grad_accum` micro-batches of `batch_size` x `max_length`, from a generator
    seeded with the config's seed (`compare` feeds every stack the same ones)."""
    g = torch.Generator().manual_seed(cfg.seed)
    return [torch.randint(0, vocab, (cfg.batch_size, cfg.max_length), generator=g) for _ in range(cfg.grad_accum)]


def _bench_step(cfg: TuneConfig, device: str, dtype: torch.dtype, vocab: int, verbose: bool):
    """(model, optimizer, scheduler, step): the config's training pieces and one optimizer step of them on
    fixed random tokens (every position a target; packed rows when `packing` is pack); `step()` returns the
    step's loss."""
    from tunekit import train as tr

    torch.manual_seed(cfg.seed)
    model, optimizer, scheduler, options = tr.build_training(cfg, vocab, device, dtype, 10**9, verbose)
    micro = []
    for ids in random_micro_batches(cfg, vocab):
        batch = {"input_ids": ids, "labels": ids.clone()}
        if cfg.packing == "pack":  # PACKED_DOCS equal samples a row, attending only within themselves
            batch["position_ids"] = packed_positions(cfg.batch_size, cfg.max_length)
        micro.append(tr.to_device(batch, device))

    def step() -> torch.Tensor:  # the step's loss (not synchronised: reading it is the caller's choice)
        return tr.train_step(model, micro, optimizer, scheduler, cfg.max_grad_norm, **options)["loss"]

    return model, optimizer, scheduler, step


def run_bench(cfg: TuneConfig, name: str = "", verbose: bool = True, memory_cap_gb: float | None = None) -> dict:
    """Build the model of `cfg`, time its training step, and return a result dict (see module docstring).
    `memory_cap_gb` records the allocator cap the caller set (it sets none itself)."""
    from tunekit import distributed
    from tunekit.model import count_parameters

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
                          trainable if cfg.method != "full" else 0)
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
        optimizer_state_gb=round(speedups.optimizer_state_bytes(optimizer) / 1e9, 4),
        weights=cfg.model or "random-init",
        data="random token ids, every position a target" + (
            f"; rows packed with {PACKED_DOCS} samples each" if cfg.packing == "pack" else ""),
    )
    if verbose:
        from tunekit.results import format_table

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
    ("norm, activation, rope", ("rms", "norm", "silu", "swiglu", "rotary", "rope")),
    ("copy, cast", ("copy", "cast", "fill")),
)


def categorize(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in PROFILE_CATEGORIES if any(k in low for k in keys)), "elementwise, other")


def profile_step(cfg: TuneConfig, steps: int = 3, warmup: int = 2, name: str = "", verbose: bool = True) -> dict:
    """Where one optimizer step of `cfg` spends its time: `torch.profiler` over `steps` steps after `warmup`,
    each kernel's own time (GPU kernels on CUDA, operators on CPU) summed by category (`PROFILE_CATEGORIES`,
    by name), as shares of the total, with the ten costliest kernels. The first thing to read before making a
    step faster (issue 14)."""
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
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            sync()
        wall = (time.perf_counter() - t0) / steps
    kernels = {}
    for e in prof.key_averages():
        # On CUDA the kernels themselves, not the operators that launched them (an operator's "self device
        # time" is its kernels' time again: counting both doubled the total). On CPU the operators' own time.
        if device == "cuda":
            own = e.self_device_time_total if e.device_type == DeviceType.CUDA else 0.0
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
    result = new_result(
        name or f"profile_{cfg.preset}", cfg, None, None,
        call=f"bench.profile_step(TuneConfig(**config), {steps}, {warmup}, name={name or 'profile_' + cfg.preset!r})",
        step_wall_s=round(wall, 5), kernel_s_per_step=round(total, 5),
        measure="GPU kernels' own time" if device == "cuda" else "CPU operators' own time",
        breakdown=breakdown, top=[{"kernel": k[:120], "seconds": round(v, 6), "category": categorize(k)} for k, v in top])
    if verbose:
        print(f"{result['name']}: {1e3 * wall:.1f} ms a step, {1e3 * total:.1f} ms in kernels ({result['measure']})")
        for r in breakdown:
            print(f"  {r['category']:<24} {1e3 * r['seconds']:9.2f} ms  {r['share']:6.1%}")
    return result


# ---- the training loop itself, on real data ------------------------------------------------------------


def _scratch_dir(kind: str) -> Path:
    """A scratch run folder: one for all ranks of a torchrun launch (named by its rendezvous), else this
    process's own."""
    import os
    import tempfile

    from tunekit import distributed

    job = (f"{os.environ.get('MASTER_ADDR')}-{os.environ.get('MASTER_PORT')}" if distributed.launched()
           else str(os.getpid()))
    return Path(tempfile.gettempdir()) / f"tunekit-{kind}-{job}"


def _train_in_scratch(run: TuneConfig, kind: str, fresh: bool = False, **train_kwargs):
    """`train.train(run, overwrite=True, **train_kwargs)` in the scratch folder `_scratch_dir(kind)`, removed
    afterwards; `fresh` empties it first, tokenized data included (`--overwrite` keeps that), and removes the
    config's entry in the prepared-data cache. Returns
    (summary, metrics rows, wall seconds) on rank 0, None on the others."""
    import dataclasses
    import shutil

    from tunekit import distributed
    from tunekit import train as tr

    tmp = _scratch_dir(kind)
    try:
        if fresh and distributed.is_main():  # from nothing: not even the prepared-data cache
            shutil.rmtree(tmp, ignore_errors=True)
            if run.tokenize != "in_loop":
                from tunekit import prepared

                shutil.rmtree(prepared.cache_folder(tr.prepare_key(run)), ignore_errors=True)
        t0 = time.perf_counter()
        summary = tr.train(dataclasses.replace(run, out_dir=str(tmp)), overwrite=True, **train_kwargs)
        wall = time.perf_counter() - t0
        rows = tr.read_metrics(tmp)
        distributed.barrier()  # every rank has finished before rank 0 removes the folder
    finally:
        if distributed.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
    return (summary, rows, wall) if distributed.is_main() else None


def run_train_loop(cfg: TuneConfig, name: str = "", verbose: bool = True) -> dict:
    """Time `tunekit train` itself: the config's real data, prepared and batched as a run does it (`packing`
    and all), the DataLoader, the step, the metrics row each step — everything the bare-step bench leaves out.

    Runs `train.train` in a scratch folder for `bench_max_steps` steps of the config's schedule (stopped there,
    as a kill would, so nothing is saved), logging every step. The first `bench_warmup` steps are not timed
    (FlexAttention compiles its kernel in the first). `tokens_per_s` counts real (non-pad) tokens per GPU:
    the timed steps' tokens over their wall time. Tokenizing before the loop is not timed. Under torchrun
    every rank trains; rank 0 returns the result, the others None."""
    import dataclasses

    from tunekit import distributed

    cfg.validate()
    steps = cfg.bench_max_steps
    if steps <= cfg.bench_warmup + 2:
        raise ValueError(f"bench_max_steps ({steps}) must exceed bench_warmup ({cfg.bench_warmup}) by at least 3")
    verbose = verbose and distributed.is_main()
    if verbose:
        print(f"training {steps} steps of `tunekit train --preset {cfg.preset}` on {cfg.data} in "
              f"{_scratch_dir('train-loop')} ...", flush=True)
    run = dataclasses.replace(cfg, log_every=1, save_every=0, max_steps=max(cfg.max_steps, steps), epochs=0.0)
    done = _train_in_scratch(run, "train-loop", stop_after=steps, progress=False)
    if done is None:
        return None
    summary, rows, wall = done
    world = distributed.world_size()
    previous = {"samples": 0, "tokens": 0}
    per_step = []  # (seconds, real tokens, samples) of each step
    for r in rows:  # the counts are of all ranks: per GPU, divided by the world size
        tokens, samples = r["tokens"] - previous["tokens"], r["samples"] - previous["samples"]
        per_step.append((tokens / r["tok_per_s"], tokens / world, samples / world))
        previous = r
    timed = per_step[cfg.bench_warmup:]
    times = [t for t, _, _ in timed]
    seconds, tokens, samples = sum(times), sum(n for _, n, _ in timed), sum(k for _, _, k in timed)
    slots = cfg.batch_size * cfg.grad_accum * cfg.max_length  # packed rows are always full width
    result = new_result(
        name or f"train_{cfg.preset}", cfg, round(tokens / seconds, 1), rows[-1]["peak_mem_gb"],
        call=f"bench.run_train_loop(TuneConfig(**config), name={name or 'train_' + cfg.preset!r})",
        memory_measure="torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "process peak RSS",
        packing=summary["packing"], step_time_s=round(statistics.median(times), 5),
        step_time_spread=round(spread(times), 4), median_error=round(median_error(times), 4),
        step_times_s=[round(t, 5) for t in times], real_tokens_per_step=round(tokens / len(timed), 1),
        samples_per_s=round(samples / seconds, 1), samples_per_step=round(samples / len(timed), 1),
        padding_fraction=round(1 - tokens / len(timed) / slots, 4) if summary["packing"] == "pack" else None,
        timed_steps=len(timed), wall_s=round(wall, 1), weights=cfg.model or "random-init",
        data=f"{cfg.data}: real records, batches as `tunekit train` makes them ({summary['packing']}); tokens/s "
             "counts real (non-pad) tokens",
    )
    if verbose:
        print(f"batches: {summary['data']['packing_reason']}")
        print(f"{result['name']}: {result['tokens_per_s']:,.0f} real tok/s, {result['samples_per_s']:,.1f} samples/s "
              f"({result['samples_per_step']:.1f} samples a step, {len(timed)} steps timed after "
              f"{cfg.bench_warmup}), peak {result['peak_memory_gb']:.2f} GB")
    return result


# ---- an epoch from nothing (lesson 5) ---------------------------------------------------------------------


def run_epoch(cfg: TuneConfig, fraction: float = 1.0, name: str = "", verbose: bool = True) -> dict:
    """The wall-clock time of `tunekit train --epochs FRACTION` from nothing, in a fresh folder: tokenizing
    (offline tokenization is part of what a recipe pays; `tokenized_from_cache` says whether `datasets` had it
    already), building the model, compiling, every step, the held-out evaluation. `epoch_s_projected` is what
    a whole epoch would take: the one-time parts (the first step among them: it compiles) plus the other
    steps' time / `fraction` (measured whole when `fraction` is 1). `tokens_per_s` counts real tokens over
    those other steps, per GPU; `curve` is (seconds since start, loss) for a loss-against-time plot. Rank 0
    returns the result, the others None."""
    import dataclasses

    from tunekit import distributed

    if not 0 < fraction <= 1:
        raise ValueError(f"fraction {fraction}: a share of one epoch, in (0, 1]")
    verbose = verbose and distributed.is_main()
    run = dataclasses.replace(cfg, epochs=fraction, save_every=0, log_every=1)
    done = _train_in_scratch(run, "epoch", fresh=True, progress=verbose)
    if done is None:
        return None
    summary, rows, wall = done
    world = distributed.world_size()
    t = summary["timings"]
    steps_s = t["train_s"] - t["eval_s"]
    # Paid once a run, whatever its length: starting, tokenizing, building, and the first step (compiling,
    # CUDA's warm-up). Only the steps after it scale with the share of the epoch.
    first = t["first_step_s"] if len(rows) > 1 else 0.0
    once = t["start_s"] + t["prepare_s"] + t["build_s"] + first
    tokens = (summary["tokens_seen"] - (rows[0]["tokens"] if first else 0)) / world
    steady_s = steps_s - first
    per_token = flops_per_token(cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads or cfg.num_heads,
                                cfg.intermediate_size, cfg.vocab_size or summary["vocab_size"], cfg.max_length,
                                cfg.method, summary["params_trainable"] if cfg.method != "full" else 0)
    gpu = gpu_name()
    peak = peak_flops(gpu) if torch.cuda.is_available() else None
    every = max(1, len(rows) // 300)
    result = new_result(
        name or f"epoch_{cfg.preset}", cfg, round(tokens / steady_s, 1), max(r["peak_mem_gb"] for r in rows),
        call=f"bench.run_epoch(TuneConfig(**config), {fraction!r}, name={name or 'epoch_' + cfg.preset!r})",
        memory_measure="torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "process peak RSS",
        fraction=fraction, wall_s=round(wall, 1), timings=t, steps=summary["steps"],
        epoch_s_projected=round(once + steady_s / fraction + t["eval_s"], 1),
        samples_seen=summary["samples_seen"], tokens_seen=summary["tokens_seen"], tokens_timed=round(tokens),
        packing=summary["packing"], tokenize=cfg.tokenize, tokenized_from_cache=bool(summary["data"].get("cached")),
        eval_loss=summary["eval_loss"], final_loss=summary["final_loss"],
        mfu=round(per_token * tokens / steady_s / peak, 4) if peak else None,
        curve=[[r["elapsed_s"], r["loss"]] for r in rows[::every]], weights=cfg.model or "random-init",
        data=f"{cfg.data}: {fraction:g} of an epoch from a fresh folder; tokens/s counts real tokens over the "
             "steps after the first (which compiles and warms up)")
    if verbose:
        print(f"{result['name']}: {fraction:g} epoch in {wall:,.0f} s (start {t['start_s']:.0f} s, data "
              f"{t['prepare_s']:.0f} s, build {t['build_s']:.0f} s, steps {steps_s:,.0f} s, eval {t['eval_s']:.0f} s); "
              f"{result['tokens_per_s']:,.0f} real tok/s; a whole epoch: {result['epoch_s_projected']:,.0f} s")
    return result


# ---- what fits -----------------------------------------------------------------------------------------


def oom_advice(cfg: TuneConfig) -> str:
    """The message for an out-of-memory step: what the estimator says would fit instead."""
    config = config_dict(cfg)
    budget = memory.allocatable_bytes()
    head = f"out of GPU memory at micro-batch {cfg.batch_size} x {cfg.max_length} tokens ({cfg.method}). "
    if not config["vocab_size"]:
        return head + "Lower --batch-size, or run `tunekit fit` to find the largest micro-batch that fits."
    best = estimate.estimate_max_batch(config, budget)
    if best == 0:
        return head + estimate.cannot_fit_message(config, budget)
    accum = estimate.grad_accum_for(cfg.batch_size * cfg.grad_accum, best)
    return head + (f"The estimator suggests --batch-size {best} --grad-accum {accum} (same samples per step); "
                   "`tunekit fit` finds the largest micro-batch by trying it.")


def find_micro_batch(cfg: TuneConfig, target_batch: int = 0, memory_gb: float = 0.0, name: str = "",
                     limit: int = 256, verbose: bool = True) -> dict:
    """The largest micro-batch of full-length (`max_length`) sequences that runs a training step, found by
    trying it: double, then bisect, catching out-of-memory. Full-length rows are the worst case, so a
    real run's shorter batches fit too. With `target_batch`, also the gradient accumulation that reaches it.

    `memory_gb` caps the GPU memory for the search (`memory.memory_cap`), to answer "would this fit a smaller
    GPU?". Returns a result dict (the bench keys, `micro_batch`, `grad_accum`, the trials, the estimator's
    answer)."""
    from tunekit import train as tr

    cfg.validate()
    device, dtype = tr.resolve_runtime(cfg)
    if device != "cuda":
        raise RuntimeError("tunekit fit tries steps until the GPU runs out of memory: it needs a CUDA GPU. "
                           "On CPU, `tunekit estimate` answers from the estimator alone.")
    with memory.memory_cap(memory_gb):
        return _search_micro_batch(cfg, dtype, target_batch, memory_gb, name, limit, verbose)


def _search_micro_batch(cfg: TuneConfig, dtype: torch.dtype, target_batch: int, memory_gb: float, name: str,
                        limit: int, verbose: bool) -> dict:
    import gc

    from tunekit import train as tr

    device = "cuda"
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

    best = estimate.largest_fitting(fits, limit)
    budget = memory.allocatable_bytes(device)
    config = {**config_dict(cfg), "vocab_size": vocab}
    if best == 0:
        raise RuntimeError(estimate.cannot_fit_message(config, budget))
    accum = estimate.grad_accum_for(target_batch, best) if target_batch else cfg.grad_accum
    peak = max(t["peak_gb"] for t in trials if t["fits"] and t["batch"] == best)
    result = new_result(
        name or f"fit_{cfg.preset}", cfg, None, peak,
        call=f"bench.find_micro_batch(TuneConfig(**config), target_batch={target_batch}, memory_gb={memory_gb:g}, "
             f"limit={limit})",
        micro_batch=best, grad_accum=accum, global_batch=best * accum, target_batch=target_batch,
        memory_cap_gb=memory_gb or None, allocatable_gb=round(budget / 1e9, 2),
        estimate_micro_batch=estimate.estimate_max_batch(config, budget, limit), trials=trials,
    )
    if verbose:
        print(f"fit: largest micro-batch {best} x {cfg.max_length} (estimator: {result['estimate_micro_batch']}); "
              f"--batch-size {best} --grad-accum {accum} gives {best * accum} samples a step")
    return result


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
                    print(f"{name}: reusing the result of {old['date']} (same code: {str(old['commit'])[:10]})")
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
            proc = subprocess.run(cmd, capture_output=True, text=True)
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
