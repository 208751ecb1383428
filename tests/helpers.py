"""Helpers the test files share (plain functions and constants; fixtures live in conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tunekit.config import REPO_ROOT

ARITH = REPO_ROOT / "data" / "arith" / "train.jsonl"
# Small architecture for every CPU test: 2 layers of width 64 train a step in milliseconds.
SMALL_ARCH = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)
SMALL_ARCH_ARGS = ["--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--intermediate-size", "128"]

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu(fn):
    """Mark a test GPU-only: deselected by default (`-m 'not gpu'`), skipped when no CUDA is visible."""
    return pytest.mark.gpu(cuda_only(fn))


def read_arith(n: int) -> list[dict]:
    with open(ARITH) as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
