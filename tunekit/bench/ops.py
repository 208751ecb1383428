"""Single operations timed alone: attention kernels forward and backward (eager, SDPA's backends, flex,
flash-attn), and the precision TF32 matmuls keep.
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tunekit.attention import CUDA_ONLY, SDPA_BACKENDS, _first_line, _kind, flash_attn_available
from tunekit.results import new_result
from tunekit.speedups import tf32

BENCH_BACKENDS = ("eager", "math", "efficient", "flash", "cudnn", "flex", "flash_attn")


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


def tf32_precision(n: int = 4096, device: str = "cuda", seed: int = 0) -> dict:
    """How far an n x n x n fp32 matmul lands from float64 with TF32 off, with TF32 on, and in bf16 (relative
    Frobenius error): what "almost no precision loss" means in numbers. A result dict (`l4_tf32_precision`)."""
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(n, n, device=device, generator=g)
    b = torch.randn(n, n, device=device, generator=g)
    exact = a.double() @ b.double()

    def error(c) -> float:
        return float((c.double() - exact).norm() / exact.norm())

    with tf32(False):
        plain = error(a @ b)
    with tf32(True):
        fast = error(a @ b)
    half = error(a.bfloat16() @ b.bfloat16())
    return new_result("l4_tf32_precision", None, None, None, call=f"speedups.tf32_precision({n})", n=n,
                      fp32_rel_error=plain, tf32_rel_error=fast, bf16_rel_error=half)
