"""tunekit's fused LoRA linear (tunekit/fastlora.py) against peft's path: the same loss and gradients in fp32,
within FP8's rounding with the frozen weights in FP8 (emulated on CPU: the same scaled numbers, multiplied in
fp32; on a GPU with FP8 tensor cores, `torch._scaled_mm`)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import gpu

from tunekit import fastlora
from tunekit.config import ConfigError
from tunekit.model import apply_lora, build_model, llama_config, save_adapter
from tunekit.presets import tiny

ARCH = llama_config(64, 2, 4, 128, 256)


def lora_model(device="cpu", dtype=torch.float32, seed=0):
    model = apply_lora(build_model(ARCH, dtype=dtype, device=device, seed=seed), r=8, alpha=16)
    with torch.no_grad():  # peft starts B at zero: give the adapters something to say
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


def loss_and_grads(model, ids, autocast=None):
    with torch.autocast(ids.device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture
def ids():
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def test_fused_lora_matches_peft_in_fp32(ids):
    plain = lora_model()
    fused = copy.deepcopy(plain)
    assert "fused LoRA in 14 linear layers" in fastlora.attach(fused)
    l0, g0 = loss_and_grads(plain, ids)
    l1, g1 = loss_and_grads(fused, ids)
    assert torch.allclose(l0, l1, rtol=1e-6, atol=1e-6)
    assert g0.keys() == g1.keys() and len(g0) == 28  # every lora_A and lora_B
    for n in g0:
        assert rel(g1[n], g0[n]) < 1e-5, n


def test_grouped_siblings_match_peft_and_each_layer_alone(ids, monkeypatch):
    """q/k/v and gate/up as one matmul each way (`GroupLoRA`) against peft and the ungrouped fused path, fp32:
    the same loss and gradients; the members' weights are views of the one concatenated weight."""
    plain = lora_model()
    grouped, alone = copy.deepcopy(plain), copy.deepcopy(plain)
    assert "4 groups of siblings" in fastlora.attach(grouped, group=True)
    assert "groups" not in fastlora.attach(alone)  # the default: each layer alone
    attn = grouped.base_model.model.model.layers[0].self_attn
    w = attn.tk_group_w
    assert w.shape == (3 * 64, 64)
    assert attn.k_proj.base_layer.weight.data_ptr() == w.data_ptr() + 64 * 64 * w.element_size()
    calls = []
    apply = fastlora.GroupLoRA.apply
    monkeypatch.setattr(fastlora.GroupLoRA, "apply", lambda *a: calls.append(1) or apply(*a))
    l0, g0 = loss_and_grads(plain, ids)
    l1, g1 = loss_and_grads(grouped, ids)
    l2, g2 = loss_and_grads(alone, ids)
    assert len(calls) == 4  # one per group, per forward: each sibling took what the first one left
    assert torch.allclose(l1, l0, rtol=1e-6, atol=1e-6) and torch.allclose(l2, l0, rtol=1e-6, atol=1e-6)
    for n in g0:
        assert rel(g1[n], g0[n]) < 1e-5 and rel(g2[n], g0[n]) < 1e-5, n


def test_a_sibling_called_with_another_input_computes_alone():
    model = lora_model()
    fastlora.attach(model, group=True)
    attn = model.base_model.model.model.layers[0].self_attn
    x, y = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    ref = copy.deepcopy(attn)
    fastlora.detach(ref)
    q = attn.q_proj(x)  # leaves k and v of x for their calls
    assert torch.allclose(q, ref.q_proj(x), atol=1e-6)
    assert torch.allclose(attn.k_proj(y), ref.k_proj(y), atol=1e-6)  # another input: not x's k
    assert torch.allclose(attn.v_proj(x), ref.v_proj(x), atol=1e-6)
    assert torch.allclose(attn.k_proj(x), ref.k_proj(x), atol=1e-6)


@pytest.mark.slow
def test_a_grouped_block_compiles_as_one_graph():
    """The siblings' hand-off (the first call leaves the others' outputs) traces without a graph break."""
    model = lora_model()
    fastlora.attach(model, group=True)
    layer = model.base_model.model.model.layers[0]
    x = torch.randn(2, 16, 64, requires_grad=True)
    rope = model.base_model.model.model.rotary_emb(x, torch.arange(16)[None])
    out = torch.compile(layer, fullgraph=True)(x, position_embeddings=rope)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    assert x.grad is not None and layer.self_attn.q_proj.tk_group.pending is None


def saved_storage(module, *args, **kwargs) -> dict[int, tuple]:
    """{storage: (its bytes, a tensor's shape)} of what `module(*args)` keeps for its backward, its own parameters
    and buffers aside: a view kept keeps its whole storage."""
    own = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    seen = {}

    def pack(t):
        if (ptr := t.untyped_storage().data_ptr()) not in own:
            seen[ptr] = (t.untyped_storage().nbytes(), tuple(t.shape))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*args, **kwargs)
        (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()
    return seen


@pytest.mark.parametrize("compiled", [False, True])
def test_grouped_attention_keeps_v_not_all_of_q_k_v(compiled):
    """Attention keeps v for its backward; grouped, v was a view of the one q/k/v output and kept all three alive
    (4.3 GB at 7B, batch 4). v has storage of its own now: no kept tensor is as large as the q/k/v output."""
    model = lora_model(dtype=torch.bfloat16)
    fastlora.attach(model, group=True)
    attn = model.base_model.model.model.layers[0].self_attn
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    rope = model.base_model.model.model.rotary_emb(x, torch.arange(16)[None])
    torch._dynamo.reset()
    kept = saved_storage(torch.compile(attn) if compiled else attn, x, position_embeddings=rope, attention_mask=None)
    qkv = 2 * 16 * (64 + 64 + 64) * 2  # bytes of the grouped q/k/v output (4 heads of 16, no GQA)
    assert kept and max(b for b, _ in kept.values()) < qkv, sorted(kept.values(), reverse=True)[:3]
    assert any(b == qkv // 3 and shape[-1] == 16 for b, shape in kept.values())  # v itself, [.., heads, s, 16]


def test_detach_restores_peft_and_merged_export_saves_every_weight(ids, tmp_path):
    from safetensors.torch import load_file

    from tunekit.model import merge_adapter

    plain = lora_model()
    fused = copy.deepcopy(plain)
    fastlora.attach(fused, group=True)
    want = plain(input_ids=ids).logits
    merged = merge_adapter(fused, tmp_path / "m", dtype=torch.float32)
    assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-4)
    saved = load_file(tmp_path / "m" / "model.safetensors")
    for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert f"model.layers.1.self_attn.{n}.weight" in saved or f"model.layers.1.mlp.{n}.weight" in saved, n
    assert not any("tk_" in n for n, _ in merged.named_buffers())
    again = copy.deepcopy(plain)
    fastlora.attach(again, group=True)
    assert fastlora.detach(again) == 14
    assert torch.allclose(again(input_ids=ids).logits, want, atol=1e-6)


@pytest.mark.parametrize("group", [False, True])
def test_fp8_frozen_weights_stay_within_fp8_rounding(ids, group):
    plain = lora_model()
    fused = copy.deepcopy(plain)
    before = set(fused.state_dict())
    fused_fp8 = _attach_fp8_cpu(fused, group)
    l0, g0 = loss_and_grads(plain, ids)
    l1, g1 = loss_and_grads(fused_fp8, ids)
    # e4m3 keeps 3 mantissa bits (relative rounding up to 1/16); over sums of many products it averages out
    assert abs(float(l1 - l0)) / float(l0) < 0.01
    for n in g0:
        assert rel(g1[n], g0[n]) < 0.08, n
    assert set(fused_fp8.state_dict()) == before  # the FP8 copies are not part of what is saved


@pytest.mark.parametrize("switch", ["LORA_BMM", "BF16_BMM"])
def test_products_as_bmm_give_the_same_numbers(ids, monkeypatch, switch):
    """`LORA_BMM` (FP8 weights: the LoRA products) and `BF16_BMM` (bf16 weights: the base and LoRA products)
    change which kernel computes them, not their values."""
    model = _attach_fp8_cpu(lora_model()) if switch == "LORA_BMM" else fastlora.attach(m := lora_model()) and m
    out = []
    for flag in (False, True):
        monkeypatch.setattr(fastlora, switch, flag)
        out.append(loss_and_grads(model, ids))
    (l0, g0), (l1, g1) = out
    torch.testing.assert_close(l1, l0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7, msg=n)


def test_the_command_line_sets_bf16_bmm_from_the_environment(monkeypatch):
    from tunekit import cli

    monkeypatch.setattr(fastlora, "BF16_BMM", False)
    monkeypatch.delenv("TUNEKIT_FP8_FAST_ACCUM", raising=False)
    monkeypatch.setenv("TUNEKIT_BF16_BMM", "1")
    cli.apply_environment()  # the switches whose variables are unset keep their defaults
    assert fastlora.BF16_BMM is True and fastlora.LORA_BMM is True and fastlora.FAST_ACCUM_BACKWARD is True


@pytest.mark.slow
def test_bf16_products_as_bmm_leave_inductor_no_matmul_to_fold_an_addition_into():
    """Compiled, a bf16 fused layer's additions after an `mm` become cuBLAS `addmm`s, which copy the addend to
    the output first; with `BF16_BMM` no `addmm` is left (CPU inductor folds as CUDA's does)."""
    from torch._inductor.utils import run_and_get_code

    model = lora_model(dtype=torch.bfloat16)
    fastlora.attach(model, group=True)
    attn = model.base_model.model.model.layers[0].self_attn
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    rope = model.base_model.model.model.rotary_emb(x, torch.arange(16)[None])
    codes = {}
    for flag in (False, True):
        fastlora.BF16_BMM = flag
        try:
            torch._dynamo.reset()
            step = torch.compile(lambda x: attn(x, position_embeddings=rope, attention_mask=None)[0].sum().backward())
            codes[flag] = "\n".join(run_and_get_code(step, x)[1])
        finally:
            fastlora.BF16_BMM = False
    assert "addmm" in codes[False] and "addmm" not in codes[True]


def test_fast_accumulation_of_the_input_gradient_is_a_switch(ids, monkeypatch):
    """The forward's FP8 matmuls accumulate fast, and by default the input gradient's too; at full precision
    where `FAST_ACCUM_BACKWARD` (TUNEKIT_FP8_FAST_ACCUM=0 through the command line) says so."""
    from tunekit import cli

    model, seen, real = _attach_fp8_cpu(lora_model()), [], fastlora.mm8
    monkeypatch.setattr(fastlora, "mm8",
                        lambda *a, fast_accum: seen.append(fast_accum) or real(*a, fast_accum=fast_accum))
    assert fastlora.FAST_ACCUM_BACKWARD is True  # the library's default
    for env, backward in ((None, True), ("1", True), ("0", False)):
        if env is None:
            monkeypatch.delenv("TUNEKIT_FP8_FAST_ACCUM", raising=False)
        else:
            monkeypatch.setenv("TUNEKIT_FP8_FAST_ACCUM", env)
        monkeypatch.setattr(fastlora, "FAST_ACCUM_BACKWARD", True)
        cli.apply_environment()
        assert fastlora.FAST_ACCUM_BACKWARD is backward and fastlora.LORA_BMM is True and not fastlora.BF16_BMM
        seen.clear()
        loss_and_grads(model, ids)
        n = len(seen) // 2  # every fused layer: one FP8 matmul forward, one backward
        assert seen == [True] * n + [backward] * n, (env, seen)


def _attach_fp8_cpu(model, group=False):
    """`attach(fp8=True)` on CPU, where no FP8 matmul exists: the same quantized buffers, `mm8` emulating."""
    real = fastlora.fp8_matmul_available
    fastlora.fp8_matmul_available = lambda device: True
    try:
        fastlora.attach(model, fp8=True, group=group)
    finally:
        fastlora.fp8_matmul_available = real
    return model


def test_quantize_is_within_e4m3_rounding_and_scales_are_powers_of_two():
    t = torch.randn(64, 48) * torch.logspace(-3, 3, 48)  # columns of very different magnitudes
    for dim in (-1, 0):
        q, inv = fastlora.quantize(t, dim)
        assert q.dtype == torch.float8_e4m3fn
        assert torch.equal(torch.log2(inv), torch.round(torch.log2(inv)))
        back = q.float() * inv
        assert (back - t).abs().max() <= (t.abs().amax(dim=dim, keepdim=True) / 8).max()
        assert rel(back, t) < 0.04


def test_merged_or_disabled_adapters_take_peft_path_and_the_adapter_saves_as_peft(ids, tmp_path):
    plain = lora_model()
    fused = copy.deepcopy(plain)
    fastlora.attach(fused)
    with fused.disable_adapter(), plain.disable_adapter():
        assert torch.allclose(fused(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-5)
    save_adapter(plain, tmp_path / "a")
    save_adapter(fused, tmp_path / "b")
    assert (tmp_path / "a" / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "b" / "adapter_model.safetensors").read_bytes()
    merged = fused.merge_and_unload()
    assert torch.allclose(merged(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-4)


def qwen2_model():
    """A tiny Qwen2: q/k/v with a bias (random, where random init leaves them zero)."""
    import transformers

    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random init gives zero biases: make them count
        for n, p in base.named_parameters():
            if n.endswith("proj.bias"):
                p.normal_(0, 0.5)
    return base


def qwen2_lora_model():
    """`qwen2_model` with LoRA on every linear layer (the biases frozen) and random LoRA B matrices."""
    model = apply_lora(qwen2_model(), r=8, alpha=16)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("group", [False, True])
def test_a_frozen_base_bias_is_added_as_peft_adds_it(ids, group):
    """Qwen2's q/k/v have a bias: the fused path (alone, grouped, and with FP8 weights) adds it as peft's does."""
    plain = qwen2_lora_model()
    fused, fp8 = copy.deepcopy(plain), copy.deepcopy(plain)
    assert "fused LoRA in 14 linear layers" in fastlora.attach(fused, group=group)
    if group:
        attn = fused.base_model.model.model.layers[0].self_attn
        assert attn.tk_group_b.shape == (64 + 2 * 32,)  # q's 64 outputs, k's and v's 32 (2 KV heads)
    l0, g0 = loss_and_grads(plain, ids)
    l1, g1 = loss_and_grads(fused, ids)
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
    for n in g0:  # 3e-5: the grouped matmul sums in another order, over the larger activations the biases give
        assert rel(g1[n], g0[n]) < 3e-5, n
    l2, _ = loss_and_grads(_attach_fp8_cpu(fp8, group=group), ids)
    assert abs(float(l2 - l0)) / float(l0) < 0.01


def test_layers_it_cannot_fuse_are_named():
    from peft import LoraConfig, get_peft_model

    trained_bias = get_peft_model(qwen2_model(), LoraConfig(r=4, target_modules=["q_proj"], bias="all"))
    with pytest.raises(ValueError, match=r"q_proj: its base bias trains .*bias='none'"):
        fastlora.attach(trained_bias)
    model = apply_lora(build_model(ARCH, seed=0), r=8, alpha=16, dropout=0.1)
    with pytest.raises(ValueError, match=r"layer .*q_proj: it has LoRA dropout"):
        fastlora.attach(model)
    with pytest.raises(ValueError, match="no peft LoRA"):
        fastlora.attach(build_model(ARCH, seed=0))
    with pytest.raises(RuntimeError, match="compute capability 8.9"):
        fastlora.attach(lora_model(), fp8=True)  # CPU
    with pytest.raises(ConfigError, match="fast_lora"):
        tiny(method="full", fast_lora=True)
    with pytest.raises(ConfigError, match="--lora-dropout 0"):
        tiny(fast_lora=True, lora_dropout=0.1)


def test_training_with_fast_lora_follows_peft(make_cfg):
    """Three optimizer steps of `tunekit train` with and without --fast-lora: the same losses (fp32, CPU)."""
    from tunekit import train

    a = train.train(make_cfg("plain", max_steps=3), progress=False)
    b = train.train(make_cfg("fused", max_steps=3, fast_lora=True), progress=False)
    assert b["final_loss"] == pytest.approx(a["final_loss"], rel=1e-5)


@gpu
def test_fp8_scaled_mm_matches_the_emulation_and_bf16_loss():
    torch.manual_seed(0)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16) / 20
    xq, xi = fastlora.quantize(x, -1)
    wq, wi = fastlora.quantize(w, -1)
    fast = fastlora.mm8(xq, xi, wq.t(), wi.t().contiguous(), torch.bfloat16, fast_accum=True)
    emulated = ((xq.float() * xi) @ (wq.float() * wi).t()).bfloat16()
    assert rel(fast, emulated) < 0.01 and rel(fast, (x @ w.t())) < 0.06
    ids = torch.randint(0, 256, (4, 64), device="cuda")
    plain = lora_model("cuda", torch.bfloat16)
    fused = copy.deepcopy(plain)
    fastlora.attach(fused, fp8=True, group=True)
    alone = copy.deepcopy(plain)
    fastlora.attach(alone, fp8=True)
    bf16 = copy.deepcopy(plain)
    fastlora.attach(bf16)
    l0, g0 = loss_and_grads(plain, ids, torch.bfloat16)
    l1, g1 = loss_and_grads(fused, ids, torch.bfloat16)
    lb, gb = loss_and_grads(bf16, ids, torch.bfloat16)
    assert abs(float(lb - l0)) / float(l0) < 1e-3  # bf16: the same products, summed in another order
    for n in g0:
        assert rel(gb[n], g0[n]) < 0.03, n
    la, ga = loss_and_grads(alone, ids, torch.bfloat16)
    for loss, grads in ((l1, g1), (la, ga)):
        assert abs(float(loss - l0)) / float(l0) < 0.01
        for n in g0:
            assert rel(grads[n], g0[n]) < 0.1, n


@pytest.mark.slow
@pytest.mark.parametrize("group", [False, True])
def test_fused_lora_compiles_regionally_to_the_same_numbers(ids, group):
    """Each decoder block compiled by inductor (on CPU) with the fused forward inside: the loss and LoRA
    gradients of peft's eager path within fp32 rounding (inductor reorders sums)."""
    from tunekit import speedups
    from tunekit.step import StepModule, micro_step

    plain = lora_model()
    fused = copy.deepcopy(plain)
    fastlora.attach(fused, group=group)
    batch = {"input_ids": ids, "labels": ids.clone()}
    out = []
    for model, mode in ((plain, "none"), (fused, "regional")):
        step = speedups.compile_step(StepModule(model, "chunked"), model, mode)
        loss = micro_step(model, batch, 64, None, step_module=step)
        out.append((loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = out
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=0)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)
