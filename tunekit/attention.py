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
- `eager`: the plain softmax(QK^T)V in PyTorch (`eager_attention` below) — the reference every other backend
  is tested against. It stores the full S×S score matrix per head, so it is slow and memory-hungry.

**Which kernel SDPA runs** (`sdpa_backend` in the config, `sdpa_backends` and `sdpa_context`). SDPA tries its
backends in a priority order and takes the first whose constraints the inputs meet (dtype, head size, mask,
GPU architecture); `torch.nn.attention.sdpa_kernel` restricts and reorders them
(https://pytorch.org/docs/stable/generated/torch.nn.attention.sdpa_kernel.html):

- `cudnn`: NVIDIA's fused attention in cuDNN 9 (CUDA only).
- `flash`: PyTorch's own copy of FlashAttention-2 (fp16/bf16 on sm80+; PyTorch also has a CPU flash kernel).
- `efficient`: the memory-efficient kernel from xFormers (CUDA only); it also takes arbitrary masks.
- `math`: the unfused composite of matmuls and softmax; runs anywhere, as slow as eager.

PyTorch's default order puts cuDNN last (torch 2.13: flash, efficient, math, cuDNN). The project measured
the four on one Hopper GPU, an H200 (`benchmark_attention`, causal forward + backward at B8 H32 S2048 D128 in
bf16; notebooks/results/l2_attention_ops.json): there cuDNN's kernel was the fastest of them, and
`test_attention.py` checks that `HOPPER_ORDER` still follows that file. So `auto` puts cuDNN first on sm90+
and keeps the rest as fallbacks; elsewhere it leaves PyTorch's order alone, since we have measured nothing
there. `benchmark_attention` re-measures all of them on your GPU at your shapes.

The order must hold in backward too: gradient checkpointing re-runs the forward (and so picks a kernel again)
during backward, so `sdpa_context` wraps both. Entering it costs microseconds (a few flag writes).
Feature detection, not version checks: we try the import, and probe a kernel by running it once.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
HOPPER_ORDER = ["cudnn", "flash", "efficient", "math"]  # fastest first, as measured in ATTENTION_OPS_RESULT
ATTENTION_OPS_RESULT = "notebooks/results/l2_attention_ops.json"  # the op benchmark, run on an H200
CUDA_ONLY = (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)  # CPU has only flash and math
BENCH_BACKENDS = ("eager", "math", "efficient", "flash", "cudnn", "flex", "flash_attn")


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _kind(device: str) -> str:
    return str(device).split(":")[0]


def choose_attention(requested: str, device: str, packed: bool = False) -> tuple[str, str]:
    """Return (implementation name for transformers, one-line reason).

    `packed` (rows holding several samples, `packing=pack`): without flash-attn, `auto` takes FlexAttention on
    CUDA, which skips the blocks the document mask rules out; in the 7B LoRA step on the H200 it ran at
    1.11x SDPA with the dense mask (notebooks/results/l2_packed_flex.json vs l2_packed_sdpa.json). The
    first step compiles its kernel (torch.compile), once per row length.
    """
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
            f"SDPA kernel in {ATTENTION_OPS_RESULT}, measured on an H200; PyTorch's own order puts it last. "
            "Re-measure on this GPU with attention.benchmark_attention)")
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


# ---- the op microbenchmark ------------------------------------------------------------------------


def document_ids(seq: int, docs: int = 1, device: str = "cpu") -> torch.Tensor:
    """Which document each position of a packed row of `docs` near-equal documents belongs to."""
    return torch.arange(seq, device=device) * docs // seq


def document_mask(seq: int, docs: int = 1, causal: bool = True, device: str = "cpu") -> torch.Tensor | None:
    """Boolean (seq, seq) mask, True where a query may attend a key: a packed row of `docs` near-equal
    documents, each causal within itself. None when nothing is masked (one document, not causal)."""
    if docs <= 1 and not causal:
        return None
    doc = document_ids(seq, docs, device)
    keep = doc[:, None] == doc[None, :]
    return keep & torch.ones(seq, seq, dtype=torch.bool, device=device).tril() if causal else keep


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
    """softmax(Q K^T / sqrt(d)) V from scratch, as transformers' eager Llama does it (softmax in fp32).
    q, k, v: (batch, heads, seq, head_dim); mask: boolean, True = attend."""
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _attention_fn(name: str, seq: int, docs: int, causal: bool, groups: int, device: str):
    """A function (q, k, v) -> out for one backend; raises RuntimeError if the backend is missing here."""
    mask = document_mask(seq, docs, causal, device)
    sdpa_mask = mask if docs > 1 else None  # one causal document: is_causal=True, which flash/cuDNN accept

    def repeat(t):  # grouped-query attention: each kv head serves `groups` query heads, as repeat_kv does
        return t.repeat_interleave(groups, dim=1) if groups > 1 else t

    if name == "eager":
        return lambda q, k, v: eager_attention(q, repeat(k), repeat(v), mask)
    if name in SDPA_BACKENDS:
        backend = SDPA_BACKENDS[name]
        if backend in CUDA_ONLY and _kind(device) != "cuda":
            raise RuntimeError(f"SDPA's {name} kernel is CUDA-only")

        def run(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, repeat(k), repeat(v), attn_mask=sdpa_mask,
                                                      is_causal=causal and sdpa_mask is None)
        return run
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        block_mask = None
        if mask is not None:
            doc = document_ids(seq, docs, device)

            def mask_mod(b, h, qi, ki):
                same = doc[qi] == doc[ki]
                return same & (qi >= ki) if causal else same
            block_mask = create_block_mask(mask_mod, None, None, seq, seq, device=device)
        flex = _compiled_flex()
        return lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=groups > 1)
    if name == "flash_attn":
        if not flash_attn_available():
            raise RuntimeError("flash-attn is not installed (pip install flash-attn --no-build-isolation)")
        if _kind(device) != "cuda":
            raise RuntimeError("flash-attn needs a CUDA GPU")
        from flash_attn import flash_attn_func, flash_attn_varlen_func

        if docs <= 1:
            return lambda q, k, v: flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)),
                                                   causal=causal).transpose(1, 2)
        lengths = torch.bincount(document_ids(seq, docs))  # flash-attn's varlen path, as for packing
        longest = int(lengths.max())
        cu = {}  # cumulative row starts on the GPU, built once per batch size (a copy per call would sync)

        def varlen(q, k, v):
            b, h, s, d = q.shape
            if b not in cu:
                starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.repeat(b).cumsum(0)])
                cu[b] = starts.to(device=device, dtype=torch.int32)
            flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
            out = flash_attn_varlen_func(*flat, cu[b], cu[b], longest, longest, causal=causal)
            return out.reshape(b, s, h, d).transpose(1, 2)
        return varlen
    raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(BENCH_BACKENDS)}")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _time_fwd_bwd(fn, qkv, dout, warmup: int, iters: int):
    """(batch row 0 of the output in fp32, median ms of forward + backward, CUDA peak GB above the inputs)."""
    device = dout.device

    def step():
        for t in qkv:
            t.grad = None  # fresh grads each step, as after optimizer.zero_grad(set_to_none=True)
        out = fn(*qkv)
        out.backward(dout)
        return out

    sample = step()[:1].detach().float().clone()  # the first call also compiles flex; not timed
    for _ in range(warmup - 1):
        step()
    for t in qkv:
        t.grad = None
    cuda = device.type == "cuda"
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 1e9 if cuda else None
    return sample, statistics.median(times), peak


def benchmark_attention(batch: int = 8, heads: int = 32, kv_heads: int | None = None, seq: int = 2048,
                        head_dim: int = 128, dtype: torch.dtype | None = None, device: str | None = None,
                        backends=BENCH_BACKENDS, causal: bool = True, warmup: int = 3, iters: int = 10,
                        docs: int = 1) -> list[dict]:
    """Time attention forward + backward (random output grad) per backend on the same random q, k, v.

    Rows: backend, ms_fwd_bwd (median of `iters`), peak_mem_gb (CUDA max_memory_allocated above the inputs;
    None on CPU), status ('ok' or 'unavailable: why'), max_abs_err_vs_math (output of batch row 0 against the
    math kernel in fp32 on the same inputs). `docs` > 1 packs that many documents per row: SDPA then needs a
    dense block-diagonal mask, which flash and cuDNN may refuse; flex and flash-attn skip masked blocks.
    A backend that fails (missing, refused, out of memory) gets a row saying why; the others still run.
    """
    unknown = [n for n in backends if n not in BENCH_BACKENDS]
    if unknown:
        raise ValueError(f"backends: unknown {unknown[0]!r}; choose from {', '.join(BENCH_BACKENDS)}")
    kv_heads = kv_heads or heads
    if heads % kv_heads or not 1 <= docs <= seq:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}), "
                         f"and docs ({docs}) between 1 and seq ({seq})")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = _kind(device) == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(h):
        return torch.randn(batch, h, seq, head_dim, device=device, dtype=dtype, generator=gen)
    q, k, v = rand(heads).requires_grad_(), rand(kv_heads).requires_grad_(), rand(kv_heads).requires_grad_()
    dout = rand(heads)
    groups = heads // kv_heads
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):  # the reference: math in fp32, batch row 0
        ref_k, ref_v = (t[:1].float().repeat_interleave(groups, 1) for t in (k, v))
        mask = document_mask(seq, docs, causal, device) if docs > 1 else None
        ref = F.scaled_dot_product_attention(q[:1].float(), ref_k, ref_v, attn_mask=mask,
                                             is_causal=causal and docs == 1)

    rows = []
    for name in backends:
        row = {"backend": name, "ms_fwd_bwd": None, "peak_mem_gb": None, "status": "ok",
               "max_abs_err_vs_math": None}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fn = _attention_fn(name, seq, docs, causal, groups, device)
                sample, ms, peak = _time_fwd_bwd(fn, (q, k, v), dout, warmup, iters)
                row.update(ms_fwd_bwd=ms, peak_mem_gb=peak)
                row["max_abs_err_vs_math"] = (sample - ref).abs().max().item()
            except Exception as e:  # noqa: BLE001 -- a failure (missing, refused, OOM) must not end the run
                row.update(ms_fwd_bwd=None, peak_mem_gb=None, status=f"unavailable: {_first_line(e, caught)}")
            finally:
                q.grad = k.grad = v.grad = None
                if cuda:
                    torch.cuda.empty_cache()
        rows.append(row)
    return rows


def format_attention_table(rows: list[dict]) -> str:
    """The benchmark rows as a markdown table."""
    def num(x, spec):
        return "—" if x is None else format(x, spec)
    lines = ["| backend | fwd+bwd ms | peak GB | max abs err vs math | status |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['backend']} | {num(r['ms_fwd_bwd'], '.2f')} | {num(r['peak_mem_gb'], '.2f')} | "
                     f"{num(r['max_abs_err_vs_math'], '.1e')} | {r['status'].replace('|', '/')} |")
    return "\n".join(lines)
