"""The chunked LM-head loss gives the plain path's loss and gradients, in fp32 and under bf16 autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import SMALL_ARCH, small_model

from tunekit import loss, memory
from tunekit import model as mdl
from tunekit.data.batching import Collator
from tunekit.data.records import load_records
from tunekit.data.tokens import tokenize_dataset
from tunekit.step import count_targets, micro_step


def plain(hidden, weight, labels, scale, softcap=0.0):
    logits = hidden @ weight.t()
    if softcap:  # as Gemma 2's head: divide, tanh, multiply
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), labels, ignore_index=loss.IGNORE, reduction="sum") * scale


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])  # one token, uneven chunks, one chunk, bigger than N
@pytest.mark.parametrize("head_trains", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 3.0])  # none, and a cap the logits (std ~4) often reach
def test_chunked_loss_matches_cross_entropy(chunk, head_trains, softcap):
    g = torch.Generator().manual_seed(0)
    n, h, v = 50, 16, 37
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g).requires_grad_(head_trains)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = loss.IGNORE  # padding and prompt tokens
    results = []
    for fn in (plain, lambda *a, softcap: loss.chunked_lm_loss(*a, chunk=chunk, softcap=softcap)):
        hidden.grad = weight.grad = None
        value = fn(hidden, weight, labels, 1 / 40, softcap=softcap)
        (value * 3).backward()  # an upstream gradient that is not 1
        results.append((value.detach(), hidden.grad.clone(), None if weight.grad is None else weight.grad.clone()))
    (l0, gh0, gw0), (l1, gh1, gw1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh1, gh0, rtol=1e-5, atol=1e-7)
    if head_trains:
        torch.testing.assert_close(gw1, gw0, rtol=1e-5, atol=1e-7)
    else:
        assert gw1 is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_chunks_give_the_eager_chunks_loss_and_gradients(dtype):
    # the elementwise work compiled (`compiled=True`, what a regionally compiled step uses) against the eager,
    # in-place code: uneven chunks, ignored labels, soft-capping and a tensor scale, the head trained
    g = torch.Generator().manual_seed(0)
    n, h, v = 50, 16, 37
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = loss.IGNORE
    for softcap, scale in ((0.0, 1 / 40), (3.0, torch.tensor(1 / 40))):
        results = []
        for compiled in (False, True):
            hidden.grad = weight.grad = None
            value = loss.chunked_lm_loss(hidden, weight, labels, scale, chunk=7, softcap=softcap, compiled=compiled)
            (value * 3).backward()
            results.append((value.detach(), hidden.grad.clone(), weight.grad.clone()))
        tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-3}
        for eager, fused in zip(*results):
            torch.testing.assert_close(fused, eager, **tol)


def test_regional_compile_marks_the_loss_compiled():
    from tunekit import speedups

    model = small_model(64)
    assert not loss.compiled_for(model)
    speedups.compile_step(model, model, "regional")
    assert loss.compiled_for(model)


def test_all_ignored_gives_zero_loss_and_gradient():
    hidden = torch.randn(6, 8, requires_grad=True)
    value = loss.chunked_lm_loss(hidden, torch.randn(11, 8), torch.full((6,), loss.IGNORE), chunk=4)
    value.backward()
    assert value.item() == 0 and hidden.grad.abs().max().item() == 0


def test_chunk_size_and_shape_check():
    assert loss.chunk_tokens(32000) == 1024 and loss.chunk_tokens(128256) == 256 and loss.chunk_tokens(10**9) == 1
    with pytest.raises(ValueError, match="3 hidden states but 4 labels"):
        loss.chunked_lm_loss(torch.randn(3, 8), torch.randn(5, 8), torch.zeros(4, dtype=torch.long))


@pytest.fixture(scope="module")
def batch(tokenizer, small_data):
    ds, _ = tokenize_dataset(load_records(str(small_data)), tokenizer, 128)
    return Collator(tokenizer.pad_token_id)([ds[i] for i in range(4)])


def step_grads(vocab, batch, method, loss_name, autocast=None):
    model = small_model(vocab, method, cast_input=False)
    batch = {k: v for k, v in batch.items() if k != "attention_mask"}
    value = micro_step(model, batch, count_targets([batch]), autocast, loss_name)
    return value, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("method", ["full", "lora"])
def test_micro_step_chunked_equals_plain_fp32(method, tokenizer, batch):
    """Full fine-tuning trains the LM head too, so its gradient goes through the chunked path as well."""
    l0, g0 = step_grads(len(tokenizer), batch, method, "plain")
    l1, g1 = step_grads(len(tokenizer), batch, method, "chunked")
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
    assert g0.keys() == g1.keys() and (method == "lora" or "lm_head.weight" in g1)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_micro_step_chunked_equals_plain_under_bf16_autocast(tokenizer, batch):
    """Same bf16 matmul, same fp32 softmax: the loss agrees to fp32 rounding; gradients to bf16 rounding
    (the head's gradient is summed over chunks in fp32 rather than in one bf16 matmul)."""
    l0, g0 = step_grads(len(tokenizer), batch, "full", "plain", torch.bfloat16)
    l1, g1 = step_grads(len(tokenizer), batch, "full", "chunked", torch.bfloat16)
    torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-4)
    for name in g0:
        assert g1[name].dtype == g0[name].dtype
        torch.testing.assert_close(g1[name], g0[name], rtol=2e-2, atol=2e-4, msg=name)


def test_offloaded_checkpointing_keeps_gradients(tokenizer, batch):
    """Offloading moves what checkpointing saves; the numbers stay those of no checkpointing."""
    l0, g0 = step_grads(len(tokenizer), batch, "lora", "chunked")
    model_grads = []
    for offload in (False, True):
        model = small_model(len(tokenizer), "lora", ckpt=True, offload=offload, cast_input=False)
        assert memory.checkpointing_active(model)
        b = {k: v for k, v in batch.items() if k != "attention_mask"}
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, seen=packed: (seen.append(t.shape), t)[1], lambda t: t):
            value = micro_step(model, b, count_targets([b]), None, "chunked")
        model_grads.append((value, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, packed))
    (_, _, packed_on_gpu), (l1, g1, packed_offloaded) = model_grads
    # Without offload the block inputs go through the outer hooks; with it, HostOffload takes them first.
    hidden_shape = torch.Size([*batch["input_ids"].shape, SMALL_ARCH["hidden_size"]])
    assert packed_on_gpu.count(hidden_shape) > packed_offloaded.count(hidden_shape)
    torch.testing.assert_close(l1, l0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-7, msg=name)


def test_fused_loss_blocker(tokenizer):
    model = mdl.build_model(mdl.llama_config(vocab_size=len(tokenizer), **SMALL_ARCH), seed=0)
    assert loss.fused_loss_blocker(model) == ""
    assert loss.fused_loss_blocker(mdl.apply_lora(model, r=2)) == ""
    model.lm_head = torch.nn.Linear(SMALL_ARCH["hidden_size"], len(tokenizer), bias=True)
    assert "bias" in loss.fused_loss_blocker(model)
    assert "no separate decoder" in loss.fused_loss_blocker(torch.nn.Linear(2, 2))
    model = mdl.build_model(mdl.llama_config(vocab_size=len(tokenizer), **SMALL_ARCH), seed=0)
    model.config.logit_scale = 0.5  # Cohere-like: a scaling the chunked loss does not apply
    assert "rescales its logits (logit_scale)" in loss.fused_loss_blocker(model)
    model.config.logit_scale, model.config.final_logit_softcapping = None, 30.0  # Gemma 2's cap: it applies it
    assert loss.fused_loss_blocker(model) == "" and loss.softcap_of(model) == 30.0
