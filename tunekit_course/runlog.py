"""What a whole run's folder and result say (lesson 5's runs and its waterfall's bars): the rows `tunekit train`
logged, the segments it ran in, steady real tokens/s and its spread, the elapsed minutes of each logged row, and two
results read against each other (steady rates, FP8 against bf16). Nothing here runs anything: `fullrun` runs the
whole runs and `waterfall` the bars, and the claims and charts read their results through these.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from tunekit.stopping import read_metrics_file


def logged_rows(folder: Path) -> list[dict]:
    """The rows the run in `folder` logged (`metrics.jsonl`), oldest first; none before its first step."""
    path = folder / "metrics.jsonl"
    return read_metrics_file(path) if path.exists() else []


def done(folder: Path) -> bool:
    """Whether the run in `folder` finished (its summary is written last, after the final checkpoint)."""
    return (folder / "summary.json").exists()


def segments(folder: Path) -> list[dict]:
    """The segments run so far in `folder` (`segments.json`), oldest first."""
    path = Path(folder) / "segments.json"
    return json.loads(path.read_text()) if path.exists() else []


def _steady_rows(rows: list[dict], firsts: set[int]) -> list[tuple[dict, dict]]:
    # (previous row, row) for each logged row but each segment's first (it compiles and warms up)
    return [(prev, row) for prev, row in itertools.pairwise(rows) if row["step"] not in firsts]


def steady_tokens_per_s(rows: list[dict], firsts: set[int]) -> float:
    """Real tokens per second of the training steps, leaving out each segment's first step (`firsts`: it
    compiles and warms up): the tokens between consecutive rows over the steps' own time (each row's tokens/s
    is over its steps alone, without the held-out evaluations, which the wall-clock counts)."""
    pairs = _steady_rows(rows, firsts)
    tokens = sum(row["tokens"] - prev["tokens"] for prev, row in pairs)
    seconds = sum((row["tokens"] - prev["tokens"]) / row["tok_per_s"] for prev, row in pairs if row["tok_per_s"])
    return tokens / seconds if seconds > 0 else 0.0


def p10_p90(values: list[float]) -> tuple[float, float]:
    """The 10th and 90th percentile of `values` (some), as the lessons report a spread."""
    values = sorted(values)
    return values[len(values) // 10], values[9 * len(values) // 10]


# what decides a run's batches and their order: two runs that agree on these (and on the tokens they saw) trained
# on the same batches, step for step
BATCHING = ("data", "seed", "batch_size", "grad_accum", "max_length", "packing", "epochs", "max_steps")


def same_batching(a: dict, b: dict, ignore: tuple[str, ...] = ()) -> bool:
    """Whether results `a` and `b` agree on every field of `BATCHING` but those of `ignore` (the length of a run
    changes where it stops, not which batches come first)."""
    mine, theirs = a.get("config") or {}, b.get("config") or {}
    return all(mine.get(k) == theirs.get(k) for k in BATCHING if k not in ignore)


def steady_vs(run: dict, base: dict) -> tuple[float, float | None, float | None, str]:
    """`run`'s steady real tokens/s over `base`'s, as (ratio, low, high, how the spread was taken). Where the two
    trained on the same batches in the same order (`BATCHING` and the tokens seen agree: recipes that leave the
    batching alone), the spread is the 10th-90th percentile of the step-by-step ratios, each step against the
    same step of the other, a segment's first step (the compile's) left out; otherwise it is each run's own
    10th-90th percentile, lowest over highest and highest over lowest. No spread (None) where neither is known."""
    ratio = run["tokens_per_s"] / base["tokens_per_s"]
    if run.get("tokens_seen") == base.get("tokens_seen") and same_batching(run, base):
        firsts = {s.get("first_step") for r in (run, base) for s in r.get("segments") or []}
        other = {row[0]: row[2] for row in base.get("curve") or []}
        steps = [row[2] / other[row[0]] for row in run.get("curve") or []
                 if row[0] not in firsts and other.get(row[0]) and row[2]]
        if len(steps) > 2:
            low, high = p10_p90(steps)
            return ratio, low, high, f"step by step over the same {len(steps)} steps, 10th-90th percentile"
    if run.get("tok_per_s_p10_p90") and base.get("tok_per_s_p10_p90"):
        (low, high), (b_low, b_high) = run["tok_per_s_p10_p90"], base["tok_per_s_p10_p90"]
        return ratio, low / b_high, high / b_low, "from each run's own 10th-90th percentile: other batches"
    return ratio, None, None, "no spread recorded"


def derived_fields(rows: list[dict], segs: list[dict]) -> dict:
    """What a run's logged rows give: steady tokens/s, the 10th-90th percentile of the rows' tokens/s (the
    spread within the run), and the curve the lesson draws ([step, loss, tokens/s, seconds since the
    segment's start], one a logged row)."""
    firsts = {s["first_step"] for s in segs if s["first_step"] is not None}
    per = sorted(row["tok_per_s"] for _, row in _steady_rows(rows, firsts))
    return {"tokens_per_s": round(steady_tokens_per_s(rows, firsts), 1),
            "tok_per_s_p10_p90": list(p10_p90(per)) if per else None,
            "curve": [[r["step"], round(r["loss"], 4), r["tok_per_s"], r["elapsed_s"]] for r in rows]}


def elapsed_minutes(r: dict) -> list[float]:
    """The minutes since the run's start at each row of result `r`'s curve: a row's seconds since its segment
    started, plus the wall-clock of the segments before it (the time between commands not counted)."""
    offsets, before = [], 0.0
    for seg in r.get("segments") or []:
        offsets.append((seg.get("first_step") or 0, before))
        before += seg["wall_s"]
    out = []
    for step, _, _, elapsed in r.get("curve") or []:
        offset = max((o for first, o in offsets if first <= step), default=0.0)
        out.append((offset + elapsed) / 60)
    return out


def fp8_vs_bf16(fp8: dict, bf16: dict, window: int = 20) -> dict | None:
    """Whether FP8 base weights learn as bf16 does, from two runs of tunekit's recipe on the same batches (the
    24 GB run is the recipe without FP8, with checkpointing and the same samples a step): the training losses
    step by step, each averaged over `window` steps (one step's loss wobbles with its batch), their largest and
    last gaps, and the held-out loss after each epoch both reached. None where the two did not train on the same
    batches (`BATCHING`); the gaps None where they share fewer than `window` steps."""
    if not same_batching(fp8, bf16, ignore=("epochs", "max_steps")):
        return None
    a, b = ({row[0]: row[1] for row in r.get("curve") or []} for r in (fp8, bf16))
    steps = sorted(set(a) & set(b))
    theirs_eval = dict(bf16.get("eval_losses") or [])
    evals = [(step, loss, theirs_eval[step]) for step, loss in fp8.get("eval_losses") or [] if step in theirs_eval]
    if len(steps) < window:
        return {"steps": len(steps), "window": window, "largest_gap": None, "last_gap": None, "held_out": evals}

    def smooth(losses: dict) -> list[float]:
        values = [losses[s] for s in steps]
        return [sum(values[i - window + 1:i + 1]) / window for i in range(window - 1, len(values))]

    gaps = [x - y for x, y in zip(smooth(a), smooth(b))]
    return {"steps": len(steps), "window": window, "largest_gap": max(gaps, key=abs), "last_gap": gaps[-1],
            "held_out": evals}


def describe_fp8(fp8: dict, bf16: dict) -> str:
    """`fp8_vs_bf16` as a sentence for the lesson, or why it cannot be said."""
    c = fp8_vs_bf16(fp8, bf16)
    if c is None:
        return f"FP8 against bf16: {fp8['name']} and {bf16['name']} did not train on the same batches"
    held = "; ".join(f"after step {s}: FP8 {x:.3f}, bf16 {y:.3f} nats" for s, x, y in c["held_out"])
    if c["largest_gap"] is None:
        return (f"FP8 against bf16: {fp8['name']} and {bf16['name']} share {c['steps']} logged steps, too few to "
                "compare their losses" + (f"; held-out loss {held}" if held else ""))
    return (f"FP8 base weights against bf16 on the same batches ({fp8['name']} against {bf16['name']}, "
            f"{c['steps']} steps): the training losses, each a {c['window']}-step mean, differ by at most "
            f"{abs(c['largest_gap']):.3f} nats (FP8 {'higher' if c['largest_gap'] > 0 else 'lower'}), "
            f"{c['last_gap']:+.3f} at the last step" + (f"; held-out loss {held}" if held else ""))


# the whole runs of tunekit's recipe that FP8 is judged by (`fp8_band`; `fullrun.band_runs` makes them):
# (result name, base weights, seed). "fp8": the input gradient's FP8 matmul accumulating at full precision
# (TUNEKIT_FP8_FAST_ACCUM=0), "fp8fast": fast (`fastlora.FAST_ACCUM_BACKWARD`, the default since these runs),
# each judged against the same bf16 runs.
BAND_RUNS = tuple((f"l5c_{kind}_s{seed}", kind, seed) for kind, seed in (("bf16", 0), ("fp8", 0), ("bf16", 1),
                                                                        ("fp8", 1), ("fp8fast", 0), ("fp8fast", 1)))
BAND_KINDS = {"bf16": "bf16", "fp8": "FP8", "fp8fast": "FP8, fast accumulation"}
FP8_KINDS = ("fp8", "fp8fast")  # each judged against the bf16 runs on its own
BAND_ENV = {"fp8": {"TUNEKIT_FP8_FAST_ACCUM": "0"}, "fp8fast": {"TUNEKIT_FP8_FAST_ACCUM": "1"}}  # each kind's env


def fp8_kind(fast_accum: bool) -> str:
    """The `BAND_RUNS` kind of FP8 runs whose input gradients accumulate fast (`fast_accum`) or at full precision."""
    return "fp8fast" if fast_accum else "fp8"


def band_results(rs: dict[str, dict], fp8: str = "fp8") -> tuple[list[dict], list[dict]]:
    """(the FP8 runs of kind `fp8`, the bf16 runs) of `BAND_RUNS` among results `rs`."""
    return tuple([rs[name] for name, kind, _ in BAND_RUNS if name in rs and kind == want] for want in (fp8, "bf16"))


def smoothed(r: dict, window: int) -> dict[int, float]:
    """{step: the mean training loss of the `window` logged steps ending there} of result `r`'s curve."""
    steps, losses = zip(*((row[0], row[1]) for row in r.get("curve") or [])) if r.get("curve") else ((), ())
    return {steps[i]: sum(losses[i - window + 1:i + 1]) / window for i in range(window - 1, len(steps))}


def seed_of(r: dict):
    """The seed a result ran with (its config's)."""
    return (r.get("config") or {}).get("seed")


def band_curves(fp8s: list[dict], bf16s: list[dict], window: int = 20) -> dict | None:
    """What `fp8_band` judges and `charts.fp8_band` draws: the bf16 runs by seed, the (FP8, bf16) pairs of one
    seed that trained on the same batches, and at every step all of them logged (`window`-step means, `smoothed`)
    the band (the largest minus the smallest bf16 loss) and each pair's gap (FP8 minus bf16). None unless there
    are two bf16 seeds and a pair."""
    bf16 = {seed_of(r): r for r in bf16s}
    pairs = [(f, bf16[seed_of(f)]) for f in fp8s if seed_of(f) in bf16 and same_batching(f, bf16[seed_of(f)])]
    if len(bf16) < 2 or not pairs:
        return None
    smooth = {id(r): smoothed(r, window) for r in (*bf16.values(), *(f for f, _ in pairs))}
    steps = sorted(set.intersection(*(set(s) for s in smooth.values())))
    return {"bf16": bf16, "pairs": pairs, "steps": steps,
            "band": [max(smooth[id(b)][s] for b in bf16.values()) - min(smooth[id(b)][s] for b in bf16.values())
                     for s in steps],
            "gaps": {seed_of(f): [smooth[id(f)][s] - smooth[id(b)][s] for s in steps] for f, b in pairs}}


def fp8_band(fp8s: list[dict], bf16s: list[dict], window: int = 20) -> dict | None:
    """Whether FP8 base weights learn within bf16's run-to-run band: whole runs of one recipe in bf16 at two or
    more seeds (their spread is the band: what changing the seed alone moves), and FP8 at some of those seeds,
    each against the bf16 run of its own seed, which trained on the same batches from the same weights (so the
    gap is FP8's arithmetic alone). Held out: after each evaluation every run reached, the band (the largest
    minus the smallest bf16 loss) and each seed's gap (FP8 minus bf16). Training: the losses as `window`-step
    means, at each step every run logged (`band_curves`), the band's mean and smallest and each gap's mean and
    largest. None unless there are two bf16 seeds and an FP8 run with a bf16 run of its seed on the same
    batches."""
    c = band_curves(fp8s, bf16s, window)
    if c is None or not c["steps"]:
        return None
    bf16, pairs, bands = c["bf16"], c["pairs"], c["band"]
    evals = {id(r): dict(r.get("eval_losses") or []) for r in (*bf16.values(), *(f for f, _ in pairs))}
    held = [{"step": step, "band": max(evals[id(b)][step] for b in bf16.values())
             - min(evals[id(b)][step] for b in bf16.values()),
             "gaps": {seed_of(f): evals[id(f)][step] - evals[id(b)][step] for f, b in pairs}}
            for step in sorted(set.intersection(*(set(e) for e in evals.values())))]
    return {"seeds": sorted(bf16), "fp8_seeds": [seed_of(f) for f, _ in pairs], "steps": len(c["steps"]),
            "window": window, "held_out": held,
            "within": bool(held) and all(abs(g) <= h["band"] for h in held for g in h["gaps"].values()),
            "train_band": {"mean": sum(bands) / len(bands), "least": min(bands)},
            "train_gaps": {s: {"mean": sum(g) / len(g), "largest": max(g, key=abs)} for s, g in c["gaps"].items()},
            "names": {"bf16": [b["name"] for b in bf16.values()], "fp8": [f["name"] for f, _ in pairs]}}


def describe_fp8_band(fp8s: list[dict], bf16s: list[dict], kind: str = "fp8") -> str:
    """`fp8_band` as a sentence for the lesson, or why it cannot be said; `kind`: the FP8 runs' (`BAND_RUNS`)."""
    what = "FP8 base weights" + (" with fast accumulation" if kind == "fp8fast" else "")
    c = fp8_band(fp8s, bf16s)
    if c is None:
        return ("FP8 against bf16's run-to-run band needs bf16 runs at two seeds and an FP8 run at one of them, on "
                "the same batches: " + ", ".join(r["name"] for r in (*fp8s, *bf16s)) + " are not that")
    seeds = " and ".join(str(s) for s in c["seeds"])
    gaps = [abs(g) for h in c["held_out"] for g in h["gaps"].values()]
    bands = [h["band"] for h in c["held_out"]]
    held = (f"held-out loss after each of {len(c['held_out'])} evaluations within {max(gaps):.3f} nats of bf16 at "
            f"the same seed, where bf16's seeds {seeds} differ by {min(bands):.3f}-{max(bands):.3f}: "
            + ("inside bf16's run-to-run band at every point" if c["within"] else "outside bf16's run-to-run band "
               "at some point")) if c["held_out"] else "no held-out loss both reached"
    means = [g["mean"] for g in c["train_gaps"].values()]
    side = "higher" if all(m > 0 for m in means) else "lower" if all(m < 0 for m in means) else "either side"
    train = (f"training loss ({c['window']}-step means, {c['steps']} steps): FP8 {side} than bf16 of its seed by "
             f"{min(abs(m) for m in means):.3f}-{max(abs(m) for m in means):.3f} on average, at most "
             f"{max(abs(g['largest']) for g in c['train_gaps'].values()):.3f}, where the bf16 seeds differ by "
             f"{c['train_band']['mean']:.3f} on average")
    return (f"{what} against bf16, whole runs of the same recipe at seeds {seeds} (FP8 at "
            f"{' and '.join(str(s) for s in c['fp8_seeds'])}, each on its bf16 run's batches): {held}; {train}")


def fp8_bands(rs: dict[str, dict]) -> list[tuple[list[dict], list[dict], str]]:
    """(the FP8 runs, the bf16 runs, `describe_fp8_band`'s sentence, which names the kind) for each of `FP8_KINDS`
    that has runs of its own and bf16 runs among results `rs`, full precision first: what the README, the claims
    and lesson 5 say of the band."""
    return [(fp8s, bf16s, describe_fp8_band(fp8s, bf16s, kind))
            for kind in FP8_KINDS for fp8s, bf16s in [band_results(rs, kind)] if fp8s and bf16s]
