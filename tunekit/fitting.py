"""What fits a GPU's memory, from the estimate (tunekit/estimate.py) and loading nothing: the largest micro-batch,
the accumulation that reaches a target batch, and what to change when not even one sample fits.
"""

from __future__ import annotations

import statistics

from tunekit.estimate import Setup, estimate_memory_for

# What the caching allocator reserves per byte allocated, at a step's peak: the 90th percentile of
# peak_reserved_gb / peak_memory_gb over the published step results (`reserve_factor_of` on
# notebooks/results/*.json, H200: 1.209 on 2026-11-30; 1.180 on 2026-12-01 with the speed push's step results,
# rounded to 1.18; the median 1.09, then 1.07). Nine in ten of
# those steps reserved no more than this; a cap binds on reserved memory, so a batch is said to fit when
# RESERVE_FACTOR x its estimate does. tests/unit/test_memory.py re-derives it from the files.
RESERVE_FACTOR = 1.18


def reserve_factor_of(results: list[dict], quantile: float = 0.9) -> float:
    """The `quantile` of reserved / allocated peak memory over results that record both (`peak_reserved_gb`,
    `peak_memory_gb`): how `RESERVE_FACTOR` was derived."""
    ratios = [r["peak_reserved_gb"] / r["peak_memory_gb"] for r in results
              if r.get("peak_reserved_gb") and r.get("peak_memory_gb")]
    if len(ratios) < 2:
        raise ValueError("reserve_factor_of needs at least two results with peak_reserved_gb and peak_memory_gb")
    return statistics.quantiles(ratios, n=100, method="inclusive")[round(quantile * 100) - 1]


def largest_fitting(fits, limit: int = 4096) -> int:
    """The largest n in [1, limit] with `fits(n)` true, assuming that fitting is monotonic (if n fits, so
    does every smaller n): double from 1 until something does not fit, then bisect. 0 when 1 does not fit.
    About 2 log2(answer) calls."""
    if not fits(1):
        return 0
    good = 1
    while good * 2 <= limit and fits(good * 2):
        good *= 2
    bad = min(good * 2, limit + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def estimate_max_batch(setup: Setup, budget_bytes: float, limit: int = 4096,
                       reserve_factor: float = RESERVE_FACTOR) -> int:
    """The largest micro-batch whose estimated peak (`estimate_memory_for(setup)`) times `reserve_factor`
    fits `budget_bytes` of memory the allocator may reserve (a GPU's memory or a `memory.memory_cap`); 0 when
    even 1 does not. `reserve_factor=1` answers for allocated memory alone."""
    def fits(b: int) -> bool:
        return estimate_memory_for(setup.but(batch_size=b))["total"] * reserve_factor <= budget_bytes

    return largest_fitting(fits, limit)


def recompute_first(setup) -> bool:
    """Whether `--compile-recompute` is the first thing to try when `setup` (a `Setup` or a `TuneConfig`) does not
    fit: compiled, not checkpointing, not recomputing yet. It costs the 7B LoRA step 2% of its speed for ~10 GB on
    an H100 (`s31_lora_group_b4_recompute`), where checkpointing costs a quarter or more."""
    return setup.compile != "none" and not setup.grad_ckpt and not setup.compile_recompute


def grad_accum_for(target_batch: int, micro_batch: int, world_size: int = 1) -> int:
    """Micro-batches per step so that micro_batch * accum * world_size reaches at least `target_batch`."""
    return max(1, -(-target_batch // (micro_batch * world_size)))


def cannot_fit_message(setup: Setup, budget_bytes: float, reserve_factor: float = RESERVE_FACTOR) -> str:
    """Why a config does not fit `budget_bytes` even at micro-batch 1, and the changes that would, each
    with its estimated peak at batch 1 (changes are tried alone, then in the usual order of cost). As in
    `estimate_max_batch`, a peak fits when `reserve_factor` times it is within the budget."""
    def peak(**change) -> float:
        return estimate_memory_for(setup.but(batch_size=1, **change))["total"]

    base = peak()
    lines = [(f"even micro-batch 1 does not fit: the estimated peak is {base / 1e9:.1f} GB allocated, "
              f"~{base * reserve_factor / 1e9:.1f} GB reserved, at seq {setup.max_length}, against "
              f"{budget_bytes / 1e9:.1f} GB allocatable. Peaks below are allocated memory; one fits when "
              f"{reserve_factor:g}x it (reserved) does.")]
    budget_bytes = budget_bytes / reserve_factor  # from here on, compare allocated peaks
    options: list[tuple[str, dict]] = []
    if recompute_first(setup):
        options.append(("--compile-recompute (the matmuls' elementwise inputs recomputed)",
                        {"compile_recompute": True}))
    if not setup.grad_ckpt:
        options.append(("--grad-ckpt (recompute activations in backward)", {"grad_ckpt": True}))
    if setup.method in ("full", "lora"):
        options.append(("--method qlora (4-bit base weights)", {"method": "qlora"}))
    if setup.loss == "plain":
        options.append(("--loss chunked (no full logits)", {"loss": "chunked"}))
    if setup.grad_ckpt and not setup.grad_ckpt_offload:
        options.append(("--grad-ckpt-offload (checkpoints in CPU memory)", {"grad_ckpt_offload": True}))
    if setup.method != "full" and not setup.embed_offload:
        options.append(("--embed-offload (embeddings and LM head in CPU memory)", {"embed_offload": True}))
    if setup.optimizer == "adamw" and setup.method != "full":
        options.append(("--optimizer adamw8bit", {"optimizer": "adamw8bit"}))
    seq = setup.max_length
    while seq > 128 and peak(max_length=seq) > budget_bytes:
        seq //= 2
    if seq != setup.max_length and peak(max_length=seq) <= budget_bytes:
        options.append((f"--max-length {seq} (shorter sequences)", {"max_length": seq}))
    applied: dict = {}
    for label, change in options:
        alone = peak(**change)
        applied.update(change)
        together = peak(**applied)
        verdict = "fits" if alone <= budget_bytes else "does not fit"
        lines.append(f"  {label}: {alone / 1e9:.1f} GB alone, {verdict}; "
                     f"with the changes above too: {together / 1e9:.1f} GB")
    if len(lines) == 1:
        lines.append("  nothing tunekit can change fits it: use a GPU with more memory or shard across GPUs.")
    return "\n".join(lines)
