"""Timing a step: warm-up, then steps until the median is known to a target error; the spread; FLOPs a token
and the model FLOPs utilisation (MFU) against the GPU's peak.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from tunekit.activations import head_widths, linear_shapes

# Dense bf16 tensor-core peaks from vendor datasheets (FLOP/s), matched by substring of the device name.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12,
             "RTX 4090": 165e12, "RTX 3090": 71e12, "A6000": 155e12}


def peak_flops(name: str) -> float | None:
    for key, value in PEAK_BF16.items():
        if key in name:
            return value
    return None


def flops_per_token(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                    seq: int, method: str, lora_params: int = 0, head_dim: int = 0) -> float:
    """Training FLOPs per token for a Llama-shaped model.

    Forward: 2 FLOPs per weight per token for every matmul (attention projections, MLP, LM head) plus
    causal attention scores and values, 2 * seq * hidden per layer (half of the full 4 * seq * hidden).
    Backward: full fine-tuning computes input *and* weight gradients (2x forward); with frozen base weights
    (LoRA, QLoRA) only input gradients (1x forward) — so a LoRA step needs 2/3 the FLOPs of a full one.
    Attention has no weights: its backward is 2x forward either way. `head_dim` 0: hidden / heads (Gemma's
    heads are wider)."""
    shapes = linear_shapes(hidden, heads, kv_heads, intermediate, head_dim)
    matmul = layers * sum(i * o for i, o in shapes.values()) + hidden * vocab
    attn = layers * 2 * seq * head_widths(hidden, heads, kv_heads, head_dim)[0]
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
