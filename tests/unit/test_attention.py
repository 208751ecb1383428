"""Attention kernels: the fallback choice, the SDPA kernel order, each CPU kernel against the eager
reference, and the op benchmark at tiny shapes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import SMALL_ARCH
from torch.nn.attention import SDPBackend

from tunekit import attention
from tunekit import model as mdl
from tunekit.bench.ops import (
    BENCH_BACKENDS,
    benchmark_attention,
    document_mask,
    eager_attention,
    format_attention_table,
)
from tunekit.config import REPO_ROOT
from tunekit.data.batching import Collator
from tunekit.data.records import load_records
from tunekit.data.tokens import tokenize_dataset


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


# ---- choose_attention with packed rows ------------------------------------------------------------


def test_packed_auto_takes_flex_on_cuda_without_flash_attn(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    plain = attention.choose_attention("auto", "cuda")
    packed = attention.choose_attention("auto", "cuda", packed=True)
    assert plain[0] == "sdpa" and packed[0] == "flex_attention"
    assert "packed rows" in packed[1] and "flex" not in plain[1]
    assert attention.choose_attention("auto", "cpu", packed=True) == attention.choose_attention("auto", "cpu")
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    assert attention.choose_attention("auto", "cuda", packed=True)[0] == "flash_attention_2"


# ---- SDPA backend order ---------------------------------------------------------------------------

B = SDPBackend


def test_sdpa_auto_on_cpu_is_pytorch_default():
    backends, why = attention.sdpa_backends("auto", "cpu")
    assert backends is None and "default order" in why and "CPU" in why


def test_sdpa_unknown_backend_names_the_field():
    with pytest.raises(ValueError, match=r"sdpa_backend='flash,fast'.*'fast'.*cudnn, flash, efficient, math"):
        attention.sdpa_backends("flash,fast", "cpu")


@pytest.mark.parametrize("name", ["cudnn", "efficient"])
def test_cuda_only_backend_on_cpu_is_refused_with_a_hint(name):
    with pytest.raises(RuntimeError, match=rf"{name} kernel cannot run on cpu \(it is a CUDA-only kernel\)"
                                           r".*sdpa_backend=auto or one that runs here: .*math"):
        attention.sdpa_backends(name, "cpu")


def test_sdpa_list_keeps_its_order():
    assert attention.sdpa_backends("math,flash", "cpu")[0] == [B.MATH, B.FLASH_ATTENTION]
    assert attention.sdpa_backends(" Flash , math,flash", "cpu")[0] == [B.FLASH_ATTENTION, B.MATH]
    backends, why = attention.sdpa_backends("cudnn,efficient,math", "cpu")  # SDPA skips what cannot run
    assert backends == [B.CUDNN_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH]
    assert "cudnn, efficient cannot run on cpu" in why


def test_sdpa_auto_puts_cudnn_first_on_hopper_only(monkeypatch):
    monkeypatch.setattr(attention, "_backend_error", lambda backend, device: None)  # cuDNN attention runs
    monkeypatch.setattr(attention, "_cuda_capability", lambda: (9, 0))
    backends, why = attention.sdpa_backends("auto", "cuda")
    assert backends == [B.CUDNN_ATTENTION, B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH]
    assert "sm90" in why and attention.ATTENTION_OPS_RESULT in why and "measured on an H200" in why
    assert " ms" not in why  # no figures from another machine in a message printed on this one
    assert attention.sdpa_backends("auto", "cpu")[0] is None  # the GPU's capability does not matter on CPU
    monkeypatch.setattr(attention, "_cuda_capability", lambda: (8, 0))
    backends, why = attention.sdpa_backends("auto", "cuda")
    assert backends is None and "sm80" in why
    monkeypatch.setattr(attention, "_cuda_capability", lambda: (9, 0))
    monkeypatch.setattr(attention, "_backend_error", lambda backend, device: "cuDNN too old")
    backends, why = attention.sdpa_backends("auto", "cuda")
    assert backends is None and "cuDNN too old" in why


@pytest.mark.parametrize("case", ["causal", "packed_4_docs"])
def test_hopper_order_follows_the_projects_own_measurement(case):
    """HOPPER_ORDER is fastest first among the SDPA kernels that ran in the op benchmark on the H200."""
    result = json.loads((REPO_ROOT / attention.ATTENTION_OPS_RESULT).read_text())
    assert "H200" in result["gpu"]  # what the auto message and the docstring say about it
    ms = {r["backend"]: r["ms_fwd_bwd"] for r in result[case] if r["status"] == "ok"}
    ran = [n for n in attention.HOPPER_ORDER if n in ms]
    assert ran and ran[0] == attention.HOPPER_ORDER[0] == "cudnn", (case, ms)
    assert [ms[n] for n in ran] == sorted(ms[n] for n in ran), (case, {n: ms[n] for n in ran})


def test_sdpa_context_sets_and_restores_the_order():
    flags = (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.math_sdp_enabled,
             torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.mem_efficient_sdp_enabled)
    before, order = [f() for f in flags], torch._C._get_sdp_priority_order()
    with attention.sdpa_context([B.CUDNN_ATTENTION, B.MATH]):
        assert [f() for f in flags] == [False, True, True, False]
        assert torch._C._get_sdp_priority_order()[:2] == [int(B.CUDNN_ATTENTION), int(B.MATH)]
    assert [f() for f in flags] == before and torch._C._get_sdp_priority_order() == order
    with attention.sdpa_context(None):
        assert [f() for f in flags] == before


# ---- every SDPA kernel that runs on CPU gives the eager numbers -----------------------------------

CPU_KERNELS = ["math", "flash"]  # torch's CPU build has these two; cudnn and efficient are CUDA kernels


def _skip_if_not_on_cpu(name):
    err = attention._backend_error(attention.SDPA_BACKENDS[name], "cpu")
    if err:
        pytest.skip(f"SDPA {name} does not run on this CPU build: {err}")


def test_document_mask():
    expect = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(document_mask(4, docs=2), expect)
    assert torch.equal(document_mask(4, docs=1), torch.ones(4, 4, dtype=torch.bool).tril())
    assert document_mask(4, docs=1, causal=False) is None


@pytest.mark.parametrize("docs", [1, 2])
@pytest.mark.parametrize("name", CPU_KERNELS)
def test_sdpa_kernel_matches_eager_op(name, docs):
    """Forward and all three input grads agree with softmax(QK^T)V to fp32 rounding (1e-5)."""
    _skip_if_not_on_cpu(name)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 16, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 4, 64, 16)
    mask = document_mask(64, docs)
    ref = eager_attention(q, k, v, mask)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    with attention.sdpa_context(attention.sdpa_backends(name, "cpu")[0]):
        sdpa_mask = mask if docs > 1 else None  # one document: is_causal, the path flash kernels take
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, is_causal=docs == 1)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, r, n in zip(grads, ref_grads, "qkv"):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=f"grad {n}")


@pytest.mark.parametrize("name", ["auto", *CPU_KERNELS])  # auto: PyTorch's own order on CPU
def test_tiny_model_under_sdpa_context_matches_eager(name, tokenizer, small_data):
    if name != "auto":
        _skip_if_not_on_cpu(name)
    ds, _ = tokenize_dataset(load_records(str(small_data)), tokenizer, 128)
    batch = Collator(tokenizer.pad_token_id)([ds[i] for i in range(4)])
    ids, real = batch["input_ids"], batch["attention_mask"].bool()
    backends, _ = attention.sdpa_backends(name, "cpu")
    out = {}
    arch = mdl.llama_config(vocab_size=len(tokenizer), **SMALL_ARCH)
    for impl, ctx in (("eager", attention.sdpa_context(None)), ("sdpa", attention.sdpa_context(backends))):
        model = mdl.build_model(arch, attention=impl, seed=0)
        with ctx:  # forward and backward, as a training micro-step does
            logits = model(input_ids=ids).logits
            logits[real].float().logsumexp(-1).sum().backward()
        out[impl] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(out["sdpa"][0][real], out["eager"][0][real], rtol=1e-5, atol=1e-5)
    for pname, g in out["eager"][1].items():
        torch.testing.assert_close(out["sdpa"][1][pname], g, rtol=1e-4, atol=1e-6, msg=pname)
    # the context reaches transformers' SDPA call: a kernel with no CPU version leaves it nothing to run
    with attention.sdpa_context([B.EFFICIENT_ATTENTION]), pytest.raises(RuntimeError, match="No viable backend"):
        model(input_ids=ids)


# ---- the op microbenchmark ------------------------------------------------------------------------


@pytest.mark.parametrize("docs", [1, 2])
def test_benchmark_attention_on_cpu(docs):
    rows = benchmark_attention(batch=1, heads=2, seq=64, head_dim=16, warmup=1, iters=2, docs=docs, device="cpu")
    assert [r["backend"] for r in rows] == list(BENCH_BACKENDS)
    by = {r["backend"]: r for r in rows}
    for r in rows:
        assert r["peak_mem_gb"] is None  # CPU: no CUDA allocator to ask
        if r["status"] == "ok":
            assert r["ms_fwd_bwd"] > 0 and r["max_abs_err_vs_math"] < 1e-5, r
        else:
            assert r["status"].startswith("unavailable: ") and len(r["status"]) > 14, r
            assert r["ms_fwd_bwd"] is None and r["max_abs_err_vs_math"] is None, r
    assert by["eager"]["status"] == by["math"]["status"] == "ok"
    assert by["math"]["max_abs_err_vs_math"] == 0  # the same kernel on the same inputs
    assert "CUDA-only" in by["cudnn"]["status"] and "CUDA-only" in by["efficient"]["status"]
    if not attention.flash_attn_available():
        assert "not installed" in by["flash_attn"]["status"]
    table = format_attention_table(rows).splitlines()
    assert len(table) == 2 + len(rows) and table[0].startswith("| backend |")
    assert any(line.startswith("| math | ") and "0.0e+00" in line for line in table)


def test_benchmark_attention_grouped_query_heads():
    rows = benchmark_attention(batch=2, heads=4, kv_heads=2, seq=48, head_dim=8, warmup=1, iters=1,
                               docs=3, backends=("eager", "math"), device="cpu")
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert rows[0]["max_abs_err_vs_math"] < 1e-5 and rows[1]["max_abs_err_vs_math"] == 0
    with pytest.raises(ValueError, match="unknown 'fa3'"):
        benchmark_attention(backends=("eager", "fa3"))


def test_the_default_sdpa_kernel_is_the_one_sdpa_runs_unasked():
    """The kernel PyTorch's own selector names is the one SDPA runs with no order given: its output equals, bit
    for bit, SDPA restricted to that kernel alone (on CPU: flash for fp32 causal)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    name = attention.default_sdpa_kernel(1, 2, 64, 16, "cpu")
    assert name in attention.SDPA_BACKENDS
    q, k, v = (torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    unasked = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel([attention.SDPA_BACKENDS[name]]):
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True), unasked)
