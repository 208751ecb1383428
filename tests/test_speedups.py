"""Lesson 4's switches: each reversible, each the same numbers as its reference."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL_ARCH

from tunekit import config, estimate, speedups, train


def test_tf32_is_switched_and_put_back():
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    with speedups.tf32(True):
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
        with speedups.tf32(False):
            assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "high"
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before
    with pytest.raises(RuntimeError), speedups.tf32(True):
        raise RuntimeError("inside")
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before


def test_lion_follows_the_paper_step_by_step():
    """Algorithm 2 of Chen et al. 2023, written out in float64, against `speedups.Lion` over five steps."""
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(7, 5, generator=g, dtype=torch.float64)
    grads = [torch.randn(7, 5, generator=g, dtype=torch.float64) for _ in range(5)]
    lr, (b1, b2), wd = 1e-2, (0.9, 0.99), 0.1
    p = torch.nn.Parameter(w0.clone())
    opt = speedups.Lion([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    w, m = w0.clone(), torch.zeros_like(w0)
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
        update = torch.sign(b1 * m + (1 - b1) * grad)
        w = w - lr * (update + wd * w)
        m = b2 * m + (1 - b2) * grad
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-12)
    assert list(opt.state[p]) == ["exp_avg"]  # one state a parameter


def test_lion_settings_and_memory():
    assert speedups.lion_settings(3e-4, 0.01) == pytest.approx({"lr": 3e-5, "weight_decay": 0.1})
    cfg = config.config_dict(config.llama7b_lora(vocab_size=32000))
    adamw = estimate.estimate_memory_for(**cfg)["optimizer"]
    assert estimate.estimate_memory_for(**{**cfg, "optimizer": "lion"})["optimizer"] == adamw // 2
    with pytest.raises(ValueError, match="lr"):
        speedups.Lion([torch.nn.Parameter(torch.zeros(1))], lr=0)


def test_a_run_trains_with_lion(tmp_path, small_data):
    cfg = config.tiny(out_dir=str(tmp_path / "run"), data=str(small_data), max_steps=30, batch_size=4,
                      max_length=128, warmup_steps=2, optimizer="lion", lr=3e-4, **SMALL_ARCH)
    summary = train.train(cfg, progress=False)
    losses = summary["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1, losses
