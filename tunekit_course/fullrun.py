"""Whole runs measured across GPU commands (lesson 5): `tunekit train` in a run folder of its own, stopped with
SIGTERM before a command's time runs out (the run finishes its step and writes a checkpoint, as on Ctrl-C) and
resumed by the next command with `--resume`, until it is done.

Each segment is one process, timed from its start to its exit (Python's start, tokenizing or reading the data
back, building, compiling, the steps, checkpoints, held-out evaluations), and kept in the folder's
`segments.json`. The run's wall-clock is their sum: the time between commands is not counted. Once the run is
done, `result` makes one result file of it: the wall-clock, each segment, the held-out losses, and steady-state
real tokens/s (the steps after the first of each segment, which compiles and warms up). Nothing is projected.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from tunekit.io import atomic_write_json
from tunekit_course import runlog
from tunekit_course.cards import CARDS
from tunekit_course.runlog import (
    derived_fields,
    describe_fp8,
    done,
    logged_rows,
    segments,
    steady_vs,
)

EXIT_GRACE_S = 60.0  # how long a run that said its error may take to exit before it is killed

_STEP_LINE = re.compile(r"^step (\d+)/(\d+):")
_SHOWN: set[str] = set()  # the lines other than steps printed in this process (`for_the_page`)


def for_the_page():
    """A filter of one segment's output lines for the lesson's page (a whole run logs hundreds of steps; its
    metrics.jsonl keeps every one): a step line for the segment's first step, each tenth of the run and the last;
    any other line once per process, so the banner every run prints (its model, attention backend, dtype) shows
    once however many runs a lesson makes, and every line that differs shows."""
    first = True

    def keep(line: str) -> bool:
        nonlocal first
        if m := _STEP_LINE.match(line):
            step, total = int(m[1]), int(m[2])
            show = first or step == total or step % max(1, total // 10) == 0
            first = False
            return show
        if not line.strip():
            return True
        if line in _SHOWN:
            return False
        _SHOWN.add(line)
        return True

    return keep


def run_segment(folder: str | Path, args: list[str], budget_s: float, poll_s: float = 1.0,
                steps_s: float | None = None) -> dict:
    """One segment of the run `tunekit train ARGS` in `folder`: started, or resumed where the last segment
    stopped; once `budget_s` seconds have passed and it has logged a step of its own, it is sent SIGTERM (it
    finishes that step and writes a checkpoint). Streams its output, appends the segment to `segments.json` and
    returns it. A finished run is not run again. With `steps_s`, it is also stopped once its logged steps after
    its first span that many seconds (a waterfall bar's steady steps)."""
    folder = Path(folder)
    if done(folder):
        print(f"{folder.name}: finished already ({len(segments(folder))} segments)")
        return {}
    resume = (folder / "metrics.jsonl").exists()
    cmd = [sys.executable, "-m", "tunekit.cli", "train", *map(str, args), "--out-dir", str(folder),
           *(["--resume"] if resume else [])]
    before = len(logged_rows(folder))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stopped, failed = threading.Event(), []  # failed: when the child said its one-line error

    def watch():  # the budget spent and a step of this segment logged: stop at the end of the next step
        while proc.poll() is None:
            if failed and time.perf_counter() - failed[0] > EXIT_GRACE_S:
                proc.kill()  # it said its error and has not exited since (a worker pool holding it at exit)
                return
            rows = logged_rows(folder)[before:]
            spent = time.perf_counter() - t0 >= budget_s
            steady = steps_s is not None and len(rows) > 1 and rows[-1]["elapsed_s"] - rows[0]["elapsed_s"] >= steps_s
            if (spent or steady) and rows:
                stopped.set()
                proc.send_signal(signal.SIGTERM)
                return
            time.sleep(poll_s)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    from tunekit_course.notebook import tidy

    keep = for_the_page()
    for line in proc.stdout:
        if keep(line):
            print(tidy(line), end="")  # as the lessons print a command's output: no folder of this machine
        if line.startswith("tunekit train: error") and not failed:
            failed.append(time.perf_counter())
    code = proc.wait()
    wall = time.perf_counter() - t0
    watcher.join()
    rows = logged_rows(folder)
    if code != 0 and not stopped.is_set():
        raise RuntimeError(f"tunekit train in {folder} failed with exit code {code} (its output is above)")
    segment = {"wall_s": round(wall, 1), "resumed": resume, "stopped": stopped.is_set(), "exit_code": code,
               "first_step": rows[before]["step"] if len(rows) > before else None,
               "last_step": rows[-1]["step"] if rows else None, "finished": done(folder),
               "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    atomic_write_json(folder / "segments.json", [*segments(folder), segment])
    print(f"{folder.name}: segment {len(segments(folder))} in {wall:,.0f} s, steps {segment['first_step']}-"
          f"{segment['last_step']}" + (", run finished" if segment["finished"] else ", stopped: resume it next"))
    return segment


def _samples(folder: Path) -> int:
    return json.loads((folder / "data.json").read_text())["samples"]  # the samples of one epoch


def _summary(folder: Path) -> dict:  # the run's last word: its timings (start, data, build, first step, ...)
    return json.loads((folder / "summary.json").read_text())


def result(name: str, folder: str | Path) -> dict:
    """The result file of the finished run in `folder`: wall-clock added up over its segments, each segment, the
    held-out losses (step, loss) beside their baselines (`evaluate.run_baselines`), steady-state real tokens/s,
    peak memory, and the GPU that wrote it (`gpu_uuid`: its last segment's, where segments ran on several)."""
    from tunekit.config import TuneConfig
    from tunekit.results import code_file, new_result

    folder = Path(folder)
    if not done(folder):
        raise ValueError(f"{folder}: the run has not finished ({len(segments(folder))} segments so far); run "
                         "another segment first")
    segs, rows = segments(folder), logged_rows(folder)
    summary = _summary(folder)
    cfg = TuneConfig(**json.loads((folder / "config.json").read_text()))
    derived = derived_fields(rows, segs)
    from tunekit.evaluate import run_baselines

    # what the held-out loss means: uniform, unigram and bigram cross-entropy on the same held-out targets
    baselines = run_baselines(cfg) if (cfg.eval_data or cfg.eval_split) else None
    return new_result(
        name, cfg, derived.pop("tokens_per_s"), max(r["peak_mem_gb"] for r in rows),
        call=f"fullrun.result({name!r}, {folder.name!r})",
        code_files=(code_file(__file__), code_file(runlog.__file__)),
        wall_s=round(sum(s["wall_s"] for s in segs), 1),
        segments=segs, steps=summary["steps"], epochs_seen=summary.get("epochs_seen"),
        eval_losses=summary.get("eval_losses"), eval_loss=summary.get("eval_loss"),
        final_loss=summary.get("final_loss"), timings=summary.get("timings"), baselines=baselines, tokens_seen=summary.get("tokens_seen"),
        packing=summary.get("packing"), weights=cfg.model or "random-init",
        data=f"{cfg.data}: {cfg.epochs:g} epochs, whole; wall-clock summed over {len(segs)} segment(s) (the time "
             "between them not counted); tokens/s counts real tokens over the steps after each segment's first",
        **derived)


def rederive(folder: str | Path, header: dict, name: str | None = None) -> dict:
    """The result of the run in `folder`, brought back from the GPU machine, with the fields its logged rows give
    (`derived_fields`) computed again by this code: the measured part (GPU, versions, commit, date, wall-clock, losses)
    is `header`, the result the GPU machine wrote for this run. A run stopped before its end (its machine given
    back between commands, so it could not be resumed) has none: `header` is then a result of the same command
    or image, `name` names the run, and the file says `"whole": false` with the steps it reached. Records what
    was derived here and by which commit."""
    from tunekit.results import git_state

    folder = Path(folder)
    segs, rows = segments(folder), logged_rows(folder)
    whole = done(folder)
    r = {**header, **derived_fields(rows, segs), "timings": _summary(folder).get("timings") if whole else None}
    if not whole:  # nothing of the header's own run but its machine's description
        evals = [[row["step"], row["eval_loss"]] for row in rows if "eval_loss" in row]
        r.update(name=name or folder.name, whole=False, steps=rows[-1]["step"], segments=segs,
                 wall_s=round(sum(s["wall_s"] for s in segs), 1), eval_losses=evals,
                 eval_loss=evals[-1][1] if evals else None, final_loss=rows[-1]["loss"],
                 tokens_seen=rows[-1]["tokens"], epochs_seen=round(rows[-1]["samples"] / _samples(folder), 4),
                 peak_memory_gb=max(row["peak_mem_gb"] for row in rows),
                 config=json.loads((folder / "config.json").read_text()),
                 date=segs[-1]["date"] if segs else header["date"],
                 data=f"stopped at step {rows[-1]['step']}: its machine was given back before the next command, "
                      "so it could not be resumed; tokens/s and the curve are of the steps it ran")
        r["preset"] = r["config"].get("preset", r["preset"])
    r["derived"] = {"fields": ["tokens_per_s", "tok_per_s_p10_p90", "curve"], "commit": git_state()[0],
                    "call": f"fullrun.rederive({folder.name!r}, <{header['name']}>)",
                    **({} if whole else {"header_from": header["name"]})}
    return r


def run_folder(name: str) -> Path:
    """The folder of the whole run NAME: runs/full/NAME."""
    from tunekit_course import notebook

    return notebook.RUNS / "full" / name


def measure(name: str, args: list[str], budget_s: float) -> dict | None:
    """A segment of the whole run NAME (`tunekit train ARGS` in runs/full/NAME); once the run is done, its result
    saved to this GPU's results folder (`notebook.save`) and returned, else None: run `measure` again, in the
    next command, to go on."""
    from tunekit_course import notebook

    folder = run_folder(name)
    run_segment(folder, args, budget_s)
    if not done(folder):
        return None
    r = result(name, folder)
    notebook.save(r)
    return r


# ---- lesson 5's whole runs --------------------------------------------------------------------------------

# the tiny stand-in of a CPU smoke run: six steps, a tenth of the data held out and scored at the end
SMOKE = ["--preset", "tiny", "--max-steps", "6", "--max-length", "64", "--batch-size", "2", "--save-every", "0",
         "--eval-split", "0.1"]


def lesson5_runs(gpu: bool) -> list[tuple[str, list[str], dict]]:
    """Lesson 5's whole runs, in the order they are measured: (name, `tunekit train` arguments, environment):
    the article's before and its checklist (one epoch each), tunekit's recipe (three epochs), and tunekit's
    recipe on a 24 GB card (TUNEKIT_MEMORY_GB=24 caps the process; the speeds are this GPU's). The last drops
    FP8, whose two weight copies (one byte a weight each, ~13 GB at 7B) do not fit there, and is fitted at
    measure time (`notebook.fit_here`). In smoke mode: two tiny runs."""
    if not gpu:
        return [("l5_smoke_a", SMOKE, {}), ("l5_smoke_b", [*SMOKE, "--lr", "1e-3"], {})]
    return [("l5_article_before", ["--preset", "article_before"], {}),
            ("l5_article_checklist", ["--preset", "article_checklist"], {}),
            ("l5_tunekit", ["--preset", "tunekit_recipe"], {}),
            ("l5_tunekit_24gb", ["--preset", "tunekit_recipe", "--fp8", "false"], {"TUNEKIT_MEMORY_GB": "24"})]


def band_runs(gpu: bool) -> list[tuple[str, list[str], dict]]:
    """Whole runs of tunekit's recipe in bf16 and with FP8 base weights, at seeds 0 and 1, and FP8 with fast
    accumulation at both (`runlog.fp8_band`: whether FP8 learns within what changing the seed alone moves). Six
    runs of three epochs: about 22 minutes on an H100. In smoke mode: the tiny stand-ins, FP8 left off (it needs
    a GPU)."""
    from tunekit_course.runlog import BAND_ENV, BAND_RUNS

    if not gpu:
        return [(name, [*SMOKE, "--seed", str(seed)], {}) for name, _, seed in BAND_RUNS]
    return [(name, ["--preset", "tunekit_recipe", "--fp8", str(kind != "bf16").lower(), "--seed", str(seed)],
             BAND_ENV.get(kind, {})) for name, kind, seed in BAND_RUNS]


def model_folder(runs: list[tuple[str, list[str], dict]] | None = None) -> Path | None:
    """The folder of the whole run whose trained model lesson 5 looks at (generates with, scores, exports): the
    last of `runs` (default `lesson5_runs`) that finished here and kept its adapter, tunekit's recipe's where it
    did; None where no run folder is on this machine (results read back from another)."""
    from tunekit_course import notebook

    runs = lesson5_runs(notebook.on_gpu()) if runs is None else runs
    kept = [run_folder(name) for name, _, _ in runs if done(run_folder(name)) and (run_folder(name) / "adapter").is_dir()]
    tunekit = [f for f in kept if f.name.startswith("l5_tunekit")]
    return (tunekit or kept or [None])[0]


def result_path(name: str) -> Path:
    """Where the whole run NAME's result is on this GPU: your results folder (`notebook.results_dir`)."""
    from tunekit_course import notebook

    return notebook.results_dir() / f"{name}.json"


def measured(name: str) -> bool:
    """Whether the whole run NAME has a result on this GPU already (`result_path`): it is read back, not run
    again, unless TUNEKIT_REMEASURE=1 (as `notebook.measure` does)."""
    from tunekit_course import notebook

    return not notebook.remeasure() and result_path(name).exists()


def prepare() -> None:
    """What a user's first run downloads once and every later run reads from disk, made before lesson 5's timed
    whole runs (`measure_runs`) so that none of them pays for it: the tokenizer (trained on GSM8K here) and the
    random-init 7B checkpoint that QLoRA's 4-bit load reads (a hub model's weights, on a user's machine). Built
    from `article_before`: every whole run has its 7B shape and seed, so they share both."""
    import torch

    from tunekit import model as mdl
    from tunekit.build import run_arch
    from tunekit.prepare import build_tokenizer
    from tunekit.presets import article_before

    cfg = article_before()
    tokenizer = build_tokenizer(cfg)
    path = mdl.save_random_init(run_arch(cfg, len(tokenizer)), torch.bfloat16, cfg.seed)
    print(f"random-init weights for QLoRA's 4-bit load: {path.name} in the model cache")


def measure_runs(budget_s: float, runs: list[tuple[str, list[str], dict]] | None = None,
                 least_s: float = 120) -> list[str]:
    """Go on with lesson 5's whole runs for `budget_s` seconds: each unfinished run in turn gets a segment with
    the time left, until the budget is spent (the run under way then stops at a step's end and checkpoints) or
    every run is done; a run is not started or resumed with less than `least_s` left (starting a 7B run takes
    a minute before its first step). A run with a result on this GPU already is read back (`measured`). Run it
    again, in the next command, to go on. Returns the names of the runs done."""
    import os
    from unittest import mock

    from tunekit_course import notebook

    t0 = time.perf_counter()
    runs = lesson5_runs(notebook.on_gpu()) if runs is None else runs
    if notebook.replay_mode():  # the published results are read, nothing runs
        return [name for name, _, _ in runs if measured(name)]
    if notebook.on_gpu() and not all(measured(name) for name, _, _ in runs):
        prepare()  # what a user's first run downloads once: no timed run pays for it
    for name, args, env in runs:
        left = budget_s - (time.perf_counter() - t0)
        if measured(name):  # read back, and says so: from this GPU or copied in from another machine
            print(notebook.read_back(name, json.loads(result_path(name).read_text())))
            continue
        if done(run_folder(name)):
            continue
        if left < least_s:
            break
        with mock.patch.dict(os.environ, env):  # the child inherits it; fit_here reads TUNEKIT_MEMORY_GB too
            measure(name, notebook.fit_here(["train", *args])[1:], left)
    finished = [name for name, _, _ in runs if done(run_folder(name)) or measured(name)]
    print(f"whole runs done: {', '.join(finished) or 'none yet'}; "
          + ("all done" if len(finished) == len(runs) else "run this again to go on"))
    return finished


def summary(whole: dict[str, dict]) -> list[str]:
    """What lesson 5's whole runs found, one sentence a finding, every figure read from the results in `whole`
    ({name: result}, those measured here): the checklist against the before (the article's claim), tunekit's
    recipe against both, the 24 GB card, memory, and the held-out loss against its baselines. A run missing from
    `whole` is said to be missing, never filled in."""
    before, check = whole.get("l5_article_before"), whole.get("l5_article_checklist")
    tk, card = whole.get("l5_tunekit"), whole.get("l5_tunekit_24gb")

    def minutes(r: dict) -> str:
        return f"{r['wall_s'] / 60:.1f} min"

    def epochs(r: dict) -> str:
        n = round(r["epochs_seen"])
        return f"{n} epoch{'s' if n != 1 else ''}" if n else f"{r['epochs_seen']:.2f} of an epoch"

    def steady(r: dict) -> str:  # r's steady rate over the before's, its spread, and what 14 days become
        ratio, low, high, _ = steady_vs(r, before)
        spread = f" ({low:.1f}-{high:.1f}x)" if low is not None else ""
        return (f"{ratio:.1f}x{spread} the before's real tokens a second: at those rates a 14-day run of the "
                f"before's steps takes {14 / ratio:.1f} days (a projection from the measured rates)")

    out = []
    if before and check:
        first = check["curve"][0][3] if check.get("curve") else None
        out.append(f"The article's checklist, as written: {epochs(check)} in {minutes(check)} against the before's "
                   f"{minutes(before)}, {before['wall_s'] / check['wall_s']:.1f}x by wall-clock"
                   + (f", its first step ending {first:.0f} s into the run (the whole-model compile)" if first else "")
                   + f"; its steady steps ran {steady(check)}, where the article claims 3 ({14 / 3:.2f}x).")
    else:
        out.append("The checklist against the before (the article's claim) needs both whole runs: "
                   + ", ".join(n for n, r in (("l5_article_before", before), ("l5_article_checklist", check))
                               if r is None) + " not measured here.")
    if before and tk:
        per_epoch, before_epoch = tk["wall_s"] / tk["epochs_seen"], before["wall_s"] / before["epochs_seen"]
        out.append(f"tunekit's recipe: {epochs(tk)} in {minutes(tk)} ({per_epoch / 60:.1f} min an epoch on average, "
                   f"{before_epoch / per_epoch:.1f}x the before's epoch); steady {steady(tk)}"
                   + (f"; {tk['tokens_per_s'] / check['tokens_per_s']:.1f}x the checklist's rate (what the course "
                      "adds to the article)" if check else "") + ".")
    if tk and card:
        out.append(describe_fp8(tk, card) + ".")
        out.append(f"On a 24 GB card (this GPU capped at 24 GB; speeds are this GPU's): {epochs(card)} in "
                   f"{minutes(card)}, steady {card['tokens_per_s'] / tk['tokens_per_s']:.0%} of the whole card's rate, "
                   f"peak {card['peak_memory_gb']:.1f} GB.")
    peaks = [f"{name} {r['peak_memory_gb']:.1f} GB" for name, r in whole.items()]
    if peaks:
        out.append("Peak GPU memory: " + ", ".join(peaks) + ".")
    longest = max((r for r in whole.values() if r.get("eval_losses") and r.get("baselines")),
                  key=lambda r: len(r["eval_losses"]), default=None)
    if longest:
        b, last = longest["baselines"], longest["eval_losses"][-1][1]
        below = ("below the bigram baseline" if last < b["bigram"] else "between the unigram and bigram baselines"
                 if last < b["unigram"] else "above the unigram baseline")
        out.append(f"Held-out loss of {longest['name']} after {epochs(longest)}: {last:.2f} nats, {below} "
                   f"(uniform {b['uniform']:.2f}, unigram {b['unigram']:.2f}, bigram {b['bigram']:.2f}).")
    return out


def recipes_by_memory(cards=CARDS, preset: str = "tunekit_recipe") -> list[dict]:
    """What to run on each card of `cards` ((GB, a GPU with FP8, one without)): tunekit's recipe as it is where
    its estimated peak fits, else the nearest config that fits (`notebook.nearest_fit`, the estimator's), with
    FP8 base weights on a GPU that has FP8 matmuls and without on one that has not. Each row {gb, gpu, fp8,
    flags, estimate_gb, fits}: planned from the estimator, not measured (the lesson marks the two sizes its
    runs measured)."""
    from tunekit.estimate import Setup, estimate_memory_for
    from tunekit.presets import resolve
    from tunekit_course.notebook import nearest_fit

    rows = []
    for gb, with_fp8, without in cards:
        for gpu, fp8 in ((with_fp8, True), (without, False)):
            if gpu is None:
                continue
            rest = [f"--fp8={str(fp8).lower()}"]
            fit = nearest_fit(preset, rest, gb * 1e9, f"a card of {gb} GB")
            if fit is None:
                est = estimate_memory_for(Setup.of(resolve(preset, rest)))["total"]
                rows.append({"gb": gb, "gpu": gpu, "fp8": fp8, "flags": [], "estimate_gb": est / 1e9, "fits": True})
            else:
                flags, _, est = fit
                rows.append({"gb": gb, "gpu": gpu, "fp8": fp8, "flags": flags, "estimate_gb": est / 1e9,
                             "fits": bool(flags)})
    return rows


# ---- a run that outlives the command that started it -----------------------------------------------------

def main(argv: list[str]) -> int:
    # python -m tunekit_course.fullrun BUDGET_SECONDS [NAME,NAME]                      lesson 5's whole runs (or
    #   the FP8 band's by name: l5c_bf16_s0,l5c_fp8_s0,l5c_bf16_s1,l5c_fp8_s1,l5c_fp8fast_s0,l5c_fp8fast_s1)
    # python -m tunekit_course.fullrun NAME BUDGET_SECONDS TRAIN_ARGS...               one whole run's segment
    # python -m tunekit_course.fullrun --rederive FOLDER HEADER.json OUT.json [NAME]   a run brought back
    # (exit code 3: not all finished, go on in the next command; `tunekit_course.detach` runs any of these in a
    # process that outlives the command)
    from tunekit.results import save_result
    from tunekit_course.notebook import on_gpu

    gpu = on_gpu()
    if len(argv) in (1, 2) and argv[0].replace(".", "", 1).isdigit():
        runs = lesson5_runs(gpu)
        if len(argv) == 2:  # only these of them, lesson 5's or the FP8 band's (`band_runs`)
            runs += band_runs(gpu)
            wanted = argv[1].split(",")
            if unknown := set(wanted) - {name for name, _, _ in runs}:
                here = "" if gpu else " (no GPU here, or TUNEKIT_SMOKE=1: the tiny stand-ins)"
                print(f"unknown whole runs {sorted(unknown)}: choose from {', '.join(n for n, _, _ in runs)}{here}",
                      file=sys.stderr)
                return 2
            runs = [run for run in runs if run[0] in wanted]
        return 0 if len(measure_runs(float(argv[0]), runs, least_s=120 * gpu)) == len(runs) else 3
    if len(argv) in (4, 5) and argv[0] == "--rederive":
        folder, header, out, *name = argv[1:]
        print(save_result(rederive(folder, json.loads(Path(header).read_text()), *name), out))
        return 0
    if len(argv) < 3 or argv[0].startswith("--"):
        print("usage: python -m tunekit_course.fullrun BUDGET_SECONDS [NAME,...] | NAME "
              "BUDGET_SECONDS TRAIN_ARGS... (e.g. l5_mine 480 --preset article_before) | --rederive FOLDER "
              "HEADER.json OUT.json [NAME]", file=sys.stderr)
        return 2
    name, budget, *args = argv
    return 0 if measure(name, args, float(budget)) else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
