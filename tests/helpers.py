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


def offline_failure(monkeypatch, load) -> str:
    """With HF_HUB_OFFLINE=1 (set after import, as a notebook would), `load()` of a name the cache lacks must
    fail with an OSError within 5 s (not tens of seconds of retries); returns its message."""
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(OSError) as e:  # mdl.HubError, a ConnectionError: the CLI prints it as one line
        load()
    assert time.perf_counter() - start < 5
    return str(e.value)


def read_arith(n: int) -> list[dict]:
    with open(ARITH) as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def small_model(vocab: int, method: str = "lora", ckpt: bool = False, offload: bool = False,
                cast_input: bool = True):
    """A SMALL_ARCH random-init Llama; with method='lora', rank-4 adapters whose B is random (peft starts it
    at zero, which would make every adapter-A gradient zero and hide a wrong one)."""
    from tunekit import memory
    from tunekit import model as mdl

    model = mdl.build_model(mdl.llama_config(vocab_size=vocab, **SMALL_ARCH), seed=0)
    if method == "lora":
        torch.manual_seed(1)
        model = mdl.apply_lora(model, r=4, alpha=8, cast_input=cast_input)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
    if ckpt:
        memory.apply_gradient_checkpointing(model, offload=offload)
    return model
