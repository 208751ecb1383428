"""Models and tokenizers: from the hub, from a local path, or built offline with random weights.

- `build_model` makes a causal LM from a hub name/path, or a random-init Llama of any shape. Random init
  happens directly on the target device: a 7B model takes seconds on a GPU, not minutes on a CPU. Speed and
  memory of a random-init model equal those of the real weights; its loss means nothing.
- `train_tokenizer` trains a byte-level BPE (https://huggingface.co/docs/tokenizers) on the training text and
  caches it, so everything runs with no hub at all.
- `apply_lora` attaches LoRA adapters (https://arxiv.org/abs/2106.09685) through peft; only the adapters train.
- `load_quantized` loads NF4 4-bit weights with bitsandbytes for QLoRA (https://arxiv.org/abs/2305.14314).
- `load_pretrained` / `load_from_hub`: a local folder that is not there is said to be so (not taken for a hub
  name); a hub name fails within seconds when the hub is offline (`HF_HUB_OFFLINE=1`) or does not answer and
  the local cache lacks it, where the hub libraries retry for 25-50 s. A cached copy is used then, saying so.

Nothing loaded runs code unless asked: every `from_pretrained` gets `trust_remote_code=False` unless the caller
passes True (`tunekit train --trust-remote-code true`), so a model's own Python, named in its `auto_map`,
never runs on a keypress at transformers' prompt; and a local folder's weights are checked first
(`check_weights`): safetensors whole, a pickled `.bin` loadable with `weights_only=True`, a damaged or crafted
file named in one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from tunekit.checkpoint import atomic_output
from tunekit.config import cache_dir

DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
# A hub repo id, as huggingface_hub validates it: `name` or `organisation/name`, word characters, '-' and '.'.
HUB_NAME = re.compile(r"^(?:\w[\w.-]*\w/|\w/)?(?:\w[\w.-]*\w|\w)$")
HUB_EXAMPLES = "a hub name such as 'meta-llama/Llama-2-7b-hf' (organisation/name) or 'gpt2'"
HUB_TIMEOUT_S = 5.0  # a reachable hub answers one request in well under a second


class HubError(ConnectionError):
    """The hub is offline or unreachable and the local cache lacks what was asked for; says what to do."""


class WeightsError(ValueError):
    """A weights file is truncated, corrupt, or a pickle that could run code; the message names it."""


# ---- local folders and the hub ---------------------------------------------------------------------


def is_local(name_or_path: str, kind: str = "model") -> bool:
    """True for a local folder, False for a hub name; for a path that is not there (or is a file), an error
    saying so and what a hub name looks like, rather than the hub library's complaint about repo ids."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return True
    if path.exists():
        raise FileNotFoundError(f"{kind} {name_or_path!r} is a file; give the folder that holds it "
                                "(with config.json, as save_pretrained writes it).")
    if HUB_NAME.match(name_or_path) and "--" not in name_or_path and ".." not in name_or_path:
        return False
    raise FileNotFoundError(f"{kind} {name_or_path!r}: no such local folder ({path.absolute()}). Give a folder "
                            f"that holds a saved {kind} (as save_pretrained writes it), or {HUB_EXAMPLES}.")


def hub_offline_requested() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE) set to a true value, read now."""
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    return any(os.environ.get(n, "").strip().lower() in ("1", "true", "yes", "on") for n in names)


def hub_unreachable(timeout: float = HUB_TIMEOUT_S) -> str | None:
    """None when the hub ($HF_ENDPOINT, default huggingface.co) answers a request within `timeout` seconds,
    else why not. One request, in a thread so that a hanging DNS lookup (which a socket timeout does not
    bound) is bounded too; proxies come from the environment, as for the hub libraries."""
    import ssl
    import urllib.error
    import urllib.request

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    answer: list[str | None] = []

    def ask() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
            answer.append(None)
        except urllib.error.HTTPError:  # an HTTP status is an answer
            answer.append(None)
        except urllib.error.URLError as e:  # a TLS complaint is an answer too: the libraries have their own setup
            answer.append(None if isinstance(e.reason, ssl.SSLError) else f"{endpoint} cannot be reached ({e.reason})")
        except ssl.SSLError:
            answer.append(None)
        except (OSError, ValueError) as e:
            answer.append(f"{endpoint} cannot be reached ({e})")

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout)
    return answer[0] if answer else f"{endpoint} did not answer within {timeout:g} s"


@contextlib.contextmanager
def hub_offline():
    """huggingface_hub, transformers and datasets in offline mode inside the block (the cache only, no
    request); the mode they had after it. They read HF_HUB_OFFLINE once, at import."""
    import datasets.config
    import huggingface_hub.constants as hub

    old = hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = old


def load_from_hub(load: Callable, name: str, kind: str = "model"):
    """`load()`, which fetches `name` from the hub. When HF_HUB_OFFLINE is set or the hub does not answer within
    HUB_TIMEOUT_S, `load()` runs offline: from the local cache, saying so, or a HubError in seconds saying
    what to do, instead of the libraries' minute of retries."""
    why = "HF_HUB_OFFLINE is set" if hub_offline_requested() else hub_unreachable()
    if why is None:
        return load()
    with hub_offline():
        try:
            loaded = load()
        except OSError as e:  # ConnectionError, FileNotFoundError, transformers' OSError: not in the cache
            import huggingface_hub.constants as hub

            local = "" if "/" in name else f" (and there is no local folder {name!r})"
            todo = ("pass --data a local JSONL/JSON/parquet file, or a save_to_disk folder" if kind == "dataset"
                    else f"pass a local folder that holds the {kind} (as save_pretrained writes it)")
            raise HubError(f"{kind} {name!r}: {why}, and the local hub cache ({hub.HF_HUB_CACHE}) has no copy"
                           f"{local}. Run once where the hub is reachable to cache it, or {todo}. "
                           f"({type(e).__name__})") from None
    if not hub_offline_requested():
        print(f"{kind} {name!r}: {why}; using the copy in the local cache", file=sys.stderr)
    return loaded


def load_pretrained(loader, name_or_path: str, kind: str = "model", trust_remote_code: bool = False, **kwargs):
    """`loader.from_pretrained(name_or_path, trust_remote_code=..., **kwargs)` for a local folder or a hub name,
    with the errors of `is_local` and `load_from_hub`. Code that comes with the model runs only with
    `trust_remote_code`; without it, a model that needs such code is a one-line error."""

    def load():
        try:
            return loader.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **kwargs)
        except ValueError as e:
            if trust_remote_code or "trust_remote_code" not in str(e):
                raise
            raise ValueError(f"{kind} {name_or_path!r} comes with its own Python code (named in its config's "
                             "auto_map), which tunekit does not run unless asked: read that code, then pass "
                             "--trust-remote-code true") from None

    if is_local(name_or_path, kind):
        return load()
    return load_from_hub(load, name_or_path, kind)


# What transformers and peft read from a folder: the safetensors file (or its shards) when there, else the pickle.
WEIGHT_FILES = (("model.safetensors", "pytorch_model.bin"), ("adapter_model.safetensors", "adapter_model.bin"))


def check_weights(folder: str | os.PathLike) -> None:
    """Check the weights files transformers or peft would read from `folder`, before they do: each safetensors
    file's header must cover the file (a truncated copy fails here), and a pickled `.bin` (read when no
    safetensors is there) must load with `weights_only=True`, so it holds tensors only and runs no code.
    A WeightsError (a ValueError) names the file and what is wrong."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():  # a hub name (or a missing folder, which `is_local` explains)
        return
    for names in WEIGHT_FILES:
        for name in names:
            if files := _weight_files(folder / name):
                for f in files:
                    _check_weights_file(f)
                break  # the safetensors are read, not the .bin beside them


def _weight_files(single: Path) -> list[Path]:
    """`single` if it is there, else the shards its `.index.json` lists, else []."""
    if single.is_file():
        return [single]
    index = single.with_name(single.name + ".index.json")
    if not index.is_file():
        return []
    import json

    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightsError(f"{index} is unreadable ({type(e).__name__}: {e}); copy the model folder again") from None
    return [single.with_name(Path(s).name) for s in shards]


def _check_weights_file(path: Path) -> None:
    if not path.is_file():
        raise WeightsError(f"{path} is missing (its index names it); copy the model folder again")
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as e:  # noqa: BLE001 - safetensors' errors: SafetensorError, OSError, ...
            raise WeightsError(f"{path} is truncated or corrupt ({_first_line(e)}); save or copy it again") from None
        return
    import pickle

    try:
        torch.load(path, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise WeightsError(f"{path} is truncated or corrupt ({_first_line(e)}); save or copy it again") from None
        called = re.search(r"GLOBAL ([\w.]+)", str(e))
        raise WeightsError(f"refusing {path}: a pickle that holds more than tensors, and loading it could run code"
                           f"{f' (it calls {called[1]})' if called else ''}. Use weights you trust, saved as "
                           "safetensors.") from None
    except Exception as e:  # noqa: BLE001 - torch.load fails in many ways on a damaged file
        raise WeightsError(f"{path} is truncated or corrupt ({_first_line(e)}); save or copy it again") from None


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


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


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """A tokenizer from the hub or a local folder; gets a pad token if it has none (Llama has none)."""
    from transformers import AutoTokenizer

    tok = load_pretrained(AutoTokenizer, name_or_path, "model or tokenizer", trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int, cache: Path | None = None):
    """Train a byte-level BPE on `texts`, or load it from the cache when the same texts and size were seen.

    Byte-level means every string encodes (no unknown token), as with GPT-2 and Llama-3 tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(texts)
    digest = hashlib.sha256(f"bpe-v1|{vocab_size}|".encode())
    for t in texts:
        digest.update(t.encode())
        digest.update(b"\0")
    folder = (cache or cache_dir() / "tokenizers") / digest.hexdigest()[:16]
    if (folder / "tokenizer.json").exists():
        return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                       bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(texts, trainer=trainer)
    with atomic_output(folder, keep_existing=True) as tmp:  # another process may cache it first
        tmp.mkdir()
        tk.save(str(tmp / "tokenizer.json"))
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                   bos_token=BOS, eos_token=EOS, pad_token=PAD)


# ---- models ----------------------------------------------------------------------------------------


def llama_config(hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int, vocab_size: int,
                 num_kv_heads: int = 0, max_position: int = 4096):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                       num_key_value_heads=num_kv_heads or num_heads, intermediate_size=intermediate_size,
                       vocab_size=vocab_size, max_position_embeddings=max_position, use_cache=False,
                       tie_word_embeddings=False)


def build_model(arch=None, name_or_path: str = "", dtype: torch.dtype = torch.float32, device: str = "cpu",
                attention: str = "sdpa", seed: int = 0, trust_remote_code: bool = False):
    """A causal LM: `from_pretrained(name_or_path)` when given, else random init from the config `arch`.

    Returned in train mode: `from_pretrained` gives eval mode, in which transformers skips checkpointing."""
    from transformers import AutoModelForCausalLM

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


def load_quantized(name_or_path: str, device: str = "cuda", attention: str = "sdpa",
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
    (8 bytes a token per hidden unit per layer for all-linear; tests/test_memory.py measures it)."""
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
    from tunekit import fastlora

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
