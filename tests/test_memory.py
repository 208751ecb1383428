"""Gradient checkpointing: it really recomputes, gives the same gradients, and fails loudly when inactive."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL_ARCH

from tunekit import data, memory, train
from tunekit import model as mdl


def build(vocab: int, method: str, ckpt: bool):
    model = mdl.build_model(mdl.llama_config(vocab_size=vocab, **SMALL_ARCH), seed=0)
    if method == "lora":
        torch.manual_seed(1)
        model = mdl.apply_lora(model, r=4, alpha=8)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
    if ckpt:
        memory.apply_gradient_checkpointing(model)
    return model


def first_attention(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers[0].self_attn


@pytest.fixture(scope="module")
def batch(tokenizer, small_data):
    ds, _ = data.tokenize_dataset(data.load_records(str(small_data)), tokenizer, 128)
    return data.Collator(tokenizer.pad_token_id)([ds[i] for i in range(4)])


@pytest.mark.parametrize("method", ["full", "lora"])
def test_checkpointing_recomputes_and_keeps_gradients(method, tokenizer, batch):
    results = {}
    for ckpt in (False, True):
        model = build(len(tokenizer), method, ckpt)
        assert memory.checkpointing_active(model) is ckpt
        calls = []
        # A pre-hook on a module *inside* the block (transformers checkpoints the block's forward, keeping
        # the block's own hooks outside); recomputation may stop early, before a module's forward returns.
        first_attention(model).register_forward_pre_hook(lambda *a, calls=calls: calls.append(1))
        loss = train.micro_step(model, batch, train.count_targets([batch]), None)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results[ckpt] = (loss, grads, len(calls))
    (loss0, g0, calls0), (loss1, g1, calls1) = results[False], results[True]
    assert (calls0, calls1) == (1, 2), "checkpointing must run each block's forward again in backward"
    torch.testing.assert_close(loss1, loss0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-7, msg=name)


def test_eval_mode_silently_disables_checkpointing_and_check_catches_it(tokenizer):
    model = build(len(tokenizer), "lora", ckpt=True)
    memory.check_checkpointing(model, True)
    model.eval()
    assert not memory.checkpointing_active(model)
    with pytest.raises(RuntimeError, match="eval mode"):
        memory.check_checkpointing(model, True)
    memory.check_checkpointing(model, False)  # not asked for: nothing to check
    memory.apply_gradient_checkpointing(model)  # puts it back in train mode
    assert memory.checkpointing_active(model)


def test_build_training_model_turns_checkpointing_on(make_cfg, tokenizer):
    for ckpt in (False, True):
        cfg = make_cfg(grad_ckpt=ckpt)
        model = train.build_training_model(cfg, len(tokenizer), "cpu", torch.float32, verbose=False)
        assert memory.checkpointing_active(model) is ckpt and model.training


def test_peak_memory_on_cpu():
    memory.reset_peak_memory("cpu")
    allocated, reserved = memory.peak_memory_gb("cpu")
    assert 0 <= allocated <= reserved
