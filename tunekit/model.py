"""Models: from the hub, from a local path, or built offline with random weights, and their adapters.

- `build_model` makes a causal LM from a hub name/path, or a random-init Llama of any shape. Random init
  happens directly on the target device: a 7B model takes seconds on a GPU, not minutes on a CPU. Speed and
  memory of a random-init model equal those of the real weights; its loss means nothing.
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
                 num_kv_heads: int = 0, max_position: int = 4096):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                       num_key_value_heads=num_kv_heads or num_heads, intermediate_size=intermediate_size,
                       vocab_size=vocab_size, max_position_embeddings=max_position, use_cache=False,
                       tie_word_embeddings=False)


def causal_lm_class(config):
    """The transformers causal-LM class of a model config (LlamaConfig -> LlamaForCausalLM); None when transformers
    does not know it (a model with code of its own)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


def model_class_of(arch=None, name_or_path: str = "", trust_remote_code: bool = False):
    """The causal-LM class a model would be built as: from `arch`, or from the config of `name_or_path`."""
    if not name_or_path:
        return causal_lm_class(arch) if arch is not None else None
    from transformers import AutoConfig

    return causal_lm_class(load_pretrained(AutoConfig, name_or_path, "model", trust_remote_code))


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
