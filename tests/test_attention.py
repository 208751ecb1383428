"""Attention kernels: the fallback choice, and SDPA gives the same numbers as the eager reference."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL_ARCH

from tunekit import attention, data
from tunekit import model as mdl


def test_auto_on_cpu_is_sdpa():
    impl, why = attention.choose_attention("auto", "cpu")
    assert impl == "sdpa" and "CPU" in why


@pytest.mark.parametrize("name", ["sdpa", "eager"])
def test_explicit_choice_is_kept(name):
    assert attention.choose_attention(name, "cpu")[0] == name


def test_flash_attention_on_cpu_is_refused():
    with pytest.raises(RuntimeError, match="--attention sdpa"):
        attention.choose_attention("flash_attention_2", "cpu")


def test_auto_on_cuda_depends_on_flash_attn(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    assert attention.choose_attention("auto", "cuda")[0] == "flash_attention_2"
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    impl, why = attention.choose_attention("auto", "cuda")
    assert impl == "sdpa" and "not installed" in why


def test_sdpa_matches_eager(tokenizer, small_data):
    ds, _ = data.tokenize_dataset(data.load_records(str(small_data)), tokenizer, 128)
    batch = data.Collator(tokenizer.pad_token_id)([ds[i] for i in range(6)])
    ids, real = batch["input_ids"], batch["attention_mask"].bool()
    out = {}
    for impl in ("eager", "sdpa"):
        model = mdl.build_model(mdl.llama_config(vocab_size=len(tokenizer), **SMALL_ARCH), attention=impl, seed=0)
        logits = model(input_ids=ids).logits
        logits[real].float().logsumexp(-1).sum().backward()
        out[impl] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(out["sdpa"][0][real], out["eager"][0][real], rtol=1e-5, atol=1e-5)
    for name, g in out["eager"][1].items():
        torch.testing.assert_close(out["sdpa"][1][name], g, rtol=1e-4, atol=1e-6, msg=name)
