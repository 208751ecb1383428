"""Models: from the hub, from a local path, or built offline with random weights, and their adapters.

- `build_model` makes a causal LM from a hub name/path, or a random-init model of any shape: a Llama
  (`llama_config`) or another dense family (`family_config`: Mistral, Qwen2, Qwen3, Gemma 2 and 3, Phi-3). Random
  init happens directly on the target device: a 7B model takes seconds on a GPU, not minutes on a CPU. Speed and
  memory of a random-init model equal those of the real weights; its loss means nothing.
- `refuse_mixture_of_experts`: tunekit's fast paths and estimator are for dense decoders; an MoE model is
  refused when its config is first read (`model_class_of`).
- `apply_lora` attaches LoRA adapters (https://arxiv.org/abs/2106.09685) through peft; only the adapters train.
- `load_quantized` loads NF4 4-bit weights with bitsandbytes for QLoRA (https://arxiv.org/abs/2305.14314).
- `decoder_layers`: the model's decoder blocks, which checkpointing, compiling and FSDP2 each work block by block.
- `save_adapter`, `load_adapter`, `merge_adapter`: what a run leaves and how it is used again.

What comes from a folder or the hub goes through `tunekit/hub.py`: nothing loaded runs code unless asked
(`trust_remote_code=False` unless the caller passes True), and a local folder's weights are checked first.
Tokenizers are `tunekit/data/tokenizer.py`.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import torch

from tunekit import fastlora
from tunekit.attention import choose_attention
from tunekit.families import MODEL_TYPES
from tunekit.hub import WeightsError, check_weights, load_pretrained
from tunekit.io import atomic_output, cache_dir

DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---- local folders and the hub ---------------------------------------------------------------------


# ---- device and dtype ------------------------------------------------------------------------------


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda was asked for, but PyTorch sees no CUDA GPU "
                           "(run `tunekit doctor`). Use --device cpu with --preset tiny.")
    return requested


def resolve_dtype(requested: str, device: str) -> torch.dtype:
    if requested == "auto":
        if device == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return DTYPE[requested]


# ---- tokenizers ------------------------------------------------------------------------------------


# ---- models ----------------------------------------------------------------------------------------


def llama_config(hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int, vocab_size: int,
                 num_kv_heads: int = 0, max_position: int = 4096, head_dim: int = 0, tie_embeddings: bool = False):
    from transformers import LlamaConfig

    # head_dim is passed only when set: unset, LlamaConfig takes hidden / heads itself, and the config (whose JSON
    # keys the random-init cache, `save_random_init`) stays what it always was.
    extra = {"head_dim": head_dim} if head_dim else {}
    return LlamaConfig(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                       num_key_value_heads=num_kv_heads or num_heads, intermediate_size=intermediate_size,
                       vocab_size=vocab_size, max_position_embeddings=max_position, use_cache=False,
                       tie_word_embeddings=tie_embeddings, **extra)


# What is fixed in each family (validation.ARCHS), as its published model's config.json has it; the shape comes from
# the run's config. Only what the step computes differently is set here (soft-capping, sliding windows, the attention
# scale, the MLP's activation): RoPE's base and the token ids change neither its speed nor its memory. What a family's classes build in
# (Qwen2's q/k/v biases, Qwen3's and Gemma 3's q/k norms, Gemma's four norms a block) needs nothing here.
FAMILY_EXTRAS: dict[str, dict] = {
    "llama": {},  # meta-llama/Llama-3.1-8B (llama_config)
    "mistral": {"sliding_window": None},  # mistralai/Mistral-7B-v0.3: full attention (v0.1 had a 4096 window)
    "qwen2": {"use_sliding_window": False},  # Qwen/Qwen2.5-7B
    "qwen3": {"use_sliding_window": False},  # Qwen/Qwen3-8B
    "gemma2": {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh"},  # google/gemma-2-9b
    "gemma3": {"final_logit_softcapping": None, "attn_logit_softcapping": None, "query_pre_attn_scalar": 256,
               "sliding_window": 1024, "hidden_activation": "gelu_pytorch_tanh"},  # google/gemma-3-12b-pt's text_config
    "phi3": {"sliding_window": 2047},  # microsoft/Phi-3-mini-4k-instruct
}


def family_config(arch: str, hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int,
                  vocab_size: int, num_kv_heads: int = 0, head_dim: int = 0, tie_embeddings: bool = False,
                  max_position: int = 4096):
    """The config of a random-init model of family `arch` (one of validation.ARCHS), in transformers' own config class
    (Qwen2Config, Gemma2Config, ...): the shape given plus the family's `FAMILY_EXTRAS`. `llama` is `llama_config`,
    unchanged. `head_dim` 0: hidden_size / num_heads.

    The family's token ids are dropped (None): tunekit's tokenizer numbers its own tokens, and an id of the real
    model's (Phi-3's pad 32000) can lie outside a small vocabulary, where an embedding refuses it."""
    if arch == "llama":
        return llama_config(hidden_size, num_layers, num_heads, intermediate_size, vocab_size, num_kv_heads,
                            max_position, head_dim, tie_embeddings)
    if arch not in FAMILY_EXTRAS:
        raise ValueError(f"arch {arch!r}: unknown model family; choose one of {', '.join(FAMILY_EXTRAS)}")
    from transformers import AutoConfig

    return AutoConfig.for_model(MODEL_TYPES.get(arch, arch), hidden_size=hidden_size, num_hidden_layers=num_layers,
                                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads or num_heads,
                                head_dim=head_dim or hidden_size // num_heads, intermediate_size=intermediate_size,
                                vocab_size=vocab_size, max_position_embeddings=max_position,
                                tie_word_embeddings=tie_embeddings, use_cache=False, pad_token_id=None,
                                bos_token_id=None, eos_token_id=None, **FAMILY_EXTRAS[arch])


# Where transformers' configs keep a mixture-of-experts model's experts a layer: Mixtral's num_local_experts,
# Qwen2-MoE's and Qwen3-MoE's (and OLMoE's) num_experts, DeepSeek-V2/V3's n_routed_experts, DBRX-style
# moe_num_experts.
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def experts_of(config) -> int:
    """Experts a layer of the model `config` describes (its text model's, for a multimodal one); 0 when dense."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    counts = [getattr(text, f, None) for f in EXPERT_FIELDS]
    return max([n for n in counts if isinstance(n, int) and not isinstance(n, bool)] or [0])


def refuse_mixture_of_experts(config, name: str = "") -> None:
    """Refuse a mixture-of-experts model, before anything is built or estimated for it: tunekit's fused LoRA, its
    all-linear targets, block-by-block checkpointing and FSDP2, and its memory estimator each assume every token
    runs through one dense MLP a layer; an MoE model would train slowly or estimate wrong, not fail."""
    if (experts := experts_of(config)) > 1:
        what = name or f"a random-init {config.model_type} model"
        raise ValueError(f"{what}: a mixture-of-experts model ({config.model_type}, {experts} experts a layer). "
                         "tunekit's fast paths (fused LoRA, block-by-block checkpointing and FSDP2) and its memory "
                         "estimator are for dense decoder models. Fine-tune a dense model (e.g. Qwen/Qwen2.5-7B, "
                         "meta-llama/Llama-3.1-8B), or this one with plain transformers + peft.")


# Per block, beyond the seven projection weights and the input and post-attention norms, by model_type: more norms
# of width hidden (Gemma 2 and 3 norm each sublayer's input and output), and q/k norms of width head_dim (Qwen3,
# Gemma 3). Qwen2 biases q, k and v whatever its config says; others where `attention_bias` / `mlp_bias` is set.
EXTRA_NORMS = {"gemma2": 2, "gemma3_text": 2}
QK_NORMS = ("qwen3", "gemma3_text")
QKV_BIAS = ("qwen2",)


def config_shape(config, name: str = "the model") -> dict:
    """The shape of a transformers model config (a multimodal one's text model) in TuneConfig's field names, as the
    estimator's `Setup` takes it: width, layers, heads, KV heads, head width (0: hidden / heads), MLP width,
    vocabulary, whether the LM head is the embedding table, and `layer_extras`, the weights a family adds to each
    block. `name` names the model in errors. A mixture-of-experts model is refused (`refuse_mixture_of_experts`):
    the estimator models dense MLPs. `family_config` is the other way round."""
    text = config.get_text_config()
    refuse_mixture_of_experts(text, name)
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    if missing := [k for k in need if not getattr(text, k, None)]:
        raise ValueError(f"estimating {name}: its config has no {', '.join(missing)} (a "
                         f"{text.model_type} model); the estimator models decoder-only transformers")
    hidden, heads = text.hidden_size, text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    kind = text.model_type
    extras = EXTRA_NORMS.get(kind, 0) * hidden + (2 * head_dim if kind in QK_NORMS else 0)
    if kind in QKV_BIAS:
        extras += q + 2 * kv
    elif getattr(text, "attention_bias", False):
        extras += q + 2 * kv + hidden  # q, k, v and o
    if getattr(text, "mlp_bias", False):
        extras += 2 * text.intermediate_size + hidden
    return {"hidden_size": hidden, "num_layers": text.num_hidden_layers, "num_heads": heads,
            "intermediate_size": text.intermediate_size, "num_kv_heads": kv_heads, "vocab_size": text.vocab_size,
            "head_dim": 0 if head_dim * heads == hidden else head_dim,
            "tie_embeddings": bool(getattr(text, "tie_word_embeddings", False)), "layer_extras": extras}


def causal_lm_class(config):
    """The transformers causal-LM class of a model config (LlamaConfig -> LlamaForCausalLM); None when transformers
    does not know it (a model with code of its own)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


def model_class_of(arch=None, name_or_path: str = "", trust_remote_code: bool = False):
    """The causal-LM class a model would be built as: from `arch`, or from the config of `name_or_path`. The first
    place a run reads its model's config, so a mixture-of-experts model is refused here
    (`refuse_mixture_of_experts`), before any weights load."""
    if not name_or_path:
        if arch is None:
            return None
        refuse_mixture_of_experts(arch)
        return causal_lm_class(arch)
    from transformers import AutoConfig

    config = load_pretrained(AutoConfig, name_or_path, "model", trust_remote_code)
    refuse_mixture_of_experts(config, name_or_path)
    return causal_lm_class(config)


def build_model(arch=None, name_or_path: str = "", dtype: torch.dtype = torch.float32, device: str = "cpu",
                attention: str = "auto", seed: int = 0, trust_remote_code: bool = False):
    """A causal LM: `from_pretrained(name_or_path)` when given, else random init from the config `arch`; `attention`
    as `attention.choose_attention` resolves it for the model's family (`auto`: what the family supports).

    Returned in train mode: `from_pretrained` gives eval mode, in which transformers skips checkpointing."""
    from transformers import AutoModelForCausalLM

    attention = choose_attention(attention, device, model_class=model_class_of(arch, name_or_path,
                                                                              trust_remote_code))[0]
    if name_or_path:
        check_weights(name_or_path)
        model = load_pretrained(AutoModelForCausalLM, name_or_path, "model", trust_remote_code, dtype=dtype,
                                attn_implementation=attention, device_map={"": device})
    else:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(arch, dtype=dtype, attn_implementation=attention)
    model.config.use_cache = False
    return model.train()


def save_random_init(arch, dtype: torch.dtype, seed: int = 0) -> Path:
    """Build a random-init model once and save it (cached by shape and seed), for paths that need a
    checkpoint on disk — a 4-bit load quantizes while loading. About a minute for 7B."""
    key = hashlib.sha256(f"{arch.to_json_string()}|{dtype}|{seed}".encode()).hexdigest()[:16]
    folder = cache_dir() / "models" / key
    if (folder / "config.json").exists():
        return folder
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(arch, dtype=dtype, device=device, seed=seed)
    with atomic_output(folder, keep_existing=True) as tmp:
        model.save_pretrained(tmp)
        if not (tmp / "config.json").exists():  # never cache a folder that cannot be loaded
            raise RuntimeError(f"saving the random-init model wrote no config.json into {tmp}; under torchrun only "
                               "rank 0 may save it")
    del model
    return folder


def require_cuda_for_4bit(device: str) -> None:
    if device != "cuda":
        raise RuntimeError("method=qlora needs a CUDA GPU: bitsandbytes 4-bit kernels run on GPUs only. "
                           "Use --method lora (or full) on CPU.")


def load_quantized(name_or_path: str, device: str = "cuda", attention: str = "auto",
                   compute_dtype: torch.dtype = torch.bfloat16, trust_remote_code: bool = False):
    """NF4 weights with double quantization and bf16 compute, as the QLoRA paper does.

    The packed weights are stored as bf16 tensors (`bnb_4bit_quant_storage`) so FSDP can shard them
    alongside the rest of the model."""
    require_cuda_for_4bit(device)
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise RuntimeError("method=qlora needs bitsandbytes: pip install -e '.[gpu]' in your clone of tunekit "
                           "(or pip install bitsandbytes).") from None
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=compute_dtype)
    check_weights(name_or_path)
    attention = choose_attention(attention, device, model_class=model_class_of(None, name_or_path,
                                                                              trust_remote_code))[0]
    model = load_pretrained(AutoModelForCausalLM, name_or_path, "model", trust_remote_code,
                            quantization_config=quant, dtype=compute_dtype, attn_implementation=attention,
                            device_map={"": device})
    model.config.use_cache = False
    for p in model.parameters():
        p.requires_grad_(False)
    return model.train()


def apply_lora(model, r: int = 16, alpha: int = 32, dropout: float = 0.0, targets: str = "all-linear",
               cast_input: bool = True):
    """Freeze the base model and add LoRA adapters to `targets` (every linear layer but the LM head by
    default). Adapter weights are kept in fp32 (peft's default) while the base may be bf16 or 4-bit.

    `cast_input=False` stops peft casting each adapter's input to fp32: under bf16 autocast the input is
    cast straight back, so the numbers are unchanged, but each cast makes a copy that autograd keeps
    (8 bytes a token per hidden unit per layer for all-linear; tests/unit/test_memory.py measures it)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    target = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target,
                        task_type="CAUSAL_LM", bias="none")
    with warnings.catch_warnings():  # peft reads a property that transformers 5 deprecated; not ours to fix
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(model, config)
    if not cast_input:  # what peft.helpers.disable_input_dtype_casting does, for good rather than in a `with`
        for module in model.modules():
            if isinstance(module, BaseTunerLayer):
                module.cast_input_dtype_enabled = False
    return model


def base_model(model):
    """The transformers model itself: under a PEFT wrapper, the model it wraps."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total). 4-bit weights are packed two to a byte; count the weights they stand for."""
    trainable = total = 0
    for p in model.parameters():
        n = p.numel()
        if hasattr(p, "quant_state"):
            n = p.quant_state.shape.numel() if hasattr(p.quant_state, "shape") else n * 2
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


def save_adapter(model, path: str | os.PathLike, state_dict: dict | None = None) -> Path:
    """Save a PEFT adapter (adapter_config.json + adapter_model.safetensors) atomically; given a plain
    model, save the whole model the same way. `state_dict`: the weights to write instead of the model's own
    (gathered whole from an FSDP2-sharded model, `distributed.full_trainable`)."""
    with atomic_output(path) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict)
    return Path(path)


def cast_weights(model, dtype: torch.dtype):
    """`model` with its parameters in `dtype` and its buffers as they were: `model.to(dtype)` would also cast
    RoPE's fp32 frequencies, shifting every position (a bf16 model then differs from the same weights loaded
    with `from_pretrained`)."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def merge_adapter(model, out_dir: str | os.PathLike | None = None, dtype: torch.dtype = torch.bfloat16):
    """Fold LoRA updates into the base weights (W + B @ A * alpha / r) and return a plain model in `dtype`,
    for export or fast inference; with `out_dir`, also save it there atomically (from_pretrained-ready).

    A 4-bit base cannot absorb the update exactly: reload the base in bf16 and `load_adapter` first."""
    if any(hasattr(p, "quant_state") for p in model.parameters()):
        raise ValueError("merge_adapter: the base model is 4-bit; load it in bf16 (build_model / from_pretrained "
                         "without quantization), attach the adapter with load_adapter, then merge.")

    fastlora.detach(model)  # grouped layers' weights share one tensor: each its own again, so each saves once
    merged = cast_weights(model.merge_and_unload(), dtype)
    if out_dir is not None:
        save_adapter(merged, out_dir)
    return merged


def load_adapter(base_model, path: str | os.PathLike, trainable: bool = False):
    """Attach a saved LoRA adapter (the PEFT folder `save_adapter` writes) to `base_model`. Its weights are
    checked first (`check_weights`: a truncated safetensors file or a pickled `adapter_model.bin` that is more
    than tensors is a WeightsError naming it). Only LoRA adapters, the kind tunekit writes, are read: other PEFT
    types load tokenizers and models of their own, which could bring code. No `trust_remote_code` is passed:
    a LoRA folder is weights and JSON, and peft runs nothing from it."""
    import json

    from peft import PeftModel

    config = Path(path) / "adapter_config.json"
    try:
        kind = json.loads(config.read_text()).get("peft_type")
    except FileNotFoundError:
        raise FileNotFoundError(f"{config} is missing: {path} is not a saved adapter") from None
    except (ValueError, AttributeError) as e:
        raise WeightsError(f"{config} is unreadable ({type(e).__name__}: {e}); save the adapter again") from None
    if kind != "LORA":
        raise WeightsError(f"{config}: peft_type {kind!r}; tunekit loads LoRA adapters only (peft_type 'LORA')")
    check_weights(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return PeftModel.from_pretrained(base_model, str(path), is_trainable=trainable)


def decoder_layers(model) -> list[torch.nn.Module]:
    base = base_model(model)
    layers = getattr(getattr(base, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(base).__name__} has no model.layers: FSDP2 wraps each decoder block")
    return list(layers)
