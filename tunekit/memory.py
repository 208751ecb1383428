"""Memory: gradient checkpointing, and measuring peak memory.

Gradient checkpointing keeps only each decoder block's input in forward and recomputes the block in
backward (https://arxiv.org/abs/1604.06174). It saves most activation memory and costs one extra forward,
about a third more compute. We use PyTorch's non-reentrant implementation, which works with frozen inputs
(LoRA) and with torch.compile.

A trap: transformers applies checkpointing only in train mode, and `from_pretrained` returns a model in
eval mode — so "checkpointing on" can silently do nothing. `apply_gradient_checkpointing` puts the model
in train mode, and `check_checkpointing` fails loudly if a model is about to train without it.
"""

from __future__ import annotations

import torch


def apply_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Turn on non-reentrant checkpointing of every decoder block, and switch the model to train mode."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # the transformers >= 5.2x name
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    base.config.use_cache = False  # a KV cache is useless in training and clashes with recomputation
    model.train()


def checkpointing_active(model: torch.nn.Module) -> bool:
    """True when checkpointing is on *and* will actually run (the blocks are in train mode)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    flag = getattr(base, "is_activation_checkpointing", None)  # transformers >= 5.x name
    if flag is None:
        flag = getattr(base, "is_gradient_checkpointing", False)
    return bool(flag) and base.training


def check_checkpointing(model: torch.nn.Module, wanted: bool) -> None:
    if wanted and not checkpointing_active(model):
        raise RuntimeError("gradient checkpointing was asked for but is not active: the model is in eval mode "
                           "(from_pretrained returns eval mode) or checkpointing was never enabled. "
                           "Call model.train() after apply_gradient_checkpointing(model).")


def reset_peak_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gb(device: str) -> tuple[float, float]:
    """(peak allocated, peak reserved) in GB (1e9 bytes) since the last reset.

    On CPU both are the process's peak resident set size since it started (the OS keeps no resettable
    peak), which includes Python and the libraries: an upper bound, not the model's share."""
    if device != "cuda":
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB
        return rss, rss
    return torch.cuda.max_memory_allocated() / 1e9, torch.cuda.max_memory_reserved() / 1e9
