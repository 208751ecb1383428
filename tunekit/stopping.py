"""Stopping without losing work: a run that diverges, a run stopped by a signal, and the files that say
what it did (the metrics rows, written one line a step). `train.train` uses these; read the loop there.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

from tunekit import checkpoint
from tunekit.io import check_writable

# What stops a run as Ctrl-C does: SIGINT, SIGTERM (a scheduler, `kill`, a spot GPU taken away) and SIGHUP (the
# SSH session to a rented GPU closed, the commonest way a run dies there, and by default an instant death).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Diverged(FloatingPointError):
    """The loss or the gradient norm stopped being finite; the metrics row of that step was written."""


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP stopped the run at `step` (the last step finished); `checkpoint` is what a resume
    continues from (None: it starts over); `what` says what happened to the step and the checkpoint."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, what: str):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"interrupted by {signal.Signals(signum).name} {what}")


def json_line(row: dict) -> str:
    """One metrics row; a non-finite number becomes null, since NaN/Infinity are not JSON."""
    clean = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in row.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


@contextlib.contextmanager
def stop_requests(progress: dict):
    """Catch SIGINT, SIGTERM and SIGHUP for the run. Before training starts a signal stops at once (nothing has been
    written). Once `progress["started"]`, the first one only sets `progress["signal"]`: the loop finishes its
    step, writes a checkpoint and raises `Interrupted`; a second one raises at once, abandoning the step.
    Outside the main thread signals cannot be caught, and nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield progress
        return

    def handler(signum, frame):
        if signum == getattr(signal, "SIGHUP", None):
            hung_up()
        if progress["started"] and progress["signal"] is None:
            progress["signal"] = signum
            return
        step, ckpt = progress["step"], progress["checkpoint"]
        what = (f"at step {step}, abandoning the step under way; last checkpoint: {ckpt or 'none'}"
                if progress["started"] else "before training started; the run folder is as it was")
        raise Interrupted(signum, step, ckpt, what)

    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield progress
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def hung_up() -> None:
    """The terminal is gone (SIGHUP): what is still printed to it goes nowhere, instead of failing with EIO in
    the middle of the last step or of writing its checkpoint. Output sent to a file keeps going there."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            gone = stream is not None and stream.isatty()
        except (OSError, ValueError):
            gone = True
        if gone:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the process


def no_space_message(error: BaseException, folder: str | Path) -> str | None:
    """One line for a write that failed because the disk is full (an OSError ENOSPC, safetensors' or torch's
    own wording of it), naming `folder`, its free space and what the run's newest checkpoint took; None for
    any other error."""
    seen, e = [], error
    while e is not None and e not in seen:  # the error and what caused it
        seen.append(e)
        e = e.__cause__ or e.__context__
    text = " ".join(str(x) for x in seen)
    full = any(getattr(x, "errno", None) == errno.ENOSPC for x in seen) or "No space left on device" in text
    # torch.save's zip writer says only "file write failed" (inline_container.cc): full if the disk is
    full = full or ("file write failed" in text and _free_bytes(folder) < 64 << 20)
    if not full:
        return None
    newest = checkpoint.checkpoints(folder)
    need = (f"; a checkpoint of this run takes {_size(newest[-1]) / 1e9:.2f} GB" if newest else "")
    return (f"no space left on the device holding {folder} ({_free_bytes(folder) / 1e9:.2f} GB free{need}). "
            "What was written before stays as it was: free some space, or choose another folder")


def _free_bytes(folder: str | Path) -> int:
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def on_terminal() -> bool:
    return sys.stdout.isatty() and sys.stderr.isatty()


@contextlib.contextmanager
def removed_if_left_empty(run_dir: Path):
    """Create `run_dir` (checking that it can be written) and, if the run fails to start, leave no empty
    folder behind."""
    created = not run_dir.exists()
    check_writable(run_dir)
    try:
        yield
    finally:
        if created and run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()


def read_metrics_file(path: Path) -> list[dict]:
    """The rows of a metrics file. A half-written last row (a run killed while writing it) is left out; any
    other row that is not a JSON object with a step is an error naming the file and the line."""
    if not path.exists():
        return []
    text = path.read_bytes().decode("utf-8", errors="replace")  # a damaged byte fails on its own line below
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    rows = []
    for i, (lineno, line) in enumerate(lines):
        try:
            row = json.loads(line)
            problem = None if isinstance(row, dict) and isinstance(row.get("step"), int) else "no JSON object with a step"
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # the last row of a run killed while writing it
                break
            problem = f"{e.msg} at column {e.colno}"
        if problem:
            raise ValueError(f"{path}:{lineno}: not a metrics row ({problem}): the run's history is damaged. Restore "
                             "the file, or delete that line (its step then has no row).")
        rows.append(row)
    return rows


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The metrics rows of a run, for plotting."""
    return read_metrics_file(Path(run_dir) / "metrics.jsonl")
