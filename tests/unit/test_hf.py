"""tunekit.speed_up and tunekit.PackingCollator on models a user built (tunekit/hf.py): the same loss and gradients
as the model's own forward on every family it accepts, a clear refusal of what a model does not allow, and
packing that gives each sample its own loss. Tiny random-init models of each family, fp32 on the CPU, where the
fused paths do the same arithmetic as peft's and transformers' own: losses equal to 1e-6, gradients to 1e-5
(relative), the tolerances of tests/unit/test_fastlora.py."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import transformers

import tunekit
from tunekit import model as mdl
from tunekit.data.batching import IGNORE

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=256)
FAMILIES = {  # config class, what sets the family apart
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, {}),
    "qwen2": (transformers.Qwen2Config, {}),  # a bias on q/k/v
    "gemma2": (transformers.Gemma2Config, {"head_dim": 16, "final_logit_softcapping": 30.0}),  # soft-capped logits
}


def family_model(family: str, lora: bool = True, dropout: float = 0.0, seed: int = 0):
    """A random-init fp32 model of `family` (eager attention for Gemma 2, whose SDPA path transformers refuses),
    with a LoRA adapter on every linear layer whose B matrices are random, so every adapter weight has a gradient."""
    config_cls, extra = FAMILIES[family]
    config = config_cls(**SHAPE, **extra)
    config._attn_implementation = "eager" if family == "gemma2" else "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if lora:
        torch.manual_seed(seed + 1)
        model = mdl.apply_lora(model, r=4, alpha=8, dropout=dropout)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
    return model.train()


def batch(seed: int = 0, rows: int = 2, width: int = 24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SHAPE["vocab_size"], (rows, width), generator=g)
    labels = ids.clone()
    labels[0, :7] = IGNORE  # a prompt
    labels[1, -5:] = IGNORE  # padding
    return ids, labels


def loss_and_grads(model, ids, labels, **kw):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels, **kw).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-5, atol=1e-7, msg=n)


# ---- speed_up: the same numbers, family by family ------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_speed_up_gives_the_loss_and_gradients_of_the_model_itself(family):
    plain = family_model(family)
    fast = tunekit.speed_up(copy.deepcopy(plain), verbose=False)
    ids, labels = batch()
    assert_same(loss_and_grads(fast, ids, labels), loss_and_grads(plain, ids, labels))
    done = fast.tunekit_speed_ups
    assert done["loss"].startswith("chunked")
    assert done["fast_lora"].startswith("fused LoRA in 14 linear layers")  # Qwen2's q/k/v biases included


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grouped_siblings_give_the_loss_and_gradients_of_the_model_itself(family):
    """With --fast-lora, `tunekit train` computes q/k/v and gate/up each as one matmul by default
    (`fastlora.attach(group=True)`): the same numbers as the model's own forward on every family."""
    from tunekit import fastlora

    plain = family_model(family)
    grouped = copy.deepcopy(plain)
    assert "4 groups of siblings" in fastlora.attach(grouped, group=True)  # 2 layers: q/k/v and gate/up each
    ids, labels = batch()
    assert_same(loss_and_grads(grouped, ids, labels), loss_and_grads(plain, ids, labels))


def test_the_trainer_s_token_count_divides_the_summed_loss():
    """Trainer's gradient accumulation passes num_items_in_batch: the loss is the sum over it, as transformers'."""
    plain = family_model("llama")
    fast = tunekit.speed_up(copy.deepcopy(plain), verbose=False)
    ids, labels = batch()
    n = torch.tensor(50)
    assert_same(loss_and_grads(fast, ids, labels, num_items_in_batch=n),
                loss_and_grads(plain, ids, labels, num_items_in_batch=n))


def test_packed_rows_with_position_ids_match_the_model_itself():
    plain = family_model("llama")
    fast = tunekit.speed_up(copy.deepcopy(plain), verbose=False)
    ids, labels = batch(width=20)
    positions = torch.cat([torch.arange(12), torch.arange(8)]).repeat(2, 1)
    # Without a KV cache: transformers masks attention per sample only then (with one, it attends across them)
    assert_same(loss_and_grads(fast, ids, labels, position_ids=positions),
                loss_and_grads(plain, ids, labels, position_ids=positions, use_cache=False))


def test_gemma2_s_soft_capped_logits_take_the_chunked_loss():
    """Gemma 2 soft-caps its logits (final_logit_softcapping): the chunked loss applies the cap and its gradient,
    giving the loss and gradients of the model's own head."""
    plain = family_model("gemma2")
    fast = tunekit.speed_up(copy.deepcopy(plain), verbose=False)
    assert fast.tunekit_speed_ups["loss"].startswith("chunked")
    ids, labels = batch()
    assert_same(loss_and_grads(fast, ids, labels), loss_and_grads(plain, ids, labels))


def test_outside_training_the_model_returns_its_logits():
    """Eval mode, no labels, or no grad: the model's own forward (metrics and generate need the logits)."""
    plain = family_model("llama")
    fast = tunekit.speed_up(copy.deepcopy(plain), verbose=False)
    ids, labels = batch()
    assert fast(input_ids=ids, labels=labels).logits is None  # training: no logits held
    for m in (fast, plain):
        m.eval()
    out, want = fast(input_ids=ids, labels=labels), plain(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.logits, want.logits)
    torch.testing.assert_close(out.loss, want.loss)
    fast.train()
    with torch.no_grad():
        assert fast(input_ids=ids).logits.shape == (2, 24, SHAPE["vocab_size"])


def test_the_forward_keeps_the_model_s_signature():
    """Trainer keeps the dataset columns the model's forward names (remove_unused_columns)."""
    fast = tunekit.speed_up(family_model("llama"), verbose=False)
    names = inspect.signature(fast.get_base_model().forward).parameters
    assert {"input_ids", "attention_mask", "position_ids", "labels"} <= set(names)


def test_checkpointing_and_regional_compile_keep_the_numbers():
    plain = family_model("llama")
    fast = tunekit.speed_up(copy.deepcopy(plain), grad_ckpt=True, grad_ckpt_offload=True, compile="regional",
                            verbose=False)
    done = fast.tunekit_speed_ups
    assert "offloaded" in done["grad_ckpt"] and done["compile"] == "regional: 2 decoder blocks, dynamic shapes"
    ids, labels = batch()
    assert_same(loss_and_grads(fast, ids, labels), loss_and_grads(plain, ids, labels))


def test_compile_recompute_reaches_the_partitioner_and_needs_compile():
    import torch._functorch.config as partitioner

    if not hasattr(partitioner, "ban_recompute_materialized_backward"):
        pytest.skip("this torch has no setting for what compile's partitioner recomputes")
    plain = family_model("llama")
    try:
        fast = tunekit.speed_up(copy.deepcopy(plain), compile="regional", compile_recompute=True, verbose=False)
        assert partitioner.ban_recompute_materialized_backward is False
        assert fast.tunekit_speed_ups["compile"].endswith("recomputing what the adapters read")
        ids, labels = batch()
        assert_same(loss_and_grads(fast, ids, labels), loss_and_grads(plain, ids, labels))
    finally:
        partitioner.ban_recompute_materialized_backward = True
    with pytest.raises(ValueError, match="set compile='regional'"):
        tunekit.speed_up(family_model("llama"), compile_recompute=True, verbose=False)


def test_speed_up_is_applied_in_place_and_a_second_call_keeps_one_loss_swap():
    model = family_model("llama")
    assert tunekit.speed_up(model, fast_lora=False, verbose=False) is model
    own = model.get_base_model()._tk_forward
    tunekit.speed_up(model, fast_lora=False, verbose=False)
    assert model.get_base_model()._tk_forward is own  # the model's own forward stays the one underneath


# ---- speed_up: what a model does not allow is refused, saying why ------------------------------------------------


def test_fast_lora_asked_for_on_a_model_it_does_not_suit_is_refused_with_the_layer():
    from peft import LoraConfig, get_peft_model

    trained_bias = get_peft_model(family_model("qwen2", lora=False), LoraConfig(r=4, target_modules=["q_proj"],
                                                                                 bias="all"))
    with pytest.raises(ValueError, match=r"fast_lora=True\): layer .*q_proj: its base bias trains"):
        tunekit.speed_up(trained_bias, fast_lora=True, verbose=False)
    with pytest.raises(ValueError, match="LoRA dropout"):
        tunekit.speed_up(family_model("llama", dropout=0.1), fast_lora=True, verbose=False)
    with pytest.raises(ValueError, match="no peft LoRA linear layers"):
        tunekit.speed_up(family_model("llama", lora=False), fast_lora=True, verbose=False)


def test_auto_skips_what_does_not_apply_and_says_so(capsys):
    model = tunekit.speed_up(family_model("llama", dropout=0.1))
    assert "not applied" in model.tunekit_speed_ups["fast_lora"] and "dropout" in model.tunekit_speed_ups["fast_lora"]
    assert "tunekit.speed_up: fast_lora not applied" in capsys.readouterr().out
    full = tunekit.speed_up(family_model("llama", lora=False), verbose=False)  # a full fine-tune: the loss only
    assert "no peft LoRA" in full.tunekit_speed_ups["fast_lora"] and full.tunekit_speed_ups["loss"].startswith("chunked")


@pytest.mark.parametrize("switches, message", [
    ({"fp8": True}, "FP8 matmuls need a CUDA GPU"),
    ({"fp8": True, "fast_lora": False}, "set fast_lora=True"),
    ({"compile": "model"}, "torch_compile=True"),
    ({"compile": "max"}, "choose one of none, regional"),
    ({"loss": "fast"}, "choose one of auto, chunked, liger, plain"),
    ({"fast_lora": "yes"}, "choose True, False or 'auto'"),
])
def test_switches_that_cannot_apply_here_are_refused(switches, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        tunekit.speed_up(family_model("llama"), verbose=False, **switches)


# ---- PackingCollator ---------------------------------------------------------------------------------------


def samples(n: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 30, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(0, SHAPE["vocab_size"], (k,), generator=g).tolist()} for k in lengths]


def token_sum(model, batch_: dict) -> torch.Tensor:
    """The summed token loss of a batch (num_items_in_batch=1 turns the mean into the sum)."""
    return model(**batch_, num_items_in_batch=1).loss


def test_packed_batch_gives_each_sample_its_own_loss():
    """Rows of several samples, per-document attention: the summed loss and the gradients of each sample alone."""
    model = tunekit.speed_up(family_model("llama"), verbose=False)
    feats = samples()
    collate = tunekit.PackingCollator(pad_id=0, max_length=64)
    packed = collate(feats)
    assert set(packed) == {"input_ids", "labels", "position_ids"}  # no attention mask: transformers masks per sample
    assert packed["input_ids"].shape[1] == 64 and len(packed["input_ids"]) < len(feats)
    model.zero_grad()
    got = token_sum(model, packed)
    got.backward()
    g_packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    want = sum(token_sum(model, {"input_ids": torch.tensor([f["input_ids"]]),
                                 "labels": torch.tensor([f["input_ids"]])}) for f in feats)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(g_packed[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_collator_masks_the_prompt_and_trains_nothing_across_samples():
    collate = tunekit.PackingCollator(pad_id=0, max_length=16)
    out = collate([{"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]},
                   {"input_ids": [9, 10, 11], "labels": [IGNORE, 10, 11]}])
    assert out["input_ids"].shape == (1, 16)
    row = dict(zip(out["input_ids"][0].tolist(), out["labels"][0].tolist()))
    assert row[5] == row[6] == IGNORE and row[7] == 7 and row[8] == 8  # the prompt is not trained on
    assert row[9] == IGNORE and row[10] == 10  # the first token of a sample is never a target
    assert out["position_ids"][0, :7].tolist() == [0, 1, 2, 3, 0, 1, 2] or \
        out["position_ids"][0, :7].tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert (out["labels"][0, 7:] == IGNORE).all() and out["position_ids"][0, 7] == 0  # padding: its own document


def test_collator_cuts_long_samples_pads_packed_rows_and_names_bad_input():
    collate = tunekit.PackingCollator(pad_id=1, max_length=8)
    out = collate([{"input_ids": list(range(2, 14))}])
    assert out["input_ids"].tolist() == [list(range(2, 10))]
    rows = collate([{"input_ids": [3, 4, 5], "labels": [IGNORE, 4, 5], "position_ids": [0, 1, 2]}])
    assert rows["input_ids"].tolist() == [[3, 4, 5, 1, 1, 1, 1, 1]] and rows["position_ids"][0, 3] == 0
    with pytest.raises(ValueError, match="sample 1 has no 'input_ids'.*text"):
        collate([{"input_ids": [3]}, {"text": "hello"}])
    with pytest.raises(ValueError, match="sample 0 has 2 input_ids but 3 labels"):
        collate([{"input_ids": [3, 4], "labels": [3, 4, 5]}])
    with pytest.raises(ValueError, match="no pad token"):
        tunekit.PackingCollator(pad_id=None)
