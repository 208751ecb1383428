"""QLoRA's 4-bit weights read in plain torch (tunekit/nf4.py) and the fused LoRA over them (`--method qlora
--fast-lora`, with `--fp8` too): bitsandbytes' own values to the bit, peft's QLoRA loss and gradients in fp32 on
every family, and in FP8 exactly the numbers of the FP8 path over the same weights in bf16/fp32 (tested against
peft in test_fastlora.py). On CPU, bitsandbytes' CPU build quantizes; FP8 matmuls are emulated as there."""

from __future__ import annotations

import copy

import pytest
import torch
from test_hf import FAMILIES, assert_same, batch, family_model, loss_and_grads

from tunekit import fastlora, nf4
from tunekit.config import ConfigError
from tunekit.model import apply_lora
from tunekit.presets import tiny

bnb = pytest.importorskip("bitsandbytes", reason="QLoRA's 4-bit layers are bitsandbytes'")


def four_bit_linear(weight, bias=None, nested=True, blocksize=64, storage=torch.uint8, quant_type="nf4"):
    out_f, in_f = weight.shape
    layer = bnb.nn.Linear4bit(in_f, out_f, bias=bias is not None, compute_dtype=torch.float32,
                              compress_statistics=nested, quant_type=quant_type, quant_storage=storage)
    layer.weight = bnb.nn.Params4bit(weight.detach().clone(), requires_grad=False, compress_statistics=nested,
                                     quant_type=quant_type, blocksize=blocksize, quant_storage=storage)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
    return layer.to("cpu")  # quantizes


def four_bit(model, **kw):
    """`model` with every linear layer but the LM head 4-bit, as `from_pretrained(quantization_config=...)`."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and name != "lm_head":
                setattr(module, name, four_bit_linear(child.weight, child.bias, **kw))
    return model


def qlora_model(family="llama", seed=0, **kw):
    """A random-init `family` model made 4-bit, with LoRA adapters on every linear layer, random B matrices."""
    model = four_bit(family_model(family, lora=False, seed=seed), **kw)
    torch.manual_seed(seed + 1)
    model = apply_lora(model, r=4, alpha=8)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model.train()


def attach_fp8_on_cpu(model):
    """`attach(fp8=True)` on CPU, where no FP8 matmul exists: `mm8` then emulates it."""
    real, fastlora.fp8_matmul_available = fastlora.fp8_matmul_available, lambda device: True
    try:
        return fastlora.attach(model, fp8=True)
    finally:
        fastlora.fp8_matmul_available = real


@pytest.mark.parametrize(("shape", "nested", "blocksize", "storage"), [
    ((96, 128), True, 64, torch.uint8),
    ((96, 128), False, 64, torch.uint8),
    ((300, 64), True, 64, torch.uint8),  # 300 absmaxes: the last nested block of 256 is partial
    ((64, 512), True, 128, torch.uint8),
    ((96, 128), True, 64, torch.bfloat16),  # the storage FSDP needs: the same bytes
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_bitsandbytes_to_the_bit(shape, nested, blocksize, storage, dtype):
    layer = four_bit_linear(torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05,
                            nested=nested, blocksize=blocksize, storage=storage)
    assert nf4.is_4bit(layer) and nf4.why_not(layer) == ""
    ours = nf4.dequantize(*nf4.tensors(layer), *nf4.shape_of(layer), dtype)
    theirs = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).to(dtype)
    assert ours.shape == shape and ours.dtype == dtype
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_lora_over_4bit_weights_matches_peft_qlora(family):
    plain = qlora_model(family)
    fused = copy.deepcopy(plain)
    assert fastlora.attach(fused) == "fused LoRA in 14 linear layers, frozen base weights 4-bit NF4, read at each use"
    ids, labels = batch()
    assert_same(loss_and_grads(fused, ids, labels), loss_and_grads(plain, ids, labels))


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_over_4bit_weights_is_fp8_over_the_same_weights_unquantized(family):
    """Read into FP8 at each use, a 4-bit weight gives exactly what the FP8 path gives for that weight held in
    fp32 and quantized once; against peft's QLoRA the loss stays within FP8's rounding."""
    qlora = qlora_model(family)
    dense = family_model(family, lora=True)  # the same shapes and adapters, its base weights set below
    with torch.no_grad():
        dense.load_state_dict(_dequantized_state(qlora, dense))
    fused, ids_labels = copy.deepcopy(qlora), batch()
    assert "read into FP8" in attach_fp8_on_cpu(fused)
    attach_fp8_on_cpu(dense)
    (l8, g8), (ld, gd) = loss_and_grads(fused, *ids_labels), loss_and_grads(dense, *ids_labels)
    torch.testing.assert_close(l8, ld, rtol=1e-6, atol=1e-6)
    for n in gd:
        torch.testing.assert_close(g8[n], gd[n], rtol=1e-5, atol=1e-7, msg=n)
    l0, _ = loss_and_grads(qlora, *ids_labels)
    assert abs(float(l8 - l0)) / float(l0) < 0.01  # e4m3: 3 mantissa bits, averaging out over the sums


def _dequantized_state(model, dense) -> dict:
    """`dense`'s state filled from `model`'s: each 4-bit weight as the fp32 weight it stands for."""
    theirs = model.state_dict()
    for name, module in model.named_modules():
        if nf4.is_4bit(module):
            theirs[f"{name}.weight"] = nf4.dequantize(*nf4.tensors(module), *nf4.shape_of(module), torch.float32)
    return {k: theirs[k] for k in dense.state_dict()}


def test_detach_gives_peft_qlora_back_and_4bit_layers_are_not_grouped():
    plain = qlora_model()
    fused = copy.deepcopy(plain)
    assert "groups" not in fastlora.attach(fused, group=True)  # no concatenated 4-bit weight exists to share
    ids, labels = batch()
    expected = loss_and_grads(plain, ids, labels)
    assert_same(loss_and_grads(fused, ids, labels), expected)
    assert fastlora.detach(fused) == 14
    assert not [n for n, _ in fused.named_buffers() if "tk_" in n]
    assert not [m for m in fused.modules() if hasattr(m, "tk_nf4_shape")]
    assert_same(loss_and_grads(fused, ids, labels), expected)


def test_a_4bit_type_it_cannot_read_is_refused_naming_the_layer():
    model = qlora_model(quant_type="fp4")
    with pytest.raises(ValueError, match=r"layer .*q_proj: its 4-bit type is fp4; only nf4"):
        fastlora.attach(model)


def test_qlora_takes_fp8_through_the_fused_lora_only():
    with pytest.raises(ConfigError, match="fp8.*--fast-lora"):
        tiny(method="qlora", fp8=True)
    cfg = tiny(method="qlora", fp8=True, fast_lora=True)
    assert cfg.fp8 and cfg.fast_lora


@pytest.mark.slow
def test_compiled_4bit_layer_reads_the_codes_to_the_same_numbers():
    """Under torch.compile the codes are read by torch operations (`nf4.dequantize`'s traced path), not
    bitsandbytes' kernel: the same loss and gradients as eager."""
    model = qlora_model()
    fused = copy.deepcopy(model)
    fastlora.attach(fused)
    layer = fused.base_model.model.model.layers[0].mlp
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(3))
    outs = []
    for f in (layer, torch.compile(layer, backend="inductor")):
        y = f(x.clone().requires_grad_())
        y.square().mean().backward()
        outs.append((y.detach(), {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}))
        layer.zero_grad(set_to_none=True)
    (y0, g0), (y1, g1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys() and len(g0) == 6
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)


def saved_for_backward(module, x) -> dict[tuple, int]:
    """{(shape, dtype): count} of what `module(x)` keeps for its backward, its own parameters and buffers aside."""
    own = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    saved, seen = {}, set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own and ptr not in seen:
            seen.add(ptr)
            key = (tuple(t.shape), t.dtype)
            saved[key] = saved.get(key, 0) + 1
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x).square().mean().backward()
    return saved


@pytest.mark.slow
@pytest.mark.parametrize("fp8", [False, True])
def test_compiled_4bit_layer_keeps_for_the_backward_what_peft_keeps(fp8):
    """Under compile the fused layer reads its weight again in the backward (`nf4.tied_to`) rather than keep part of
    the forward's read: its MLP saves what peft's QLoRA MLP saves, no weight-sized tensor (compile's partitioner
    had kept the unpacked codes, a byte a weight, or the weight itself)."""
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(3))
    saved = []
    for attach in (None, attach_fp8_on_cpu if fp8 else fastlora.attach):
        model = qlora_model()
        if attach:
            attach(model)
        torch._dynamo.reset()
        saved.append(saved_for_backward(torch.compile(model.base_model.model.model.layers[0].mlp), x))
    peft, fused = saved
    assert fused == peft  # the inputs x, x A^T and the activations: no codes, scales or weights


def test_speed_up_leaves_a_4bit_model_on_peft_unless_asked_and_then_follows_peft():
    import tunekit

    auto = tunekit.speed_up(qlora_model(), verbose=False)
    assert auto.tunekit_speed_ups["fast_lora"].startswith("not applied (4-bit base layers")
    asked, ids_labels = tunekit.speed_up(qlora_model(), fast_lora=True, verbose=False), batch()
    assert "4-bit NF4" in asked.tunekit_speed_ups["fast_lora"]
    assert_same(loss_and_grads(asked, *ids_labels), loss_and_grads(auto, *ids_labels))
