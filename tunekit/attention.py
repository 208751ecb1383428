"""Choosing the attention kernel: use the fastest one that is installed, and say which and why.

- `flash_attention_2`: the flash-attn package (https://github.com/Dao-AILab/flash-attention); fastest for
  padded and packed (varlen) batches where it builds. It compiles from source on most torch/CUDA pairs.
- `sdpa`: `torch.nn.functional.scaled_dot_product_attention`, which dispatches to its own flash,
  memory-efficient, cuDNN or math kernels. Always present; the default.
- `eager`: the plain softmax(QK^T)V in PyTorch — the reference every other backend is tested against.
Feature detection, not version checks: we try the import.
"""

from __future__ import annotations

import importlib.util


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def choose_attention(requested: str, device: str) -> tuple[str, str]:
    """Return (implementation name for transformers, one-line reason)."""
    if requested == "auto":
        if device == "cuda" and flash_attn_available():
            return "flash_attention_2", "auto: flash-attn is installed"
        why = "flash-attn not installed" if device == "cuda" else "CPU"
        return "sdpa", f"auto: PyTorch SDPA ({why})"
    if requested == "flash_attention_2":
        if not flash_attn_available():
            raise RuntimeError("attention=flash_attention_2 was asked for, but flash-attn does not import. "
                               "Install it (pip install flash-attn --no-build-isolation) or use --attention sdpa.")
        if device != "cuda":
            raise RuntimeError("attention=flash_attention_2 needs a CUDA GPU; use --attention sdpa on CPU.")
    return requested, f"{requested}: asked for"
