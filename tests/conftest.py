"""Shared fixtures: a private cache, restored global state, a small dataset and tiny configs.

Every test writes under `tmp_path`; the tokenizer/model cache goes to one temp folder per session
(`TUNEKIT_CACHE`), never to ~/.cache. Global torch state (default dtype, RNG, grad mode, threads) is put
back after each test, so a test that changes it cannot change the numbers of the next one.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")  # before anything imports matplotlib.pyplot

import numpy as np
import pytest
import torch
from helpers import SMALL_ARCH, read_arith, write_jsonl

from tunekit.presets import tiny

# ---- environment ---------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="session")
def tunekit_cache(tmp_path_factory):
    """Point TUNEKIT_CACHE at a temp folder for the whole session (subprocesses inherit it)."""
    old = os.environ.get("TUNEKIT_CACHE")
    path = tmp_path_factory.mktemp("tunekit-cache")
    os.environ["TUNEKIT_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TUNEKIT_CACHE", None)
    else:
        os.environ["TUNEKIT_CACHE"] = old


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """One CPU thread (unless OMP_NUM_THREADS says otherwise), here and in subprocesses: the models are too
    small to gain from more, and spinning OpenMP threads slow to a crawl on a busy machine."""
    old_env, old_threads = os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()
    threads = int(old_env or 1)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    yield
    torch.set_num_threads(old_threads)
    if old_env is None:
        os.environ.pop("OMP_NUM_THREADS", None)


@pytest.fixture(autouse=True)
def restore_torch_state():
    """Put back default dtype, RNG states, grad mode and thread count after each test."""
    dtype = torch.get_default_dtype()
    torch_rng = torch.get_rng_state()
    py_rng, np_rng = random.getstate(), np.random.get_state()
    grad = torch.is_grad_enabled()
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    yield
    torch.set_default_dtype(dtype)
    torch.set_rng_state(torch_rng)
    random.setstate(py_rng)
    np.random.set_state(np_rng)
    torch.set_grad_enabled(grad)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)


# ---- data ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def small_records() -> list[dict]:
    """The first 64 question/answer records of the project's arithmetic data."""
    return read_arith(64)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory, small_records) -> Path:
    """A 64-record JSONL file (read-only for tests: its mtime is part of the prepared-data key)."""
    return write_jsonl(tmp_path_factory.mktemp("data") / "small.jsonl", small_records)


@pytest.fixture(scope="session")
def tokenizer(small_data):
    """The offline BPE the tiny preset trains on the small data (cached in the session cache)."""
    from tunekit.data.records import load_records
    from tunekit.data.tokenizer import train_tokenizer
    from tunekit.prepare import training_texts

    return train_tokenizer(training_texts(load_records(str(small_data))), 1024)


@pytest.fixture
def make_cfg(tmp_path, small_data):
    """`make_cfg(name='run', **overrides)`: a tiny, fast config writing under tmp_path."""

    def make(name: str = "run", **overrides):
        kw = dict(out_dir=str(tmp_path / name), data=str(small_data), max_steps=4, batch_size=8,
                  max_length=128, warmup_steps=2, **SMALL_ARCH)
        kw.update(overrides)
        return tiny(**kw)

    return make
