"""How long Python's full garbage collections pause a training run, with and without the frozen heap
(`gc_freeze`, tunekit/speedups.py `frozen_heap`).

    python -m tunekit_course.gcpause [--out RESULT.json] [TRAIN_ARGS...]
        `tunekit train` twice in scratch folders, --gc-freeze true then false: each full collection's length, and
        each run's steady speed with the two read step for step (`steady`); --out saves that as a result file

A full (generation-2) collection scans every object the collector tracks. A training process holds hundreds of
thousands that live as long as it does (modules, parameters, compiled graphs), so each one is a pause of a
step's order, every few dozen steps; with those objects frozen it scans only what the steps made. What this
prints is the pause of each full collection made while `tunekit train` ran (the setup's included: they come
first).

Whether the pauses cost a GPU run anything is the steady speed's to say: both runs train on the same batches in
the same order, so their step times are read in pairs (`steady`), and a difference inside the pairs' spread is no
effect shown. The losses must be equal: freezing changes what the collector scans, not what is computed.
"""

from __future__ import annotations

import gc
import itertools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tunekit.stopping import read_metrics_file
from tunekit_course.runlog import p10_p90


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
    """`full_collections` of the same run with the frozen heap and without, each in a scratch folder of its own,
    with the rows each logged (`rows`) and its config (`config`)."""
    out = {}
    for freeze in (True, False):
        folder = Path(tempfile.mkdtemp(prefix="tunekit-gcpause-"))
        try:
            run = folder / "run"
            r = full_collections([*train_args, "--out-dir", str(run), f"--gc-freeze={str(freeze).lower()}"])
            r["rows"] = read_metrics_file(run / "metrics.jsonl")
            r["config"] = json.loads((run / "config.json").read_text())
            out[f"gc_freeze={str(freeze).lower()}"] = r
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return out


def steady(on: list[dict], off: list[dict]) -> dict:
    """Two runs of the same batches read against each other, from their logged rows (`metrics.jsonl`): each one's
    steady real tokens/s over its rows after the first (which compiles and warms up), and the time of each logged
    stretch with the frozen heap over the same stretch without (10th, 50th, 90th percentile: below 1, frozen is
    faster; a ratio whose spread holds 1 shows no effect); whether every logged loss is equal."""
    def stretches(rows):
        return [(b["elapsed_s"] - a["elapsed_s"], b["tokens"] - a["tokens"]) for a, b in itertools.pairwise(rows)]

    if [r["step"] for r in on] != [r["step"] for r in off] or len(on) < 3:
        raise ValueError("the two runs logged different steps (or fewer than 3 rows): not the same run twice")
    a, b = stretches(on), stretches(off)
    ratios = sorted(x[0] / y[0] for x, y in zip(a, b) if y[0] > 0)
    lo, hi = p10_p90(ratios)
    return {"steps": on[-1]["step"], "stretches": len(ratios),
            "tok_per_s": {"gc_freeze=true": sum(t for _, t in a) / sum(s for s, _ in a),
                          "gc_freeze=false": sum(t for _, t in b) / sum(s for s, _ in b)},
            "time_ratio_p10_p50_p90": [lo, ratios[len(ratios) // 2], hi],
            "no_effect_shown": lo <= 1.0 <= hi,
            "losses_equal": [r["loss"] for r in on] == [r["loss"] for r in off]}


def main(argv: list[str]) -> int:
    out = None
    if argv[:1] == ["--out"]:
        if len(argv) < 2:
            print("usage: python -m tunekit_course.gcpause [--out RESULT.json] [TRAIN_ARGS...]", file=sys.stderr)
            return 2
        out, argv = argv[1], argv[2:]
    args = argv or ["--preset", "tiny", "--num-layers", "32", "--grad-ckpt", "true", "--max-steps", "120",
                    "--save-every", "0", "--log-every", "20"]
    runs = compare(args)
    for name, r in runs.items():
        pauses = ", ".join(f"{p * 1000:.1f}" for p in r["pauses_s"])
        times = ", ".join(f"{t:.0f}" for t in r["at_s"])
        print(f"{name}: {len(r['pauses_s'])} full collections, ms each: {pauses or '-'}\n  ending at s: "
              f"{times or '-'}")
    s = steady(runs["gc_freeze=true"]["rows"], runs["gc_freeze=false"]["rows"])
    lo, mid, hi = s["time_ratio_p10_p50_p90"]
    print(f"steady: {s['tok_per_s']['gc_freeze=true']:,.0f} real tok/s frozen, {s['tok_per_s']['gc_freeze=false']:,.0f}"
          f" not; a stretch's time frozen over not {mid:.3f} ({lo:.3f}-{hi:.3f} over {s['stretches']} stretches)"
          f"{': no effect shown' if s['no_effect_shown'] else ''}; losses {'equal' if s['losses_equal'] else 'DIFFER'}")
    if out:
        from tunekit.config import TuneConfig
        from tunekit.results import code_file, new_result, save_result

        on = runs["gc_freeze=true"]
        result = new_result("gc_freeze_ab", TuneConfig(**on["config"]), s["tok_per_s"]["gc_freeze=true"],
                            max(r.get("peak_mem_gb") or 0 for r in on["rows"]),
                            call=f"gcpause.main({['--out', out, *argv]!r})", code_files=(code_file(__file__),),
                            steady=s, pauses_s={k: r["pauses_s"] for k, r in runs.items()})
        print(f"result -> {save_result(result, out)}")
    return 0 if s["losses_equal"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
