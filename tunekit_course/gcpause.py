"""How long Python's full garbage collections pause a training run, with and without the frozen heap
(`gc_freeze`, tunekit/speedups.py `frozen_heap`).

    python -m tunekit_course.gcpause [TRAIN_ARGS...]     `tunekit train` twice in scratch folders, --gc-freeze
                                                         true then false; each full collection's length

A full (generation-2) collection scans every object the collector tracks. A training process holds hundreds of
thousands that live as long as it does (modules, parameters, compiled graphs), so each one is a pause of a
step's order, every few dozen steps; with those objects frozen it scans only what the steps made. What this
prints is the pause of each full collection made while `tunekit train` ran (the setup's included: they come
first).
"""

from __future__ import annotations

import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path


def full_collections(train_args: list[str]) -> dict:
    """Run `tunekit train TRAIN_ARGS` in this process and time each full collection made meanwhile: {pauses_s
    (each one's length, in order), at_s (seconds into the run at each one's end)}."""
    from tunekit import cli

    pauses, at, started = [], [], {}
    t0 = time.perf_counter()

    def timer(phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            pauses.append(time.perf_counter() - started.pop("t"))
            at.append(time.perf_counter() - t0)

    gc.callbacks.append(timer)
    try:
        code = cli.main(["train", *train_args])
    finally:
        gc.callbacks.remove(timer)
    if code:
        raise RuntimeError(f"tunekit train {' '.join(train_args)} exited with {code}")
    return {"pauses_s": pauses, "at_s": at}


def compare(train_args: list[str]) -> dict[str, dict]:
    """`full_collections` of the same run with the frozen heap and without, each in a scratch folder of its own."""
    out = {}
    for freeze in (True, False):
        folder = Path(tempfile.mkdtemp(prefix="tunekit-gcpause-"))
        try:
            out[f"gc_freeze={str(freeze).lower()}"] = full_collections(
                [*train_args, "--out-dir", str(folder / "run"), f"--gc-freeze={str(freeze).lower()}"])
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return out


def main(argv: list[str]) -> int:
    args = argv or ["--preset", "tiny", "--num-layers", "32", "--grad-ckpt", "true", "--max-steps", "120",
                    "--save-every", "0", "--log-every", "20"]
    for name, r in compare(args).items():
        pauses = ", ".join(f"{p * 1000:.1f}" for p in r["pauses_s"])
        times = ", ".join(f"{t:.0f}" for t in r["at_s"])
        print(f"{name}: {len(r['pauses_s'])} full collections, ms each: {pauses or '-'}\n  ending at s: "
              f"{times or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
