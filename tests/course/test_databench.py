"""Lesson 1's measurements (tunekit_course/databench.py) on tiny inputs: the data/compute split of a fed step, in-loop
tokenization, the loader sweep's grid, the read experiment and its evidence of a cold read, and the result
headers every experiment writes."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from tunekit import results
from tunekit.data.batching import default_num_workers
from tunekit.data.records import load_records
from tunekit.data.tokens import InLoopTokenized, save_dataset, tokenize_dataset
from tunekit_course import databench

# ---- a fed training step --------------------------------------------------------------------------


def fake_batches(masks: list[list[list[int]]], wait_s: float):
    """Batches with the given attention masks, each `wait_s` late (a slow data pipeline)."""
    for i, mask in enumerate(masks):
        time.sleep(wait_s)
        m = torch.tensor(mask)
        yield {"input_ids": torch.full(m.shape, i), "labels": torch.full(m.shape, i), "attention_mask": m}


def test_measure_fed_steps_splits_data_and_compute_and_counts_real_tokens():
    masks = [[[1, 1, 1, 1], [1, 1, 1, 1]],  # warm-up: not counted
             [[1, 1, 1, 1], [1, 1, 0, 0]],  # 6 real of 8
             [[1, 1, 1, 0], [1, 0, 0, 0]],  # 4 real of 8
             [[1, 1, 1, 1], [1, 1, 1, 1]]]  # 8 real of 8
    seen = []

    def step(batch):
        seen.append(batch)
        time.sleep(0.05)

    out = databench.measure_fed_steps(step, fake_batches(masks, 0.01), steps=3, warmup=1, device="cpu")
    assert [int(b["input_ids"][0, 0]) for b in seen] == [0, 1, 2, 3]
    assert all("attention_mask" not in b for b in seen)  # the step gets what the model takes
    assert (out["steps"], out["real_tokens"], out["slots"]) == (3, 18, 24)
    assert out["padding_fraction"] == 0.25
    assert out["step_spread"] == 0.0  # three steps: too few for quartiles
    assert 0.01 <= out["data_s_per_step"] < out["compute_s_per_step"] and out["compute_s_per_step"] >= 0.05
    assert 0.05 < out["data_fraction"] < 0.5  # about 0.01 / (0.01 + 0.05)
    per_step = out["data_s_per_step"] + out["compute_s_per_step"]
    assert out["tokens_per_s"] == pytest.approx(18 / (3 * per_step), rel=0.01)


# ---- tokenizing in the loop -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def records(small_data):
    return load_records(str(small_data))


@pytest.fixture(scope="module")
def tokenized(records, tokenizer):
    return tokenize_dataset(records, tokenizer, 128)[0]


def test_in_loop_tokenization_equals_offline(records, tokenized, tokenizer):
    inloop = InLoopTokenized(records, tokenizer, 128)
    assert len(inloop) == len(tokenized) == 64
    for i in (0, 17, 63):
        assert inloop[i] == {"input_ids": tokenized[i]["input_ids"], "labels": tokenized[i]["labels"]}
    short = InLoopTokenized(records, tokenizer, 16)[0]  # max_length reaches the tokenizer
    assert short["input_ids"] == tokenized[0]["input_ids"][:16]


# ---- the DataLoader sweep ---------------------------------------------------------------------------


def test_loader_sweep_covers_the_grid(tokenized, tokenizer):
    rows = databench.run_loader_sweep(tokenized, tokenizer.pad_token_id, batch_size=4, batches=3, device="cpu",
                                      worker_counts=(0, 1), verbose=False)
    grid = [(r["num_workers"], r["pin_memory"], r["prefetch_factor"], r["persistent_workers"]) for r in rows]
    assert grid == [(0, False, None, False), (1, False, 2, False), (1, False, 2, True), (1, False, 4, False),
                    (1, False, 4, True)]  # pinning is swept only where CUDA is
    for r in rows:
        assert r["batches_per_s"] > 0 and r["tokens_per_s"] > 0, r
        assert 0 < r["first_batch_s"] <= r["total_s"], r


# ---- reading: cold, warm, RAM, JSONL ------------------------------------------------------------------


def memory_backed(path: Path) -> bool:
    """True when `path` lives on tmpfs/ramfs, whose pages cannot leave memory (eviction is impossible)."""
    try:
        mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return False
    best = max((m for m in mounts if str(path.resolve()).startswith(m[1])), key=lambda m: len(m[1]), default=None)
    return best is not None and best[2] in ("tmpfs", "ramfs")


def test_cold_label_claims_cold_only_with_evidence():
    assert databench.cold_label(0.0) == databench.cold_label(0.049) == "memory-mapped arrow, cold"
    assert databench.cold_label(0.05) == "memory-mapped arrow, after eviction request (5% still cached)"
    assert databench.cold_label(1.0) == "memory-mapped arrow, after eviction request (100% still cached)"
    assert databench.cold_label(None) == "memory-mapped arrow, after eviction request (residency not measurable here)"


def test_resident_fraction_sees_eviction_and_reads(tmp_path):
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "a.bin").write_bytes(os.urandom(6 << 20))
    (folder / "b.bin").write_bytes(os.urandom(2 << 20))
    (folder / "empty").touch()
    written = databench.resident_fraction(folder)
    if sys.platform != "linux":
        assert written is None
        return
    assert written is not None and written > 0.9  # what was just written is in the page cache
    if memory_backed(folder):
        pytest.skip("tmp_path is on tmpfs: its pages cannot be evicted")
    databench.drop_file_cache(folder)
    assert databench.resident_fraction(folder) < 0.05
    fd = os.open(folder / "a.bin", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: exactly the pages read
        os.pread(fd, 2 << 20, 0)
    finally:
        os.close(fd)
    assert 0.2 < databench.resident_fraction(folder) < 0.75  # 2 MB of 8 MB
    assert databench.resident_fraction(tmp_path / "nothing-here") is None


def test_measure_reads(tmp_path, small_data, tokenized, tokenizer):
    folder = save_dataset(tokenized, tmp_path / "tokenized")
    rows = databench.measure_reads(small_data, folder, tokenizer, 128, verbose=False)
    cold, warm, ram, jsonl = rows
    assert cold["source"] == databench.cold_label(cold["resident_before"])
    assert [r["source"] for r in rows[1:]] == ["memory-mapped arrow, warm", "arrow in RAM",
                                               "JSONL re-read and re-tokenized"]
    tokens_per_sample = sum(len(x) for x in tokenized["input_ids"]) / 64
    for r in rows:  # every pass reads all 64 samples and the same tokens
        assert r["samples"] == 64 and r["samples_per_s"] > 0 and r["seconds"] > 0, r
        assert r["tokens_per_s"] / r["samples_per_s"] == pytest.approx(tokens_per_sample, rel=1e-3), r
    assert ram["resident_before"] is None and jsonl["resident_before"] is None
    if sys.platform == "linux":
        assert warm["resident_before"] > 0.9  # the first pass brought the pages in
        if not memory_backed(folder):
            assert cold["source"] == "memory-mapped arrow, cold" and cold["resident_before"] < 0.05
    limited = databench.measure_reads(small_data, folder, tokenizer, 128, jsonl_rows=10, verbose=False)
    assert limited[-1]["samples"] == 10


# ---- the experiments and their result headers -------------------------------------------------------


def check_header(result: dict, name: str, call: str, tmp_path: Path) -> None:
    assert result["name"] == name and result["call"] == call
    for key in (*results.REQUIRED_KEYS, *results.PROVENANCE_KEYS, "config", "versions"):
        assert key in result, key
    assert result["code_hash"] == results.code_hash(code_files=result["code_files"]) and result["cpu_count"] == os.cpu_count()
    assert result["tokens_per_s"] == max(r["tokens_per_s"] for r in result["rows"])
    loaded = results.load_results(results.save_result(result, tmp_path))[0]  # JSON all the way
    assert loaded["rows"] == result["rows"]


def test_train_experiment_rows_and_header(make_cfg, tmp_path):
    cfg = make_cfg()
    result = databench.run_train_experiment(cfg, steps=2, warmup=1, verbose=False)
    check_header(result, "data_train", "databench.run_train_experiment(steps=2, warmup=1)", tmp_path)
    workers = default_num_workers()
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows)[:5] == ["C1 offline (tokenized before training)", "C1 in the loop (main process)",
                              f"C1 in the loop, {workers} workers", "C2 loader knobs off",
                              "C2 loader knobs as the article says"]
    assert list(rows)[5:7] == ["pack: pad to longest in batch", "pack: length-grouped batches"]
    packed = [v for v in rows if v.startswith("pack: packed rows of 128")]
    assert len(rows) == 9 and len(packed) == 2
    for r in rows.values():
        assert r["steps"] == 2 and r["tokens_per_s"] > 0 and 0 <= r["data_fraction"] < 1, r
        assert r["real_tokens"] == round(r["slots"] * (1 - r["padding_fraction"])), r
    assert rows["pack: pad to longest in batch"]["padding_fraction"] > 0
    assert max(rows[v]["padding_fraction"] for v in packed) < rows["pack: pad to longest in batch"]["padding_fraction"]
    assert result["num_workers"] == workers and result["data_stats"]["samples"] == 64


def test_loader_and_read_experiments_headers(make_cfg, tmp_path):
    cfg = make_cfg()
    loader = databench.run_loader_experiment(cfg, batches=2, verbose=False)
    check_header(loader, "data_loader", "databench.run_loader_experiment(batches=2)", tmp_path)
    assert {r["num_workers"] for r in loader["rows"]} == {0, 2, default_num_workers()}
    assert loader["batches_per_epoch"] == 2 and loader["batch_size"] == cfg.batch_size
    read = databench.run_read_experiment(cfg, corpus_mb=0, jsonl_rows=10, verbose=False)
    check_header(read, "data_read", "databench.run_read_experiment(corpus_mb=0, jsonl_rows=10)", tmp_path)
    assert [r["data"] for r in read["rows"]] == ["dataset"] * 4
    assert all(r["source"].startswith("memory-mapped arrow, ") for r in read["rows"][:2])
    assert read["best_ram_samples_per_s"] == read["rows"][2]["samples_per_s"]


def test_each_variant_is_timed_on_batches_it_has_run_and_packed_rows_on_a_model_built_for_them(make_cfg, monkeypatch):
    """A variant's batches run once untimed, then the same batches timed (the timed pass meets no new shape);
    the packed rows train on the model `tunekit train` builds for packed rows (its attention for them)."""
    import tunekit.build

    built, passes = [], []
    real_build, real_measure = tunekit.build.build_training, databench.measure_fed_steps

    def build(cfg, *args, **kwargs):
        built.append(cfg.packing)
        return real_build(cfg, *args, **kwargs)

    def measure(step, batches, steps, warmup, device):
        first = next(batches)
        passes.append(first["input_ids"].clone())

        def again():
            yield first
            yield from batches
        return real_measure(step, again(), steps, warmup, device)

    monkeypatch.setattr(tunekit.build, "build_training", build)
    monkeypatch.setattr(databench, "measure_fed_steps", measure)
    result = databench.run_train_experiment(make_cfg(), steps=2, warmup=1, verbose=False)
    assert built[-1] == "pack" and built[0] != "pack" and len(built) == 2
    assert len(passes) == 2 * len(result["rows"])  # an untimed pass, then the timed one, for each variant
    assert all(torch.equal(a, b) for a, b in zip(passes[::2], passes[1::2]))  # the same batches both times
