"""Atomic writes and training checkpoints that resume exactly.

A checkpoint holds what a run needs to continue as if it had never stopped: the trainable weights (a
PEFT adapter, or the full state dict), the optimizer and scheduler, every RNG state, and the data position.
Everything is written into a temp folder and renamed into place only when complete (`atomic_output`,
which every folder or file the project writes goes through), and the `latest` pointer
is replaced atomically after that — a run killed mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

LATEST = "latest"


def _check_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create output directory {path}: {e.strerror}. Choose another --out-dir.") from None
    if not os.access(path, os.W_OK):
        raise OSError(f"output directory {path} is not writable. Choose another --out-dir or fix its permissions.")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_output(final: str | os.PathLike, keep_existing: bool = False):
    """Yield a temporary path beside `final` (`.<name>.<pid>.tmp`) to write a file or folder into. If the
    block finishes, rename it to `final`, replacing what is there — or, with `keep_existing` (caches), keeping
    a copy another process finished first. If the block raises, nothing is left behind."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    _remove(tmp)
    try:
        yield tmp
        if keep_existing and final.exists():
            return
        _remove(final)
        try:
            os.replace(tmp, final)
        except OSError:  # a folder another process renamed into place meanwhile
            if not (keep_existing and final.exists()):
                raise
    finally:
        _remove(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to a temp file beside `path`, fsync, then rename over `path`."""
    path = Path(path)
    _check_writable(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only the parameters that train: the adapter for LoRA, everything for full fine-tuning."""
    return {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(run_dir: str | os.PathLike, step: int, model, optimizer, scheduler, data_state: dict,
                    keep: int = 2) -> Path:
    """Write `run_dir/ckpt-<step>/` atomically and point `run_dir/latest` at it. Keeps the newest `keep`."""
    run_dir = Path(run_dir)
    _check_writable(run_dir)
    final = run_dir / f"ckpt-{step:07d}"
    with atomic_output(final) as tmp:
        tmp.mkdir()
        torch.save(trainable_state_dict(model), tmp / "trainable.pt")
        if hasattr(model, "peft_config"):  # also a standard PEFT adapter folder, loadable with PeftModel
            model.save_pretrained(tmp / "adapter")
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "rng": rng_state(), "data": data_state, "step": step}, tmp / "state.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, "data": data_state}) + "\n")
    atomic_write_text(run_dir / LATEST, final.name + "\n")
    old = sorted(p for p in run_dir.glob("ckpt-*") if p.is_dir() and p != final)
    for p in old[: max(0, len(old) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    run_dir = Path(run_dir)
    pointer = run_dir / LATEST
    if not pointer.exists():
        return None
    path = run_dir / pointer.read_text().strip()
    if not (path / "state.pt").exists():
        raise FileNotFoundError(f"{pointer} points at {path}, which is missing or incomplete. "
                                f"Delete {pointer} to start over, or point it at an existing ckpt-* folder.")
    return path


def load_checkpoint(path: str | os.PathLike, model, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, scheduler and RNG from `path`; return the saved data state and step."""
    path = Path(path)
    trainable = torch.load(path / "trainable.pt", map_location="cpu", weights_only=True)
    params = dict(model.named_parameters())
    missing = [n for n in trainable if n not in params]
    if missing:
        raise ValueError(f"{path}: checkpoint has parameters the model lacks ({missing[:3]}...). "
                         "Was it written with another model or method?")
    with torch.no_grad():
        for n, t in trainable.items():
            params[n].copy_(t)
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return {"step": state["step"], "data": state["data"]}
