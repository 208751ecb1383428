"""Lesson 1's measurements: where data costs time in fine-tuning, and what each fix buys.

Three experiments, each one result file (the keys every tunekit result has, plus a `rows` list):

- `train`: the training step fed three ways — tokenized offline, tokenized in the loop, tokenized in the
  loop but inside DataLoader workers (claim C1) — then with the DataLoader knobs off and on (does the GPU
  ever wait? claim C2), then padded vs length-grouped vs packed batches (real tokens/s and padding), packed
  rows on the model built for packing (the library's attention for them), each variant timed on batches it
  has already run once.
  Each row splits the step into *data* time (waiting for the next batch and copying it to the device) and
  *compute* time (forward, backward, optimizer, synchronized).
- `loader`: a sweep of `num_workers` x `pin_memory` x `prefetch_factor` x `persistent_workers` on data
  throughput alone, two epochs each, so worker start-up and persistence show (claim C2).
- `read`: one pass over a tokenized dataset held in RAM, memory-mapped from disk cold and warm, and re-read
  from JSONL and re-tokenized, on GSM8K and on a synthetic corpus of about 1 GB (claim C3). "Cold" is checked,
  not assumed: before that pass the share of the files' pages still in the page cache is measured
  (`resident_fraction`, Linux `mincore`) and recorded; the row is called cold only when under 5% remain.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from tunekit import memory
from tunekit.bench.timing import spread
from tunekit.build import with_config_threads
from tunekit.config import TuneConfig
from tunekit.data.batching import Collator, EpochSampler, build_dataloader, default_num_workers, pack_dataset
from tunekit.data.records import load_records, resolve_source
from tunekit.data.tokens import InLoopTokenized, iter_jsonl_tokenized, save_dataset, tokenize_dataset
from tunekit.io import atomic_output
from tunekit.results import code_file, new_result

# ---- timing a fed training step ----------------------------------------------------------------------


def measure_fed_steps(step_fn, batches, steps: int, warmup: int, device: str) -> dict:
    """Run `step_fn(batch)` on `warmup + steps` batches from the iterator `batches`, timing for each step
    the wait for its batch (data) and the step itself (compute, synchronized). Real tokens are counted from
    each batch's attention mask."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    data_s, compute_s, tokens, slots = [], [], 0, 0
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        batch = next(batches)
        mask = batch.pop("attention_mask")
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        sync()
        t1 = time.perf_counter()
        step_fn(batch)
        sync()
        t2 = time.perf_counter()
        if i >= warmup:
            data_s.append(t1 - t0)
            compute_s.append(t2 - t1)
            tokens += int(mask.sum())
            slots += mask.numel()
    total = sum(data_s) + sum(compute_s)
    return {"tokens_per_s": round(tokens / total, 1), "data_s_per_step": round(statistics.mean(data_s), 5),
            "compute_s_per_step": round(statistics.mean(compute_s), 5),
            "data_fraction": round(sum(data_s) / total, 4), "real_tokens": tokens, "slots": slots,
            "padding_fraction": round(1 - tokens / slots, 4), "steps": steps,
            # the step-to-step spread of the whole step (IQR / median), so that two rows closer than it read
            # as the same within noise
            "step_spread": round(spread([d + c for d, c in zip(data_s, compute_s)]), 4)}


def cycle(make_loader):
    """Batches forever from fresh loaders (one per epoch)."""
    epoch = 0
    while True:
        yield from make_loader(epoch)
        epoch += 1


def plain_loader(ds, batch_size: int, pad_id: int, seed: int, epoch: int, **knobs):
    """A DataLoader over any map-style dataset of {"input_ids", "labels"} with the knobs given."""
    workers = knobs.get("num_workers", 0)
    extra = ({"prefetch_factor": knobs.get("prefetch_factor", 2),
              "persistent_workers": knobs.get("persistent_workers", False)} if workers else {})
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=EpochSampler(len(ds), seed, epoch),
                                       collate_fn=Collator(pad_id), drop_last=True, num_workers=workers,
                                       pin_memory=knobs.get("pin_memory", False), **extra)


@with_config_threads
def run_train_experiment(cfg: TuneConfig, steps: int = 15, warmup: int = 3, verbose: bool = True) -> dict:
    """C1, the GPU-wait half of C2, and packing, on one model built once (see module docstring)."""
    from tunekit.build import build_training, resolve_runtime
    from tunekit.prepare import build_tokenizer
    from tunekit.step import train_step

    device, dtype = resolve_runtime(cfg)
    records = load_records(cfg.data)
    tokenizer = build_tokenizer(cfg, records)
    tokenized, stats = tokenize_dataset(records, tokenizer, cfg.max_length, source=cfg.data)
    model, optimizer, scheduler, options = build_training(cfg, len(tokenizer), device, dtype, 10**9, verbose)
    pad = tokenizer.pad_token_id
    bs, seed = cfg.batch_size, cfg.seed
    workers = default_num_workers()
    pin = device == "cuda"

    def step(batch):
        train_step(model, [batch], optimizer, scheduler, cfg.max_grad_norm, **options)

    inloop = InLoopTokenized(records, tokenizer, cfg.max_length, cfg.data)
    article = {"num_workers": workers, "pin_memory": pin, "prefetch_factor": 4, "persistent_workers": True}
    variants = {
        # C1: where tokenization happens
        "C1 offline (tokenized before training)": lambda e: plain_loader(tokenized, bs, pad, seed, e),
        "C1 in the loop (main process)": lambda e: plain_loader(inloop, bs, pad, seed, e),
        f"C1 in the loop, {workers} workers": lambda e: plain_loader(inloop, bs, pad, seed, e, **article),
        # C2: the DataLoader knobs, on the offline data
        "C2 loader knobs off": lambda e: plain_loader(tokenized, bs, pad, seed, e),
        "C2 loader knobs as the article says": lambda e: plain_loader(tokenized, bs, pad, seed, e, **article),
        "pack: pad to longest in batch": lambda e: build_dataloader(tokenized, bs, pad, seed, e),
        "pack: length-grouped batches": lambda e: build_dataloader(tokenized, bs, pad, seed, e,
                                                                         group_by_length=True),
    }
    packed = pack_dataset(tokenized, cfg.max_length)
    pack_rows = max(1, round(bs * stats["tokens"] / stats["samples"] / cfg.max_length))  # about the same tokens
    packed_variants = {
        f"pack: packed rows of {cfg.max_length} (x{pack_rows})": lambda e: build_dataloader(
            packed, pack_rows, pad, seed, e),
        f"pack: packed rows of {cfg.max_length} (x{4 * pack_rows}, 4x the tokens)": lambda e: build_dataloader(
            packed, 4 * pack_rows, pad, seed, e),
    }
    rows = []

    def run(name, make):
        # Each variant first runs its own batches once, untimed, then the same batches timed (the loaders are
        # seeded by epoch): every batch shape has met its kernel selection and allocator growth before it is
        # timed, so a variant of many shapes (length-grouped batches) is not timed while it warms up.
        measure_fed_steps(step, cycle(make), steps, warmup, device)
        row = {"variant": name, **measure_fed_steps(step, cycle(make), steps, warmup, device)}
        rows.append(row)
        if verbose:
            print(f"{name:<45} {row['tokens_per_s']:>10,.0f} real tok/s  data {row['data_fraction']:6.1%}  "
                  f"padding {row['padding_fraction']:6.1%}  step {row['compute_s_per_step']:.3f}s")

    memory.reset_peak_memory(device)
    for name, make in variants.items():
        run(name, make)
    # Packed rows train as `tunekit train` trains them: the model built for packing, whose attention is the
    # library's default for packed rows (`attention.choose_attention(..., packed=True)`: FlexAttention on a GPU,
    # which skips the masked blocks), not the padded batches' SDPA with a dense document mask.
    del model, optimizer, scheduler, options  # one 7B model at a time
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    model, optimizer, scheduler, options = build_training(dataclasses.replace(cfg, packing="pack"), len(tokenizer),
                                                          device, dtype, 10**9, verbose)
    for name, make in packed_variants.items():
        run(name, make)
    best = max(rows, key=lambda r: r["tokens_per_s"])
    return new_result("data_train", cfg, best["tokens_per_s"], round(memory.peak_memory_gb(device)[0], 3),
                      code_files=(code_file(__file__),), call=f"databench.run_train_experiment(steps={steps}, warmup={warmup})",
                      cpu_count=os.cpu_count(), rows=rows, data_stats=stats, num_workers=workers)


# ---- the DataLoader sweep ------------------------------------------------------------------------------


def run_loader_sweep(ds, pad_id: int, batch_size: int, batches: int, device: str, epochs: int = 2,
                     worker_counts: tuple[int, ...] | None = None, verbose: bool = True) -> list[dict]:
    """Data throughput alone (collate + copy to the device), `epochs` epochs of `batches` batches each."""
    worker_counts = worker_counts or tuple(sorted({0, 2, default_num_workers()}))
    subset = ds.select(range(min(len(ds), batches * batch_size)))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for workers in worker_counts:
        for pin in ((False, True) if device == "cuda" else (False,)):
            for prefetch in ((2, 4) if workers else (None,)):
                for persistent in ((False, True) if workers else (False,)):
                    loader = build_dataloader(subset, batch_size, pad_id, num_workers=workers, pin_memory=pin,
                                                   prefetch_factor=prefetch or 2, persistent_workers=persistent)
                    t0 = time.perf_counter()
                    first = None
                    n = tokens = 0
                    for _ in range(epochs):
                        for batch in loader:
                            for v in batch.values():
                                v.to(device, non_blocking=True)
                            if first is None:
                                first = time.perf_counter() - t0
                            n += 1
                            tokens += int(batch["attention_mask"].sum())
                    sync()
                    total = time.perf_counter() - t0
                    row = {"num_workers": workers, "pin_memory": pin, "prefetch_factor": prefetch,
                           "persistent_workers": persistent, "batches_per_s": round(n / total, 1),
                           "tokens_per_s": round(tokens / total, 1), "first_batch_s": round(first, 4),
                           "total_s": round(total, 3)}
                    rows.append(row)
                    if verbose:
                        print(f"workers {workers:>2} pin {pin!s:>5} prefetch {prefetch!s:>4} persistent "
                              f"{persistent!s:>5}: {row['batches_per_s']:>8,.1f} batches/s, "
                              f"first batch {first * 1000:7.1f} ms")
    return rows


# ---- reading: RAM vs memory-mapped vs JSONL -------------------------------------------------------------


COLD_BELOW = 0.05  # a read is called cold only when less than this share of the file pages is cached


def drop_file_cache(folder: Path) -> None:
    """Ask the kernel to forget the cached pages of every file under `folder` (a cold read next time).

    Only a request: the kernel keeps dirty pages (a file just written is still dirty, so each file is
    fsynced first) and any page another process has mapped. `resident_fraction` says what it did."""
    for p in Path(folder).rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _libc_mincore():
    """libc's mmap, mincore and munmap through ctypes, or None where there is no such libc (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fns = libc.mmap, libc.mincore, libc.munmap
    except (OSError, AttributeError):
        return None
    fns[0].restype, fns[0].argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                       ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fns[1].restype, fns[1].argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t,
                                                     ctypes.POINTER(ctypes.c_ubyte)]
    fns[2].restype, fns[2].argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]
    return fns


def resident_fraction(folder: Path) -> float | None:
    """The share (0..1) of the pages of every file under `folder` that are in the page cache now.

    Each file is mapped (not read, so nothing is brought in) and `mincore(2)` reports which of its pages are
    resident. None where that cannot be known: no mincore (not Linux), or a file this process could not
    write — since Linux 5.0 mincore then reports only pages mapped by this process, which would read as cold."""
    if sys.platform != "linux" or (fns := _libc_mincore()) is None:
        return None
    libc_mmap, mincore, munmap = fns
    page = mmap.PAGESIZE
    resident = total = 0
    for p in sorted(Path(folder).rglob("*")):
        if not p.is_file() or (size := p.stat().st_size) == 0:
            continue
        if not os.access(p, os.W_OK):
            return None
        pages = -(-size // page)
        vec = (ctypes.c_ubyte * pages)()
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc_mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                if mincore(addr, size, vec) != 0:
                    return None
            finally:
                munmap(addr, size)
        finally:
            os.close(fd)
        resident += sum(b & 1 for b in vec)
        total += pages
    return resident / total if total else None


def cold_label(resident: float | None) -> str:
    """The name of the pass after an eviction request: cold only when the page cache was shown to be empty."""
    if resident is not None and resident < COLD_BELOW:
        return "memory-mapped arrow, cold"
    left = "residency not measurable here" if resident is None else f"{resident:.0%} still cached"
    return f"memory-mapped arrow, after eviction request ({left})"


def full_pass(ds) -> tuple[int, int]:
    """Read every row's input_ids in batches of 1,000 (as a DataLoader would, minus collation)."""
    rows = tokens = 0
    for batch in ds.with_format("numpy", columns=["input_ids"]).iter(batch_size=1000):
        rows += len(batch["input_ids"])
        tokens += sum(len(x) for x in batch["input_ids"])
    return rows, tokens


def measure_reads(jsonl: Path, tokenized_dir: Path, tokenizer, max_length: int, jsonl_rows: int | None = None,
                  verbose: bool = True) -> list[dict]:
    """Samples/s of one pass: in RAM, memory-mapped cold and warm, and JSONL re-read + re-tokenized.

    Each row's `resident_before` is the share of the arrow files' pages in the page cache just before its pass
    (None for the passes that do not read them memory-mapped, or where it cannot be measured). The first
    memory-mapped pass is labelled by it: see `cold_label`."""
    import datasets

    rows = []

    def record(kind, seconds, n, tokens, resident=None):
        row = {"source": kind, "samples_per_s": round(n / seconds, 1), "tokens_per_s": round(tokens / seconds, 1),
               "samples": n, "seconds": round(seconds, 3),
               "resident_before": None if resident is None else round(resident, 4)}
        rows.append(row)
        if verbose:
            cached = "" if resident is None else f", {resident:.0%} of its pages cached before"
            print(f"{kind:<34} {row['samples_per_s']:>14,.0f} samples/s  ({n:,} samples in {seconds:.2f} s{cached})")

    drop_file_cache(tokenized_dir)
    resident = resident_fraction(tokenized_dir)
    t0 = time.perf_counter()
    ds = datasets.load_from_disk(str(tokenized_dir))
    n, tokens = full_pass(ds)
    record(cold_label(resident), time.perf_counter() - t0, n, tokens, resident)
    resident = resident_fraction(tokenized_dir)
    t0 = time.perf_counter()
    n, tokens = full_pass(datasets.load_from_disk(str(tokenized_dir)))
    record("memory-mapped arrow, warm", time.perf_counter() - t0, n, tokens, resident)
    in_ram = datasets.load_from_disk(str(tokenized_dir), keep_in_memory=True)  # loading is not the pass
    t0 = time.perf_counter()
    n, tokens = full_pass(in_ram)
    record("arrow in RAM", time.perf_counter() - t0, n, tokens)
    del in_ram
    t0 = time.perf_counter()
    n = tokens = 0
    for ids in iter_jsonl_tokenized(jsonl, tokenizer, max_length):
        n += 1
        tokens += len(ids["input_ids"])
        if jsonl_rows and n >= jsonl_rows:
            break
    record("JSONL re-read and re-tokenized", time.perf_counter() - t0, n, tokens)
    return rows


def write_synthetic_corpus(path: Path, megabytes: int, seed: int = 0) -> Path:
    """About `megabytes` MB of GSM8K-layout JSONL from the project's arithmetic generator (atomic)."""
    import importlib.util
    import random

    from tunekit.config import REPO_ROOT

    spec = importlib.util.spec_from_file_location("make_arith", REPO_ROOT / "data" / "arith" / "make_arith.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    rng = random.Random(seed)
    written, target = 0, megabytes * 1_000_000
    with atomic_output(path) as tmp, open(tmp, "w") as f:
        while written < target:
            chunk = "".join(json.dumps(gen.problem(rng)) + "\n" for _ in range(10_000))
            f.write(chunk)
            written += len(chunk)
    return path


@with_config_threads
def run_loader_experiment(cfg: TuneConfig, batches: int = 100, verbose: bool = True) -> dict:
    from tunekit.build import resolve_runtime
    from tunekit.prepare import build_tokenizer

    device = resolve_runtime(cfg)[0]
    records = load_records(cfg.data)
    tokenizer = build_tokenizer(cfg, records)
    tokenized, _ = tokenize_dataset(records, tokenizer, cfg.max_length, source=cfg.data)
    rows = run_loader_sweep(tokenized, tokenizer.pad_token_id, cfg.batch_size, batches, device, verbose=verbose)
    best = max(rows, key=lambda r: r["tokens_per_s"])
    return new_result("data_loader", cfg, best["tokens_per_s"], None,
                      code_files=(code_file(__file__),), call=f"databench.run_loader_experiment(batches={batches})", cpu_count=os.cpu_count(),
                      rows=rows, batches_per_epoch=batches, batch_size=cfg.batch_size)


def run_read_experiment(cfg: TuneConfig, corpus_mb: int = 1000, jsonl_rows: int = 100_000,
                        verbose: bool = True) -> dict:
    """C3 on the config's data and on a synthetic corpus of `corpus_mb` MB, tokenized offline first."""
    from tunekit.prepare import build_tokenizer

    work = cfg.run_dir() / "read-bench"
    work.mkdir(parents=True, exist_ok=True)
    records = load_records(cfg.data)
    tokenizer = build_tokenizer(cfg, records)
    procs = default_num_workers() or None
    rows = []
    sources = [("dataset", Path(resolve_source(cfg.data)))]
    if corpus_mb:
        corpus = work / f"synthetic-{corpus_mb}mb.jsonl"
        if not corpus.exists():
            t0 = time.perf_counter()
            write_synthetic_corpus(corpus, corpus_mb, cfg.seed)
            if verbose:
                print(f"wrote {corpus.stat().st_size / 1e6:,.0f} MB synthetic corpus in {time.perf_counter() - t0:.0f} s")
        sources.append(("synthetic", corpus))
    for label, jsonl in sources:
        tokenized_dir = work / f"{label}-tokenized"
        t0 = time.perf_counter()
        ds, stats = tokenize_dataset(load_records(str(jsonl)), tokenizer, cfg.max_length, num_proc=procs,
                                          source=str(jsonl))
        save_dataset(ds, tokenized_dir)
        prep_s = time.perf_counter() - t0
        if verbose:
            print(f"--- {label}: {jsonl.name}, {jsonl.stat().st_size / 1e6:,.0f} MB JSONL, {stats['samples']:,} samples, "
                  f"tokenized offline in {prep_s:.1f} s with {procs or 1} processes")
        for row in measure_reads(jsonl, tokenized_dir, tokenizer, cfg.max_length, jsonl_rows, verbose):
            arrow_mb = sum(p.stat().st_size for p in tokenized_dir.rglob("*") if p.is_file()) / 1e6
            rows.append({"data": label, "jsonl_mb": round(jsonl.stat().st_size / 1e6, 1), "arrow_mb": round(arrow_mb, 1),
                         "offline_tokenize_s": round(prep_s, 2), **row})
    ram = max(r["samples_per_s"] for r in rows if r["source"] == "arrow in RAM")
    return new_result("data_read", cfg, max(r["tokens_per_s"] for r in rows), None,
                      code_files=(code_file(__file__),), call=f"databench.run_read_experiment(corpus_mb={corpus_mb}, jsonl_rows={jsonl_rows})",
                      cpu_count=os.cpu_count(), rows=rows, best_ram_samples_per_s=ram)
