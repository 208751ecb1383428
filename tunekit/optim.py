"""Optimizers and the learning-rate schedule: AdamW (fused, foreach), bitsandbytes' 8-bit and paged AdamW,
Lion (tunekit's, lion-pytorch's, 8-bit), and a linear warm-up into a cosine decay.
"""

from __future__ import annotations

import importlib
import math

import torch


class Lion(torch.optim.Optimizer):
    """Lion: `w -= lr * (sign(b1 * m + (1 - b1) * g) + weight_decay * w)`, then `m = b2 * m + (1 - b2) * g`.
    One state tensor a parameter, in the parameter's dtype."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr <= 0 or not all(0 <= b < 1 for b in betas) or weight_decay < 0:
            raise ValueError(f"Lion: lr {lr} must be positive, betas {betas} in [0, 1), weight_decay {weight_decay} >= 0")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            for p in params:
                if not self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
            moms = [self.state[p]["exp_avg"] for p in params]
            # The same arithmetic as one tensor at a time, in a few multi-tensor kernels (one launch per op
            # for all parameters: LoRA has hundreds of small ones).
            torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])  # decoupled decay, as AdamW's
            update = torch._foreach_mul(moms, b1)
            torch._foreach_add_(update, grads, alpha=1 - b1)
            torch._foreach_sign_(update)
            torch._foreach_add_(params, update, alpha=-group["lr"])
            torch._foreach_mul_(moms, b2)
            torch._foreach_add_(moms, grads, alpha=1 - b2)
        return loss


def lion_settings(adamw_lr: float, adamw_weight_decay: float, factor: float = 10.0) -> dict:
    """Lion's learning rate and weight decay from AdamW's, by the paper's rule: the rate `factor` times
    smaller and the decay `factor` times larger (their product, the decay per step, stays the same)."""
    return {"lr": adamw_lr / factor, "weight_decay": adamw_weight_decay * factor}


# name: (what it is, optimizer state in bytes per trainable parameter as a function of the parameter's bytes)
OPTIMIZER_NOTES = {
    "adamw": ("torch AdamW, fused into one kernel on CUDA (foreach on CPU)", lambda b: 2 * b),
    "adamw_foreach": ("torch AdamW, multi-tensor (foreach) kernels", lambda b: 2 * b),
    "adamw8bit": ("bitsandbytes AdamW8bit: both states block-wise quantized to 8 bits", lambda b: 2),
    "paged_adamw": ("bitsandbytes PagedAdamW: 32-bit states in CUDA unified memory, paged out under pressure",
                    lambda b: 8),
    "paged_adamw8bit": ("bitsandbytes PagedAdamW8bit: 8-bit states, paged", lambda b: 2),
    "lion": ("tunekit's Lion (speedups.Lion, foreach kernels): one state in the parameter's dtype", lambda b: b),
    "lion_pytorch": ("lion-pytorch's Lion (its Triton update on CUDA): one state", lambda b: b),
    "lion8bit": ("bitsandbytes Lion8bit: one state, 8 bits", lambda b: 1),
}


BNB_OPTIMIZERS = {"adamw8bit": "AdamW8bit", "paged_adamw": "PagedAdamW", "paged_adamw8bit": "PagedAdamW8bit",
                  "lion8bit": "Lion8bit"}


def state_bytes_per_param(name: str, param_bytes: int) -> int:
    """Optimizer state bytes per trainable parameter (the estimator's formula; 8-bit block scales, ~0.1%,
    left out)."""
    return OPTIMIZER_NOTES[name][1](param_bytes)


def build_optimizer(model, lr: float, weight_decay: float, device: str, name: str = "adamw",
                    betas: tuple[float, float] | None = None) -> torch.optim.Optimizer:
    """The optimizer `name` (one of `OPTIMIZER_NOTES`) over the trainable parameters. AdamW's betas default to
    (0.9, 0.95), Lion's to the paper's (0.9, 0.99). Each missing package or device is a clear error."""
    params = [p for p in model.parameters() if p.requires_grad]
    if name not in OPTIMIZER_NOTES:
        raise ValueError(f"optimizer {name!r}: choose one of {', '.join(OPTIMIZER_NOTES)}")
    lion = "lion" in name
    betas = betas or ((0.9, 0.99) if lion else (0.9, 0.95))
    if name in BNB_OPTIMIZERS:
        if device != "cuda":
            raise RuntimeError(f"optimizer={name} needs a CUDA GPU (bitsandbytes' optimizers); use --optimizer "
                               f"{'lion' if lion else 'adamw'} on CPU.")
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise RuntimeError(f"optimizer={name} needs bitsandbytes: pip install bitsandbytes") from None
        return getattr(bnb.optim, BNB_OPTIMIZERS[name])(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if name == "lion":
        return Lion(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if name == "lion_pytorch":
        try:
            from lion_pytorch import Lion as LionPytorch
        except ImportError:
            raise RuntimeError("optimizer=lion_pytorch needs lion-pytorch: pip install lion-pytorch "
                               "(or use --optimizer lion, tunekit's own)") from None
        # decoupled_weight_decay=False: its decay is lr x wd per step, as tunekit's and the paper's
        return LionPytorch(params, lr=lr, betas=betas, weight_decay=weight_decay,
                           use_triton=device == "cuda" and importlib.util.find_spec("triton") is not None)
    fused = name == "adamw" and device == "cuda"  # one kernel for every tensor; on CPU foreach is as good
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused,
                             foreach=None if fused else True)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's state tensors hold, as allocated (the step counters included)."""
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total


def build_scheduler(optimizer, warmup_steps: int, max_steps: int, min_lr_ratio: float):
    """Linear warm-up to the peak, then a cosine down to `min_lr_ratio` of it."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
