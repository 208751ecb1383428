"""Random-init models of each family (config field `arch`) and the presets at each family's real 7-9B shape:
the transformers class and shape each builds, Llama's config unchanged, the estimator reading the same config
(head width, tied table, a family's block weights), and mixture-of-experts models refused. Configs only, or
tiny models: seconds."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from tunekit import estimate
from tunekit import model as mdl
from tunekit.build import build_base_model, build_training, resolve_runtime, run_arch
from tunekit.config import ConfigError
from tunekit.presets import GPU_PRESETS, get_preset, llama7b_lora, llama7b_qlora, tiny
from tunekit.step import train_step
from tunekit.validation import ARCHS

# Tiny shapes of every family; head_dim 24 is not hidden / heads (16), as Gemma-2-9B's 256 is not 3584 / 16.
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
        "vocab_size": 300}
CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
           "phi3": "Phi3ForCausalLM"}


def test_every_family_has_its_class():
    assert set(CLASSES) == set(ARCHS)


def test_every_arch_a_preset_can_build_is_a_family_the_matrix_tests():
    # --arch builds what the README's families table lists, and nothing the matrix does not check
    from tunekit.families import FAMILIES
    from tunekit.model import FAMILY_EXTRAS

    assert {f.arch for f in FAMILIES.values()} == set(ARCHS) == set(FAMILY_EXTRAS)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head_dim, tied", [(0, False), (24, True)])
def test_each_arch_builds_its_class_of_the_config_s_shape(arch, head_dim, tied):
    cfg = tiny(arch=arch, head_dim=head_dim, tie_embeddings=tied, **TINY)
    config = run_arch(cfg, 999)  # the config's vocab_size wins over the tokenizer's
    model = mdl.build_model(config, seed=0)
    assert type(model).__name__ == CLASSES[arch] == mdl.model_class_of(config).__name__
    d = head_dim or 16
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size,
            c.vocab_size, c.head_dim, c.use_cache) == (64, 2, 4, 2, 128, 300, d, False)
    attn = model.model.layers[0].self_attn
    if arch == "phi3":  # q, k and v as one projection
        assert attn.qkv_proj.weight.shape == ((4 + 2 * 2) * d, 64)
    else:
        assert (attn.q_proj.weight.shape, attn.k_proj.weight.shape) == ((4 * d, 64), (2 * d, 64))
    assert attn.o_proj.weight.shape == (64, 4 * d)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head_dim, tied", [(0, False), (24, True)])
def test_the_estimate_counts_the_built_model_s_parameters(arch, head_dim, tied):
    """The estimator reads the config random init builds: its weights (bf16, 2 bytes each) are the built model's
    parameters, q/k/v biases, q/k norms, Gemma's extra norms, wide heads and a tied table included."""
    cfg = tiny(arch=arch, head_dim=head_dim, tie_embeddings=tied, **TINY)
    model = mdl.build_model(run_arch(cfg, 300), seed=0)
    params = sum(p.numel() for p in model.parameters())  # a tied table once
    setup = estimate.Setup.of(cfg)
    assert (setup.head_dim, setup.tie_embeddings) == (head_dim, tied)
    assert estimate.parameter_count(setup) == params
    assert estimate.estimate_memory_for(setup)["weights"] == 2 * params


def test_a_tiny_gemma2_of_wide_heads_and_a_tied_table_estimates_as_built():
    """Gemma-2's shape in small: heads of 32 (not 64 / 4), one table; the weights the estimator counts are the
    model's, and its LoRA adapters are the ones peft adds (q/k/v/o of heads x head_dim)."""
    cfg = tiny(arch="gemma2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
               intermediate_size=128, vocab_size=256, tie_embeddings=True, lora_r=4)
    model = mdl.build_model(run_arch(cfg, 256), seed=0)
    params = sum(p.numel() for p in model.parameters())
    est = estimate.estimate_memory_for(estimate.Setup.of(cfg))
    assert est["weights"] == 2 * params
    lora = mdl.apply_lora(model, r=4, alpha=8)
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert est["lora"] == 4 * adapters  # fp32


def test_a_tied_table_stays_on_the_gpu_under_embed_offload():
    """memory.offload_embeddings leaves a tied table where it is (the LM head holds it): nothing is freed."""
    gemma = estimate.Setup.of(get_preset("gemma2_9b_lora"))
    assert estimate.estimate_memory_for(gemma.but(embed_offload=True))["weights"] == \
        estimate.estimate_memory_for(gemma)["weights"]
    qwen = estimate.Setup.of(get_preset("qwen25_7b_lora"))
    freed = estimate.estimate_memory_for(qwen)["weights"] - estimate.estimate_memory_for(
        qwen.but(embed_offload=True))["weights"]
    assert freed == 2 * 2 * 152064 * 3584  # two bf16 tables


def test_llama_arch_gives_the_config_of_before():
    """arch llama (the default) builds exactly the LlamaConfig run_arch built before families existed: the same
    JSON, which also keys the random-init cache (`save_random_init`)."""
    def before(cfg, vocab):
        return transformers.LlamaConfig(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                                        num_attention_heads=cfg.num_heads,
                                        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
                                        intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size or vocab,
                                        max_position_embeddings=max(cfg.max_length, 2048), use_cache=False,
                                        tie_word_embeddings=False)

    for cfg in (tiny(), tiny(num_kv_heads=2), llama7b_lora(), llama7b_qlora(max_length=4096)):
        assert cfg.arch == "llama"
        assert run_arch(cfg, 1000).to_json_string() == before(cfg, 1000).to_json_string()
    # a result file's config dict from before `arch` existed estimates as the Llama it was
    old = {k: v for k, v in llama7b_lora().__dict__.items() if k not in ("arch", "head_dim", "tie_embeddings")}
    assert estimate.estimate_memory_for(estimate.Setup.of(old)) == estimate.estimate_memory_for(
        estimate.Setup.of(llama7b_lora()))


# Each preset's published shape: hidden, layers, heads, KV heads, head width, MLP width, vocabulary, tied, and the
# parameter count the model card gives (from each model's config.json on the hub, named in presets.py).
PUBLISHED = {
    "llama3_8b_lora": ("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 8.03e9),
    "qwen25_7b_lora": ("qwen2", 3584, 28, 28, 4, 128, 18944, 152064, False, 7.62e9),
    "qwen25_7b_qlora": ("qwen2", 3584, 28, 28, 4, 128, 18944, 152064, False, 7.62e9),
    "qwen3_8b_lora": ("qwen3", 4096, 36, 32, 8, 128, 12288, 151936, False, 8.19e9),
    "mistral7b_lora": ("mistral", 4096, 32, 32, 8, 128, 14336, 32768, False, 7.25e9),
    "gemma2_9b_lora": ("gemma2", 3584, 42, 16, 8, 256, 14336, 256000, True, 9.24e9),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_family_presets_have_the_published_shape(name):
    arch, hidden, layers, heads, kv, head_dim, inter, vocab, tied, billions = PUBLISHED[name]
    cfg = get_preset(name)
    cfg.validate()
    assert name in GPU_PRESETS and cfg.model == "" and cfg.arch == arch
    c = run_arch(cfg, cfg.tokenizer_vocab)
    assert type(c).__name__ == CLASSES[arch].replace("ForCausalLM", "Config")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == (hidden, layers, heads, kv, head_dim, inter,
                                                                           vocab, tied)
    assert estimate.parameter_count(estimate.Setup.of(cfg)) == pytest.approx(billions, rel=0.002)
    # the offline tokenizer fits the real vocabulary (build_base_model refuses one larger than vocab_size)
    assert 264 <= cfg.tokenizer_vocab <= cfg.vocab_size
    ref = llama7b_qlora() if cfg.method == "qlora" else llama7b_lora()
    for f in ("method", "max_length", "batch_size", "grad_ckpt", "lr", "lora_r", "data", "tokenizer_vocab"):
        assert getattr(cfg, f) == getattr(ref, f), f


def test_family_extras_are_the_real_model_s():
    gemma = run_arch(get_preset("gemma2_9b_lora"), 32000)
    assert (gemma.final_logit_softcapping, gemma.attn_logit_softcapping, gemma.query_pre_attn_scalar,
            gemma.sliding_window, gemma.hidden_activation) == (30.0, 50.0, 256, 4096, "gelu_pytorch_tanh")
    assert gemma.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert run_arch(get_preset("mistral7b_lora"), 32000).sliding_window is None  # v0.3: full attention
    assert not run_arch(get_preset("qwen25_7b_lora"), 32000).use_sliding_window


def test_gemma2_takes_eager_attention_on_the_cpu():
    """Gemma 2 has no SDPA path: build_base_model asks choose_attention with the family's class, not Llama's."""
    cfg = tiny(arch="gemma2", **TINY)
    model, why = build_base_model(cfg, 300, "cpu", torch.float32)
    assert model.config._attn_implementation == "eager" and "Gemma2ForCausalLM has no sdpa path" in why
    model, why = build_base_model(tiny(arch="qwen2", **TINY), 300, "cpu", torch.float32)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("arch", ARCHS)
def test_each_family_trains_a_lora_step(arch):
    """Each family through build_training (LoRA, the chunked loss: Gemma 2's soft-capped logits included)."""
    cfg = tiny(arch=arch, **TINY)
    model, optimizer, scheduler, options = build_training(cfg, 300, "cpu", torch.float32, 5, verbose=False)
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    stats = train_step(model, [batch], optimizer, scheduler, cfg.max_grad_norm, **options)
    assert math.isfinite(stats["loss"]) and stats["loss"] > 0


def test_a_gpu_preset_on_the_cpu_names_its_size_and_family():
    with pytest.raises(RuntimeError, match=r"'gemma2_9b_lora' builds a 9\.2B-parameter gemma2 model"):
        resolve_runtime(get_preset("gemma2_9b_lora", device="cpu"))
    with pytest.raises(RuntimeError, match=r"'llama7b_lora' builds a 6\.7B-parameter llama model"):
        resolve_runtime(get_preset("llama7b_lora", device="cpu"))


def test_arch_and_head_dim_are_checked():
    with pytest.raises(ConfigError, match="'arch' = 'gpt2': choose one of llama, mistral, qwen2, qwen3, gemma2, "
                                          "gemma3, phi3"):
        tiny(arch="gpt2")
    with pytest.raises(ConfigError, match="'head_dim' = -1"):
        tiny(head_dim=-1)
    with pytest.raises(ConfigError, match="divisible by num_heads"):
        tiny(hidden_size=100, num_heads=8)
    assert tiny(hidden_size=100, num_heads=8, head_dim=16).head_dim == 16  # heads of their own width


# ---- mixture-of-experts models are refused --------------------------------------------------------------------

MOE = {
    "mixtral": lambda: transformers.MixtralConfig(num_local_experts=8, **_small()),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(num_experts=4, **_small()),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(num_experts=4, **_small()),
}


def _small() -> dict:
    return {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": 300}


@pytest.mark.parametrize("kind", MOE)
def test_mixture_of_experts_is_refused_when_its_config_is_read(kind, tmp_path):
    folder = tmp_path / f"tiny-{kind}"
    MOE[kind]().save_pretrained(folder)  # a config alone: refused before any weights are looked for
    message = rf"{folder}: a mixture-of-experts model \({kind}, \d experts a layer\).*dense decoder models.*" \
              r"plain transformers \+ peft"
    with pytest.raises(ValueError, match=message):
        mdl.model_class_of(None, str(folder))
    with pytest.raises(ValueError, match=message):
        build_base_model(tiny(model=str(folder)), 300, "cpu", torch.float32)
    with pytest.raises(ValueError, match=rf"{folder}'?: a mixture-of-experts model"):
        estimate.Setup.of(get_preset("llama7b_lora", model=str(folder)))


def test_dense_configs_are_not_mixtures():
    for arch in ARCHS:
        assert mdl.experts_of(run_arch(tiny(arch=arch, **TINY), 300)) == 0
    assert mdl.experts_of(transformers.MixtralConfig(num_local_experts=1, **_small())) == 1  # one expert: dense
    mdl.refuse_mixture_of_experts(transformers.MixtralConfig(num_local_experts=1, **_small()), "x")
