"""The largest micro-batch that fits the GPU, found by trying steps: double, then bisect, until one runs out of
memory (`tunekit fit`).
"""

from __future__ import annotations

import time

import torch

from tunekit import estimate, fitting, memory
from tunekit.build import build_training, resolve_runtime, with_config_threads
from tunekit.config import TuneConfig
from tunekit.prepare import build_tokenizer
from tunekit.results import new_result
from tunekit.step import train_step


def oom_advice(cfg: TuneConfig) -> str:
    """The message for an out-of-memory step: what the estimator says would fit instead."""
    budget = memory.allocatable_bytes()
    head = f"out of GPU memory at micro-batch {cfg.batch_size} x {cfg.max_length} tokens ({cfg.method}). "
    if not cfg.vocab_size:
        return head + "Lower --batch-size, or run `tunekit fit` to find the largest micro-batch that fits."
    setup = estimate.Setup.of(cfg)
    best = fitting.estimate_max_batch(setup, budget)
    if best == 0:
        return head + fitting.cannot_fit_message(setup, budget)
    accum = fitting.grad_accum_for(cfg.batch_size * cfg.grad_accum, best)
    return head + (f"The estimator suggests --batch-size {best} --grad-accum {accum} (same samples per step); "
                   "`tunekit fit` finds the largest micro-batch by trying it.")


@with_config_threads
def find_micro_batch(cfg: TuneConfig, target_batch: int = 0, memory_gb: float = 0.0, name: str = "",
                     limit: int = 256, verbose: bool = True) -> dict:
    """The largest micro-batch of full-length (`max_length`) sequences that runs a training step, found by
    trying it: double, then bisect, catching out-of-memory. Full-length rows are the worst case, so a
    real run's shorter batches fit too. With `target_batch`, also the gradient accumulation that reaches it.

    `memory_gb` caps the GPU memory for the search (`memory.memory_cap`), to answer "would this fit a smaller
    GPU?". Returns a result dict (the bench keys, `micro_batch`, `grad_accum`, the trials, the estimator's
    answer)."""
    cfg.validate()
    device, dtype = resolve_runtime(cfg)
    if device != "cuda":
        raise RuntimeError("tunekit fit tries steps until the GPU runs out of memory: it needs a CUDA GPU. "
                           "On CPU, `tunekit estimate` answers from the estimator alone.")
    with memory.memory_cap(memory_gb):
        return _search_micro_batch(cfg, dtype, target_batch, memory_gb, name, limit, verbose)


def _search_micro_batch(cfg: TuneConfig, dtype: torch.dtype, target_batch: int, memory_gb: float, name: str,
                        limit: int, verbose: bool) -> dict:
    import gc

    device = "cuda"
    vocab = cfg.vocab_size or len(build_tokenizer(cfg))
    torch.manual_seed(cfg.seed)
    model, optimizer, scheduler, options = build_training(cfg, vocab, device, dtype, 10**9, verbose)
    trials: list[dict] = []

    def fits(b: int) -> bool:
        # The first trial runs twice: its first step creates the optimizer states, which every later step holds.
        ids = torch.randint(0, vocab, (b, cfg.max_length), device=device)
        batch = {"input_ids": ids, "labels": ids}
        memory.reset_peak_memory(device)
        t0 = time.perf_counter()
        try:
            for _ in range(1 if trials else 2):
                train_step(model, [batch], optimizer, scheduler, cfg.max_grad_norm, **options)
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

    best = fitting.largest_fitting(fits, limit)
    budget = memory.allocatable_bytes(device)
    setup = estimate.Setup.of(cfg, vocab_size=vocab)
    if best == 0:
        raise RuntimeError(fitting.cannot_fit_message(setup, budget))
    accum = fitting.grad_accum_for(target_batch, best) if target_batch else cfg.grad_accum
    peak = max(t["peak_gb"] for t in trials if t["fits"] and t["batch"] == best)
    result = new_result(
        name or f"fit_{cfg.preset}", cfg, None, peak,
        call=f"bench.find_micro_batch(TuneConfig(**config), target_batch={target_batch}, memory_gb={memory_gb:g}, "
             f"limit={limit})",
        micro_batch=best, grad_accum=accum, global_batch=best * accum, target_batch=target_batch,
        memory_cap_gb=memory_gb or None, allocatable_gb=round(budget / 1e9, 2),
        estimate_micro_batch=fitting.estimate_max_batch(setup, budget, limit), trials=trials,
    )
    if verbose:
        print(f"fit: largest micro-batch {best} x {cfg.max_length} (estimator: {result['estimate_micro_batch']}); "
              f"--batch-size {best} --grad-accum {accum} gives {best * accum} samples a step")
    return result
