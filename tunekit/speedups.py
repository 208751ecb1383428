"""Lesson 4's switches, each reversible and each with its correctness test (tests/test_speedups.py).

- **TF32** (`tf32`): fp32 matrix multiplies on Ampere and later GPUs run on tensor cores with a 10-bit
  mantissa (`torch.set_float32_matmul_precision("high")`), and so may cuDNN's convolutions
  (`torch.backends.cudnn.allow_tf32`). It touches fp32 work only: under bf16 autocast the matmuls already
  run in bf16, so what is left to change is what stays fp32 (the fp32 LoRA adapters' own small matmuls,
  an fp32 run). The speed-up is measured in notebook 04, not assumed.
- **Lion** (`Lion`): the optimizer of Chen et al. 2023 (https://arxiv.org/abs/2302.06675, Algorithm 2). Its
  update is the sign of an interpolation between the momentum and the gradient, so each parameter moves by
  exactly the learning rate; it keeps one state a parameter (AdamW keeps two). The paper's rule for its
  settings: a learning rate 3-10x smaller than AdamW's and a weight decay 3-10x larger (`lion_settings`).
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def tf32(enabled: bool = True):
    """Inside, fp32 matmuls and cuDNN convolutions may use TF32 (`enabled`) or must not; the previous
    settings come back on exit, whatever happens inside."""
    old = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old[0])
        torch.backends.cudnn.allow_tf32 = old[1]


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
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])  # decoupled weight decay, as AdamW's
                p.add_(m.mul(b1).add_(p.grad, alpha=1 - b1).sign_(), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss


def lion_settings(adamw_lr: float, adamw_weight_decay: float, factor: float = 10.0) -> dict:
    """Lion's learning rate and weight decay from AdamW's, by the paper's rule: the rate `factor` times
    smaller and the decay `factor` times larger (their product, the decay per step, stays the same)."""
    return {"lr": adamw_lr / factor, "weight_decay": adamw_weight_decay * factor}
