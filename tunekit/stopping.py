"""Stopping without losing work: a run that diverges, a run stopped by a signal, and the files that say
what it did (the metrics rows, written one line a step). `train.train` uses these; read the loop there.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import threading
from pathlib import Path

from tunekit import checkpoint


class Diverged(FloatingPointError):
    """The loss or the gradient norm stopped being finite; the metrics row of that step was written."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run at `step` (the last step finished); `checkpoint` is what a resume
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
    """Catch SIGINT and SIGTERM for the run. Before training starts a signal stops at once (nothing has been
    written). Once `progress["started"]`, the first one only sets `progress["signal"]`: the loop finishes its
    step, writes a checkpoint and raises `Interrupted`; a second one raises at once, abandoning the step.
    Outside the main thread signals cannot be caught, and nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield progress
        return

    def handler(signum, frame):
        if progress["started"] and progress["signal"] is None:
            progress["signal"] = signum
            return
        step, ckpt = progress["step"], progress["checkpoint"]
        what = (f"at step {step}, abandoning the step under way; last checkpoint: {ckpt or 'none'}"
                if progress["started"] else "before training started; the run folder is as it was")
        raise Interrupted(signum, step, ckpt, what)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield progress
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def on_terminal() -> bool:
    return sys.stdout.isatty() and sys.stderr.isatty()


@contextlib.contextmanager
def removed_if_left_empty(run_dir: Path):
    """Create `run_dir` (checking that it can be written) and, if the run fails to start, leave no empty
    folder behind."""
    created = not run_dir.exists()
    checkpoint._check_writable(run_dir)
    try:
        yield
    finally:
        if created and run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()


def read_metrics_file(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = [json.loads(line) for line in lines[:-1]]
    try:
        rows += [json.loads(line) for line in lines[-1:]]
    except json.JSONDecodeError:  # the last row of a run killed while writing it
        pass
    return rows


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The metrics rows of a run, for plotting."""
    return read_metrics_file(Path(run_dir) / "metrics.jsonl")
