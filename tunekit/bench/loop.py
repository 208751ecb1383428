"""`tunekit train` itself, timed: on the config's real data for some steps (`--train-loop`) or a share of an
epoch from a fresh folder (`--epoch`), in a scratch folder.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from tunekit import distributed
from tunekit import train as tr
from tunekit.bench.timing import flops_per_token, median_error, peak_flops, spread
from tunekit.config import TuneConfig
from tunekit.data import prepared
from tunekit.prepare import prepare_key
from tunekit.results import gpu_name, new_result
from tunekit.stopping import read_metrics


def _scratch_dir(kind: str) -> Path:
    """A scratch run folder: one for all ranks of a torchrun launch (named by its rendezvous), else this
    process's own."""
    import os
    import tempfile

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

    tmp = _scratch_dir(kind)
    try:
        if fresh and distributed.is_main():  # from nothing: not even the prepared-data cache
            shutil.rmtree(tmp, ignore_errors=True)
            if run.tokenize != "in_loop":
                shutil.rmtree(prepared.cache_folder(prepare_key(run)), ignore_errors=True)
        t0 = time.perf_counter()
        summary = tr.train(dataclasses.replace(run, out_dir=str(tmp)), overwrite=True, **train_kwargs)
        wall = time.perf_counter() - t0
        rows = read_metrics(tmp)
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

    cfg.validate()
    steps = cfg.bench_max_steps
    if steps <= cfg.bench_warmup + 2:
        raise ValueError(f"bench_max_steps ({steps}) must exceed bench_warmup ({cfg.bench_warmup}) by at least 3")
    verbose = verbose and distributed.is_main()
    if verbose:
        print(f"training {steps} steps of `tunekit train --preset {cfg.preset}` on {cfg.data} in a scratch "
              "folder, removed afterwards ...", flush=True)
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


def run_epoch(cfg: TuneConfig, fraction: float = 1.0, name: str = "", verbose: bool = True) -> dict:
    """The wall-clock time of `tunekit train --epochs FRACTION` from nothing, in a fresh folder: tokenizing
    (offline tokenization is part of what a recipe pays; `tokenized_from_cache` says whether `datasets` had it
    already), building the model, compiling, every step, the held-out evaluation. `epoch_s_projected` is what
    a whole epoch would take: the one-time parts (the first step among them: it compiles) plus the other
    steps' time / `fraction` (measured whole when `fraction` is 1). `tokens_per_s` counts real tokens over
    those other steps, per GPU; `curve` is (seconds since start, loss) for a loss-against-time plot. Rank 0
    returns the result, the others None."""
    import dataclasses

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
                                cfg.method, summary["params_trainable"] if cfg.method != "full" else 0, cfg.head_dim)
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
