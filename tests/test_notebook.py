"""The notebooks' helpers (tunekit/notebook.py): which preset and config a cell gets on CPU (smoke mode) and on
a GPU, and where its results go. No GPU needed: smoke mode is forced with TUNEKIT_SMOKE=1."""

from __future__ import annotations

import pytest
import torch

from tunekit import notebook
from tunekit.config import REPO_ROOT, get_preset, tiny


@pytest.fixture
def smoke(monkeypatch):
    """Smoke mode, even where a GPU is visible: TUNEKIT_SMOKE=1 must win over the hardware."""
    monkeypatch.setenv("TUNEKIT_SMOKE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not notebook.on_gpu()


def test_smoke_swaps_gpu_only_switches_for_stand_ins(smoke):
    cfg = notebook.config_for("llama7b_qlora_lowmem")  # qlora, 8-bit AdamW, checkpoints + embeddings offloaded
    assert cfg.preset == "tiny"
    assert (cfg.method, cfg.optimizer) == ("lora", "adamw")
    assert cfg.grad_ckpt and cfg.grad_ckpt_offload and cfg.embed_offload  # the switches that run on CPU stay
    assert (cfg.batch_size, cfg.max_length, cfg.vocab_size) == (1, 128, 1024)
    assert cfg.out_dir == str(REPO_ROOT / "runs" / "smoke")
    flex = notebook.config_for("llama7b_lora", attention="flex_attention")
    assert flex.attention == "sdpa" and flex.method == "lora" and not flex.grad_ckpt


def test_smoke_caps_the_batch_at_8(smoke):
    assert get_preset("llama7b_qlora").batch_size == 8 and get_preset("tiny").batch_size > 8
    assert notebook.config_for("llama7b_qlora").batch_size == 8
    assert notebook.config_for("llama7b_lora", batch_size=32).batch_size == 8
    assert notebook.config_for("llama7b_lora", batch_size=2).batch_size == 2


def test_smoke_carries_overrides_of_the_switches(smoke):
    cfg = notebook.config_for("llama7b_lora", grad_ckpt=True, loss="plain", packing="pack", sdpa_backend="math,flash",
                              lora_input_cast=True, method="full", bench_warmup=1, bench_steps=2)
    assert (cfg.grad_ckpt, cfg.loss, cfg.packing, cfg.sdpa_backend) == (True, "plain", "pack", "math,flash")
    assert cfg.lora_input_cast and cfg.method == "full"
    assert (cfg.bench_warmup, cfg.bench_steps) == (1, 2)
    # every other field is the tiny preset's, whatever the GPU preset says
    gpu, base = get_preset("llama7b_lora"), tiny()
    assert gpu.hidden_size != base.hidden_size and cfg.hidden_size == base.hidden_size
    assert cfg.data == base.data and cfg.lr == base.lr


def test_on_a_gpu_the_gpu_preset_is_used_as_is(monkeypatch):
    monkeypatch.setattr(notebook, "on_gpu", lambda: True)
    cfg = notebook.config_for("llama7b_qlora", batch_size=16, attention="flex_attention")
    assert cfg == get_preset("llama7b_qlora", batch_size=16, attention="flex_attention")
    assert (cfg.method, cfg.batch_size, cfg.attention) == ("qlora", 16, "flex_attention")
    assert notebook.results_dir() == notebook.RESULTS


def test_pick_preset_and_results_dir_in_smoke_mode(smoke, capsys):
    assert notebook.pick_preset("llama7b_qlora") == "tiny"
    out = capsys.readouterr().out
    assert "mode: smoke (TUNEKIT_SMOKE=1) -> preset tiny" in out and "mode: GPU" not in out
    assert notebook.results_dir() == REPO_ROOT / "runs" / "smoke-results" != notebook.RESULTS


def test_pick_preset_without_a_gpu(monkeypatch, capsys):
    monkeypatch.delenv("TUNEKIT_SMOKE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert notebook.pick_preset("llama7b_lora") == "tiny"
    assert "mode: smoke (no CUDA GPU)" in capsys.readouterr().out
