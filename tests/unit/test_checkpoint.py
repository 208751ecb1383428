"""Checkpoints that say when they are damaged: a sha256 recorded for every file, checked on load, a fall back
to the newest checkpoint that verifies, and the run folder's housekeeping (leftover temps, what a run is)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re

import pytest
from helpers import small_model

from tunekit import checkpoint, config
from tunekit.optim import build_optimizer, build_scheduler
from tunekit.presets import tiny


def parts():
    """(model, optimizer, scheduler) of a small LoRA model: the same parameter names every call."""
    model = small_model(300, "lora")
    opt = build_optimizer(model, 1e-3, 0.0, "cpu")
    return model, opt, build_scheduler(opt, 2, 10, 0.1)


def save(run, step: int, pieces) -> object:
    return checkpoint.save_checkpoint(run, step, *pieces, {"epoch": 0, "next_batch": step}, keep=5)


def flip(raw: bytes, n: int = 64) -> bytes:
    mid = len(raw) // 2
    return raw[:mid] + bytes(b ^ 0xFF for b in raw[mid:mid + n]) + raw[mid + n:]


DAMAGE = {
    "truncated": lambda raw: raw[: len(raw) // 2],
    "empty": lambda raw: b"",
    "zero-filled": lambda raw: bytes(len(raw)),
    "64 flipped bytes": flip,
}
FILES = ["trainable.safetensors", "state.pt", "adapter/adapter_model.safetensors"]


def test_every_file_is_recorded_with_its_sha256(tmp_path):
    path = save(tmp_path, 2, parts())
    files = json.loads((path / checkpoint.META).read_text())["files"]
    on_disk = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} - {checkpoint.META}
    assert set(files) == on_disk and set(FILES) <= on_disk
    for name, record in files.items():
        raw = (path / name).read_bytes()
        assert record == {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}, name
    assert checkpoint.verify_checkpoint(path) is None


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("name", FILES)
def test_a_damaged_file_is_named_and_the_older_checkpoint_taken(tmp_path, damage, name):
    pieces = parts()
    older, newer = save(tmp_path, 2, pieces), save(tmp_path, 4, pieces)
    bad = newer / name
    bad.write_bytes(DAMAGE[damage](bad.read_bytes()))
    problem = checkpoint.verify_checkpoint(newer)
    assert problem and problem.startswith(str(bad))
    assert checkpoint.find_checkpoint(tmp_path) == (older, [problem])
    assert checkpoint.latest_checkpoint(tmp_path) == older
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(str(bad))):  # named, not torch's EOFError
        checkpoint.load_checkpoint(newer, *parts())
    assert checkpoint.load_checkpoint(older, *parts())["step"] == 2


def test_an_unfinished_or_garbled_meta_json(tmp_path):
    pieces = parts()
    first, second = save(tmp_path, 2, pieces), save(tmp_path, 4, pieces)
    (second / checkpoint.META).unlink()
    assert "never finished" in checkpoint.verify_checkpoint(second)
    (first / checkpoint.META).write_text('{"step": 2, "files": {"trainable.safetensors": ')
    assert "unreadable" in checkpoint.verify_checkpoint(first)
    found, problems = checkpoint.find_checkpoint(tmp_path)
    assert found is None and len(problems) == 2


def test_a_meta_json_without_its_file_list_is_refused(tmp_path):
    """Checkpoints from before checksums (or a meta.json edited) cannot be checked, so they are not loaded:
    what is not checked could be anything (tests/unit/test_security.py)."""
    path = save(tmp_path, 2, parts())
    meta = json.loads((path / checkpoint.META).read_text())
    (path / checkpoint.META).write_text(json.dumps({"step": meta["step"], "data": meta["data"]}))
    problem = checkpoint.verify_checkpoint(path)
    assert problem.startswith(f"{path / checkpoint.META} lists no files")
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(str(path / checkpoint.META))):
        checkpoint.load_checkpoint(path, *parts())


def test_the_newest_by_step_whatever_latest_says(tmp_path):
    pieces = parts()
    save(tmp_path, 2, pieces)
    newest = save(tmp_path, 10, pieces)
    (tmp_path / checkpoint.LATEST).write_text("ckpt-0000002\n")  # a kill between the rename and the pointer
    assert checkpoint.latest_checkpoint(tmp_path) == newest
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["ckpt-0000002", "ckpt-0000010"]


def test_clean_temp_removes_only_what_killed_writes_left(tmp_path):
    half = tmp_path / ".ckpt-0000004.4242.tmp"
    half.mkdir()
    (half / "trainable.pt").write_bytes(b"half")
    for name in (".latest.x1y2z3.tmp", ".metrics.jsonl.abc.tmp"):
        (tmp_path / name).write_text("partial")
    keep = [tmp_path / "ckpt-0000002", tmp_path / "prepared", tmp_path / "notes.txt"]
    keep[0].mkdir()
    keep[1].mkdir()
    (keep[1] / ".dataset.77.tmp").write_text("another process's, one level down")
    keep[2].write_text("mine")
    removed = checkpoint.clean_temp(tmp_path)
    assert removed == [".ckpt-0000004.4242.tmp", ".latest.x1y2z3.tmp", ".metrics.jsonl.abc.tmp"]
    assert all(p.exists() for p in keep) and (keep[1] / ".dataset.77.tmp").exists()
    assert checkpoint.clean_temp(tmp_path) == [] and checkpoint.clean_temp(tmp_path / "absent") == []


def test_what_counts_as_a_run_and_what_overwrite_removes(tmp_path):
    assert checkpoint.run_contents(tmp_path / "absent") == []
    (tmp_path / "prepared").mkdir()  # tokenized data alone is a cache, not a run
    assert checkpoint.run_contents(tmp_path) == []
    for name in ("config.json", "metrics.jsonl", checkpoint.LATEST):
        (tmp_path / name).write_text("x")
    for name in ("adapter", "ckpt-0000002", "ckpt-0000010"):
        (tmp_path / name).mkdir()
    expected = ["config.json", "metrics.jsonl", checkpoint.LATEST, "adapter", "ckpt-0000002", "ckpt-0000010"]
    assert checkpoint.run_contents(tmp_path) == expected
    assert checkpoint.remove_run(tmp_path) == expected
    assert [p.name for p in tmp_path.iterdir()] == ["prepared"]


def test_resume_config_check(tmp_path):
    saved = tiny(out_dir=str(tmp_path), device="auto", dtype="auto")  # as runs before this check saved it
    config.save_config(saved, tmp_path / "config.json")
    resolved = dataclasses.replace(saved, device="cpu", dtype="fp32", out_dir="elsewhere/spelled/otherwise")
    assert checkpoint.check_resume_config(tmp_path, resolved, allow_change=False) == []
    with pytest.raises(config.ConfigError, match=r"lr: 0.003 -> 0.001\n.*lr cannot change"):
        checkpoint.check_resume_config(tmp_path, dataclasses.replace(resolved, lr=1e-3), allow_change=True)
    longer = dataclasses.replace(resolved, max_steps=300, num_workers=2)
    with pytest.raises(config.ConfigError, match="--allow-config-change"):
        checkpoint.check_resume_config(tmp_path, longer, allow_change=False)
    assert sorted(checkpoint.check_resume_config(tmp_path, longer, allow_change=True)) == [
        "max_steps: 150 -> 300", "num_workers: 0 -> 2"]
    (tmp_path / "config.json").unlink()
    assert checkpoint.check_resume_config(tmp_path, longer, allow_change=False) == []  # nothing to resume
    (tmp_path / "ckpt-0000002").mkdir()
    with pytest.raises(config.ConfigError, match="no config.json"):
        checkpoint.check_resume_config(tmp_path, longer, allow_change=False)
