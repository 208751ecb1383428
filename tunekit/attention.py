"""Choosing the attention kernel: use the fastest one that is installed, and say which and why.

Two choices are made, at two levels.

**Which implementation transformers calls** (`attention` in the config, `choose_attention`):

- `flash_attention_2`: the flash-attn package (https://github.com/Dao-AILab/flash-attention); fastest for
  padded and packed (varlen) batches where it builds. It compiles from source on most torch/CUDA pairs, and
  the H200 image has no build of it, so nothing may depend on it.
- `sdpa`: `torch.nn.functional.scaled_dot_product_attention`, which dispatches to one of its own kernels
  (below). Always present; the default.
- `flex_attention`: `torch.nn.attention.flex_attention`, compiled by `torch.compile` into a Triton kernel
  for any mask written as a Python function. Its use here is packed rows: it skips the blocks a
  document mask rules out, where SDPA with a dense mask must fall back to a slower kernel. `auto` picks it
  for packed rows on CUDA when flash-attn is missing (measured 1.11x SDPA in the 7B step on the H200).
- `eager`: the plain softmax(QK^T)V in PyTorch (`bench.ops.eager_attention`) — the reference every other backend
  is tested against. It stores the full S×S score matrix per head, so it is slow and memory-hungry.

**Which kernel SDPA runs** (`sdpa_backend` in the config, `sdpa_backends` and `sdpa_context`). SDPA tries its
backends in a priority order and takes the first whose constraints the inputs meet (dtype, head size, mask,
GPU architecture); `torch.nn.attention.sdpa_kernel` restricts and reorders them
(https://pytorch.org/docs/stable/generated/torch.nn.attention.sdpa_kernel.html):

- `cudnn`: NVIDIA's fused attention in cuDNN 9 (CUDA only).
- `flash`: PyTorch's own copy of FlashAttention-2 (fp16/bf16 on sm80+; PyTorch also has a CPU flash kernel).
- `efficient`: the memory-efficient kernel from xFormers (CUDA only); it also takes arbitrary masks.
- `math`: the unfused composite of matmuls and softmax; runs anywhere, as slow as eager.

PyTorch's own choice, with no order given, follows a priority list in its C++ that has moved between versions
and depends on the GPU: on the H200 image (torch 2.11, cuDNN 9.19) SDPA picked cuDNN's kernel for the 7B shape,
on this project's CPU build flash. `default_sdpa_kernel` says which it picks here, at given shapes. The project measured
the four on one Hopper GPU, an H200 (`bench.ops.benchmark_attention`, causal forward + backward at B8 H32 S2048 D128 in
bf16; notebooks/results/l2_attention_ops.json): there cuDNN's kernel was the fastest of them, and
`test_attention.py` checks that `HOPPER_ORDER` still follows that file. So `auto` puts cuDNN first on sm90+
and keeps the rest as fallbacks; elsewhere it leaves PyTorch's order alone, since we have measured nothing
there. `bench.ops.benchmark_attention` re-measures all of them on your GPU at your shapes.

The order must hold in backward too: gradient checkpointing re-runs the forward (and so picks a kernel again)
during backward, so `sdpa_context` wraps both. Entering it costs microseconds (a few flag writes).
Feature detection, not version checks: we try the import, and probe a kernel by running it once.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
HOPPER_ORDER = ["cudnn", "flash", "efficient", "math"]  # fastest first, as measured in ATTENTION_OPS_RESULT
ATTENTION_OPS_RESULT = "notebooks/results/l2_attention_ops.json"  # the op benchmark, run on an H200
CUDA_ONLY = (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)  # CPU has only flash and math


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _kind(device: str) -> str:
    return str(device).split(":")[0]


def supported(model_class) -> set[str]:
    """The attention implementations a transformers model class takes (its `_supports_*` flags; eager always).
    None (a class not known here, remote code): all of them, and transformers says if one is not."""
    if model_class is None:
        return {"eager", "sdpa", "flex_attention", "flash_attention_2"}
    flags = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn", "flash_attention_2": "_supports_flash_attn"}
    return {"eager", *(name for name, flag in flags.items() if getattr(model_class, flag, False))}


def choose_attention(requested: str, device: str, packed: bool = False, model_class=None) -> tuple[str, str]:
    """Return (implementation name for transformers, one-line reason), for `model_class` (a transformers causal LM
    class; None: any) — `auto` takes what that family supports, fastest first (Gemma 2 has no SDPA path: FlexAttention
    on a GPU, eager on a CPU); asked outright, an implementation the family lacks is an error that says what to use.

    `packed` (rows holding several samples, `packing=pack`): without flash-attn, `auto` takes FlexAttention on
    CUDA, which skips the blocks the document mask rules out; in the 7B LoRA step on the H200 it ran at
    1.11x SDPA with the dense mask (notebooks/results/l2_packed_flex.json vs l2_packed_sdpa.json). The
    first step compiles its kernel (torch.compile), once per row length.
    """
    ok = supported(model_class)
    if requested != "auto" and requested not in ok:
        raise RuntimeError(f"attention={requested}: {model_class.__name__} has no {requested} path in transformers; "
                           f"use --attention auto (it picks among {', '.join(sorted(ok))})")
    name, why = _choose(requested, device, packed)
    if name in ok:
        return name, why
    cuda = _kind(device) == "cuda"
    order = [*(["flash_attention_2"] if cuda and flash_attn_available() else []), *(["flex_attention"] if cuda else []),
             "sdpa", "eager"]  # flex has no backward on a CPU
    alt = next(a for a in order if a in ok)
    return alt, f"auto: {alt}, as {model_class.__name__} has no {name} path"


def _choose(requested: str, device: str, packed: bool) -> tuple[str, str]:
    if requested == "auto":
        if _kind(device) == "cuda" and flash_attn_available():
            return "flash_attention_2", "auto: flash-attn is installed"
        if packed and _kind(device) == "cuda":
            return "flex_attention", ("auto: FlexAttention for packed rows (flash-attn not installed; it skips "
                                      "masked blocks, and beat SDPA with a document mask in the 7B step measured "
                                      "on an H200: notebooks/results/l2_packed_flex.json vs l2_packed_sdpa.json)")
        why = "flash-attn not installed" if _kind(device) == "cuda" else "CPU"
        return "sdpa", f"auto: PyTorch SDPA ({why})"
    if requested == "flash_attention_2":
        if not flash_attn_available():
            raise RuntimeError("attention=flash_attention_2 was asked for, but flash-attn does not import. "
                               "Install it (pip install flash-attn --no-build-isolation) or use --attention sdpa.")
        if _kind(device) != "cuda":
            raise RuntimeError("attention=flash_attention_2 needs a CUDA GPU; use --attention sdpa on CPU.")
    return requested, f"{requested}: asked for"


# ---- SDPA backend order ---------------------------------------------------------------------------


def _cuda_capability() -> tuple[int, int] | None:
    """(major, minor) of the current GPU, or None without one (a function so tests can pretend)."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def _first_line(exc: BaseException, caught=()) -> str:
    """The exception's first line. SDPA's is a generic 'No viable backend': on CUDA the refused kernel has
    warned why just before (e.g. that it takes no attn_mask), so the first such warning is added."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if "No viable backend" not in text:
        return text
    reasons = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    reasons = [r for r in reasons if not r.endswith(":")]  # drop headers like '... not used because:'
    return f"{text} ({reasons[0]})" if reasons else text


@functools.cache
def _backend_error(backend: SDPBackend, device: str) -> str | None:
    """Run a tiny causal SDPA forward + backward forced to `backend` on `device`: None if it ran, else why
    not. bf16 on CUDA (the training dtype there; flash refuses fp32 on CUDA), fp32 on CPU."""
    dtype = torch.bfloat16 if _kind(device) == "cuda" else torch.float32
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.enable_grad(), sdpa_kernel([backend]):
                q = torch.randn(1, 2, 128, 64, device=device, dtype=dtype, requires_grad=True)
                F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            return None
        except Exception as e:  # noqa: BLE001 -- any refusal counts, including no GPU at all
            return _first_line(e, caught)


def sdpa_backends(requested: str, device: str) -> tuple[list[SDPBackend] | None, str]:
    """Turn the config's `sdpa_backend` into a priority list for `sdpa_context`, plus a one-line reason.

    None means PyTorch's default order. An explicit list is kept in its order and SDPA falls back only within
    it; a single backend that cannot run here is an error now rather than a 'No viable backend' mid-run.
    """
    names = [n.strip().lower() for n in str(requested).split(",")]
    allowed = f"auto, or one or a comma-separated list of {', '.join(SDPA_BACKENDS)} (e.g. cudnn,flash,math)"
    if names == ["auto"]:
        cap = _cuda_capability() if _kind(device) == "cuda" else None
        default = "sdpa_backend=auto: PyTorch's default order"
        if cap is None:
            return None, f"{default} ({_kind(device).upper()})"
        if cap < (9, 0):
            return None, f"{default} (sm{cap[0]}{cap[1]}: cuDNN first is measured faster only on Hopper)"
        err = _backend_error(SDPBackend.CUDNN_ATTENTION, device)
        if err:
            return None, f"{default} (cuDNN attention does not run here: {err})"
        return [SDPA_BACKENDS[n] for n in HOPPER_ORDER], (
            f"sdpa_backend=auto: {','.join(HOPPER_ORDER)} on sm{cap[0]}{cap[1]} (Hopper: cuDNN first, the fastest "
            f"SDPA kernel in {ATTENTION_OPS_RESULT}, measured on an H200. Re-measure on this GPU with "
            "attention.benchmark_attention)")
    bad = [n for n in names if n not in SDPA_BACKENDS]
    if bad:
        raise ValueError(f"sdpa_backend={requested!r}: unknown backend {bad[0]!r}; choose {allowed}.")
    names = list(dict.fromkeys(names))
    errors = {n: _backend_error(SDPA_BACKENDS[n], device) for n in names}
    runnable = [n for n in names if errors[n] is None]
    if not runnable:
        here = [n for n in SDPA_BACKENDS if _backend_error(SDPA_BACKENDS[n], device) is None]
        n = names[0]
        cpu_only = _kind(device) == "cpu" and SDPA_BACKENDS[n] in CUDA_ONLY
        why = "it is a CUDA-only kernel" if cpu_only else errors[n].rstrip(".")
        raise RuntimeError(f"sdpa_backend={requested}: SDPA's {n} kernel cannot run on {device} ({why}). "
                           f"Use sdpa_backend=auto or one that runs here: {', '.join(here) or 'none'}.")
    skipped = [n for n in names if errors[n] is not None]
    note = f" ({', '.join(skipped)} cannot run on {device}; SDPA skips them)" if skipped else ""
    return [SDPA_BACKENDS[n] for n in names], f"sdpa_backend={','.join(names)}: asked for{note}"


def sdpa_context(backends: list[SDPBackend] | None):
    """Run SDPA with `backends` in this priority order (only those); PyTorch's default when None.

    Wrap each micro-step's forward and backward: checkpointing recomputes attention during backward.
    """
    if backends is None:
        return contextlib.nullcontext()
    return sdpa_kernel(list(backends), set_priority=True)


def default_sdpa_kernel(batch: int = 8, heads: int = 32, seq: int = 2048, head_dim: int = 128,
                        device: str | None = None, dtype: torch.dtype | None = None, causal: bool = True) -> str | None:
    """The SDPA kernel PyTorch picks by itself (no `sdpa_kernel` order) for causal attention at this shape, by
    name (`cudnn`, `flash`, `efficient`, `math`): what a plain `transformers` model, whose default attention is
    SDPA, runs. Asks PyTorch's own selector (`torch._fused_sdp_choice`, private: None where it is missing or
    names a kernel outside these four)."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return None
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if _kind(device) == "cuda" else torch.float32)
    q = torch.empty(batch, heads, seq, head_dim, device=device, dtype=dtype)
    picked = choose(q, q, q, is_causal=causal)
    return next((name for name, b in SDPA_BACKENDS.items() if int(b.value) == int(picked)), None)


# ---- the op microbenchmark ------------------------------------------------------------------------
