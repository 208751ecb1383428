"""Lesson 5's waterfall: from the article's before to tunekit's recipe, one change a bar, each bar a measurement
that can hold up. Each bar is `tunekit train` of `article_before` with every change so far, from a fresh folder
(`fullrun.run_segment`), stopped once its steps beyond the first span `STEADY_S` seconds: its steady real
tokens/s, the 10th-90th percentile of its steps (the spread a change must leave to count) and its one-time cost
(start, data, build, compile: the first step's end on the run's clock) apart. A bar's change is read against the
bar before it (`bar_change`): step by step where both ran the same batches, so the batches' lengths cancel out,
and a change inside the spread says so; bars measured on different GPUs are not compared. A change that trades
one-time cost against steady speed says at what run length the two come out even (`pays_back`). The whole waterfall is
more than a GPU session of 30 minutes can hold (an estimate: ~90 s a bar, the whole-model compile's bar ~8
minutes), so it goes in parts, each part's bars on one GPU: `python -m tunekit_course.waterfall SECONDS
[FIRST-LAST]` goes on where the last command stopped, with the bars FIRST to LAST (their numbers) only. A part
that starts after the first bar, on a GPU that has not measured the bar before it, measures that bar again first
(`with_reference`, saved as NAME_again): the part's first change is read against a bar from its own GPU.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from tunekit.results import gpu_uuid
from tunekit_course import runlog
from tunekit_course.fullrun import run_folder, run_segment
from tunekit_course.runlog import derived_fields, done, logged_rows, p10_p90, segments

ARTICLE_ITEMS = 5  # bars 1-5 are the article's items (ending at article_checklist), the rest the course's

# (label, the fields the change sets); each bar keeps the changes before it. The first five are the article's
# items (ending at article_checklist; its FlashAttention is SDPA's flash kernel, which the before runs already),
# the rest what the course adds (ending at tunekit_recipe's step), regional compile first: a whole-model compile
# takes minutes at 7B, and each later bar would pay it again.
WATERFALL = [
    ("+ offline tokenization", {"tokenize": "offline"}),
    ("+ the article's DataLoader settings", {"num_workers": 2, "pin_memory": True, "prefetch_factor": 4,
                                             "persistent_workers": True}),
    ("+ TF32", {"tf32": True}),
    ("+ 8-bit AdamW", {"optimizer": "adamw8bit"}),
    ("+ torch.compile: the article's checklist", {"compile": "model"}),
    ("regional compile instead of whole-model", {"compile": "regional"}),
    ("+ packed rows", {"packing": "auto"}),
    ("bf16 LoRA instead of QLoRA", {"method": "lora", "peft_kbit_prepare": False}),
    ("no checkpointing: micro-batch 4, no accumulation", {"grad_ckpt": False, "batch_size": 4, "grad_accum": 1}),
    ("+ the chunked loss", {"loss": "chunked"}),
    ("no fp32 cast of the adapters' input", {"lora_input_cast": False}),
    ("fused AdamW instead of 8-bit", {"optimizer": "adamw"}),
    ("tunekit's attention choice (FlexAttention for packed rows)", {"attention": "auto", "sdpa_backend": "auto"}),
    ("+ the fused LoRA", {"fast_lora": True}),
    ("+ FP8 base weights: tunekit's recipe", {"fp8": True}),
]


def waterfall_configs() -> list[tuple[str, str, dict]]:
    """(name, label, the config's fields) of each bar: `article_before`'s fields, then each change of
    `WATERFALL` added to the ones before it; each validated. The last two of the article's items and of the
    course's end at `article_checklist` and `tunekit_recipe` field for field, but for the whole runs' length
    and evaluation schedule (tests/unit/test_recipes.py)."""
    from tunekit import config
    from tunekit.presets import article_before

    fields: dict = {}
    bars = [("l5w_00", "the article's before", config.config_dict(article_before()))]
    for i, (label, change) in enumerate(WATERFALL, 1):
        fields = {**fields, **change}
        cfg = article_before(**fields)
        cfg.validate()  # every bar is a config that runs
        bars.append((f"l5w_{i:02d}", label, config.config_dict(cfg)))
    return bars


def _flag(field: str, value) -> str:
    return f"--{field.replace('_', '-')}={str(value).lower() if isinstance(value, bool) else value}"


def waterfall_runs() -> list[tuple[str, str, list[str]]]:
    """(name, label, `tunekit train` arguments) of each bar of `WATERFALL`: `--preset article_before` with the
    fields of every change so far, no held-out evaluation (a fixed cost, the same for every bar) and no periodic
    checkpoint."""
    fields: dict = {}
    runs = [("l5w_00", "the article's before", ["--preset", "article_before", "--eval-data=", "--save-every=0"])]
    for i, (label, change) in enumerate(WATERFALL, 1):
        fields = {**fields, **change}
        runs.append((f"l5w_{i:02d}", label, [*runs[0][2], *(_flag(k, v) for k, v in fields.items())]))
    return runs


STEADY_S = 45.0  # seconds of a bar's steps after its first: 10-100+ steps, enough for a median and its spread


def waterfall_bar(name: str, label: str, folder: str | Path) -> dict:
    """The result of one bar, from its folder's rows (the GPU machine's own result: `notebook.save`): steady
    real tokens/s of the steps after the first, their 10th-90th percentile, and the one-time cost apart (start,
    data, build, compile: the first step's end on the run's clock)."""
    from tunekit.config import TuneConfig
    from tunekit.results import code_file, new_result

    folder = Path(folder)
    segs, rows = segments(folder), logged_rows(folder)
    cfg = TuneConfig(**json.loads((folder / "config.json").read_text()))
    derived = derived_fields(rows, segs)
    # the real tokens of each logged row: two bars that read the same batches agree here, row for row
    row_tokens = [b["tokens"] - a["tokens"] for a, b in zip([{"tokens": 0}, *rows], rows)]
    return new_result(name, cfg, derived.pop("tokens_per_s"), max(r["peak_mem_gb"] for r in rows),
                      call=f"waterfall.waterfall_bar({name!r}, {label!r}, {folder.name!r})",
                      code_files=(code_file(__file__), code_file(runlog.__file__)), label=label,
                      one_time_s=rows[0]["elapsed_s"],
                      steps=len(rows), steady_s=round(rows[-1]["elapsed_s"] - rows[0]["elapsed_s"], 1),
                      weights=cfg.model or "random-init", row_tokens=row_tokens, **derived)


def _block_rates(bar: dict, blocks: int = 3) -> list[float]:
    """A bar's steady real tokens/s over `blocks` consecutive runs of its steps after the first (its rate's own
    wobble: each block is a different stretch of the data)."""
    pairs = [(tokens, row[2]) for tokens, row in zip(bar["row_tokens"][1:], bar["curve"][1:]) if row[2]]
    size = max(1, len(pairs) // blocks)
    chunks = [pairs[i:i + size] for i in range(0, len(pairs), size)][:blocks]
    return [sum(t for t, _ in c) / sum(t / r for t, r in c) for c in chunks if c]


def bar_change(before: dict, bar: dict) -> dict:
    """How `bar` changed the steady speed of the bar `before` it: {ratio (bar's steady tokens/s over before's),
    low, high (the spread of that ratio), within (True: the ratio is inside its spread, the change has not shown
    an effect; None: not compared), how}. Where both bars logged the same real tokens row for row (the same
    batches: a change that leaves batching alone), the spread is the 10th-90th percentile of the step-by-step
    ratios, each step against the same step of the bar before. Otherwise each bar's rate over three stretches of
    its steps, and the ratio's range over them. Bars measured on different GPUs are not compared."""
    ratio = bar["tokens_per_s"] / before["tokens_per_s"]
    if before.get("gpu_uuid") != bar.get("gpu_uuid"):
        return {"ratio": ratio, "low": None, "high": None, "within": None,
                "how": "not compared: measured on different GPUs"}
    n = min(len(before["row_tokens"]), len(bar["row_tokens"]))
    if n > 2 and before["row_tokens"][:n] == bar["row_tokens"][:n]:
        steps = [b[2] / a[2] for a, b in zip(before["curve"][1:n], bar["curve"][1:n]) if a[2] and b[2]]
        low, high = p10_p90(steps)
        how = f"step by step over the same {len(steps)} batches (10th-90th percentile)"
    else:
        mine, theirs = _block_rates(bar), _block_rates(before)
        low, high = min(mine) / max(theirs), max(mine) / min(theirs)
        how = "over three stretches of each bar's steps (other batches: no step-by-step pairing)"
    return {"ratio": ratio, "low": low, "high": high, "within": low <= 1.0 <= high, "how": how}


# How far a bar's one-time cost (start, data, build, compile) wanders with nothing changed that touches it: the
# first five bars, whose changes leave the startup alone, took 24.8-29.2 s on one H200 (l5w_00-l5w_04). A
# difference in one-time cost smaller than this is not a trade-off.
ONE_TIME_NOISE_S = 5.0


def pays_back(before: dict, bar: dict) -> dict | None:
    """Where a change trades one-time cost against steady speed (faster steps for a longer start, or the other way
    round), the run length at which the two bars come out even: {tokens (real tokens trained), seconds (into
    the run, one-time cost included), faster (which side wins beyond it: "bar" or "before")}. None where there is
    no trade: one side both starts sooner and runs faster, the one-time costs differ by less than
    `ONE_TIME_NOISE_S`, or a bar has no one-time cost recorded."""
    r0, r1 = before["tokens_per_s"], bar["tokens_per_s"]
    o0, o1 = before.get("one_time_s"), bar.get("one_time_s")
    if o0 is None or o1 is None or abs(o1 - o0) < ONE_TIME_NOISE_S or r0 == r1 or (r1 > r0) != (o1 > o0):
        return None
    tokens = abs(o1 - o0) / abs(1 / r0 - 1 / r1)
    return {"tokens": tokens, "seconds": o1 + tokens / r1, "faster": "bar" if r1 > r0 else "before"}


def describe_change(before: dict, bar: dict) -> str:
    """One line for a bar's change against the bar before it (`bar_change`), for the lesson to print; where the
    change is outside its spread and trades one-time cost against steady speed (`pays_back`), the run length
    at which the two come out even."""
    c = bar_change(before, bar)
    head = f"{c['ratio']:.2f}x the bar before"
    if c["within"] is None:
        return f"{head} ({c['how']})"
    spread = f"spread {c['low']:.2f}-{c['high']:.2f}x, {c['how']}"
    if c["within"]:
        return f"{head} ({spread}): inside its spread, no effect shown"
    even = pays_back(before, bar)
    if even is None:
        return f"{head} ({spread})"
    at = f"{even['tokens'] / 1e6:.1f}M real tokens ({even['seconds'] / 60:.0f} min into a run)"
    once = abs(bar["one_time_s"] - before["one_time_s"])
    if even["faster"] == "bar":
        return f"{head} ({spread}); its {once:.0f} s more of one-time cost pays back after {at}"
    return f"{head} ({spread}); {once:.0f} s less of one-time cost: ahead until {at}, behind after"


def measure_waterfall(budget_s: float, runs: list[tuple[str, str, list[str]]] | None = None,
                      steps_s: float = STEADY_S, least_s: float = 150) -> list[str]:
    """Go on with the waterfall's bars for `budget_s` seconds, each in a fresh folder (runs/full/NAME) and
    stopped after `steps_s` seconds of steps beyond its first, its result saved to this GPU's results folder;
    a bar is not started with less than `least_s` left. Run it again, in the next command, to go on (a bar
    stopped by the budget before its steady time is measured again). Returns the names of the bars measured."""
    import shutil

    from tunekit_course import notebook

    t0 = time.perf_counter()
    runs = waterfall_runs() if runs is None else runs
    for name, label, args in runs:
        if (notebook.results_dir() / f"{name}.json").exists():
            continue
        left = budget_s - (time.perf_counter() - t0)
        if left < least_s:
            break
        folder = run_folder(name)
        shutil.rmtree(folder, ignore_errors=True)  # each bar from a fresh folder: its one-time costs whole
        run_segment(folder, notebook.fit_here(["train", *args])[1:], left, steps_s=steps_s)
        rows = logged_rows(folder)
        if len(rows) > 1 and (done(folder) or rows[-1]["elapsed_s"] - rows[0]["elapsed_s"] >= steps_s):
            notebook.save(waterfall_bar(name, label, folder))
    measured = [name for name, _, _ in runs if (notebook.results_dir() / f"{name}.json").exists()]
    print(f"waterfall bars measured: {len(measured)} of {len(runs)}"
          + ("" if len(measured) == len(runs) else "; run this again to go on"))
    return measured


def bar_range(text: str) -> list[tuple[str, str, list[str]]]:
    """The bars numbered FIRST to LAST ("0-5", "6-15", "7"), of `waterfall_runs`; ValueError naming the range."""
    runs = waterfall_runs()
    try:
        first, _, last = text.partition("-")
        first, last = int(first), int(last or first)
    except ValueError:
        raise ValueError(f"{text!r}: not a range of bar numbers such as 0-5") from None
    if not 0 <= first <= last < len(runs):
        raise ValueError(f"{text!r}: the bars are numbered 0 to {len(runs) - 1}")
    return runs[first:last + 1]


AGAIN = "_again"  # a bar measured a second time, on the GPU of the part after it: that part's first reference


def with_reference(runs: list[tuple[str, str, list[str]]]) -> list[tuple[str, str, list[str]]]:
    """`runs`, a range of the bars, with the bar before its first measured again ahead of it as NAME_again where
    this GPU has no result of that bar (a part of the waterfall on a fresh machine): each bar is read against the
    one before it on the same GPU, and two machines of one model differ by more than many changes do. Nothing is
    added to a range that starts at the first bar or whose reference this GPU measured already."""
    from tunekit_course import notebook

    bars = waterfall_runs()
    first = next(i for i, (name, _, _) in enumerate(bars) if name == runs[0][0]) if runs else 0
    if first == 0:
        return runs
    name, label, args = bars[first - 1]
    for kept in (name, name + AGAIN):
        path = notebook.results_dir() / f"{kept}.json"
        if path.exists() and json.loads(path.read_text()).get("gpu_uuid") == gpu_uuid():
            return runs
    return [(name + AGAIN, f"{label} (again, on the GPU of the bars after it)", args), *runs]


def reference(results: dict[str, dict], name: str) -> dict | None:
    """The result the bar `name` is read against, from `results` ({name: result}): the bar before it as measured
    on the same GPU, its second measurement (NAME_again) where only that one was; else the bar before it as it is
    (`bar_change` then says it is not compared), None for the first bar or a bar before it not measured."""
    names = [bar for bar, _, _ in waterfall_runs()]
    i = names.index(name)
    if i == 0:
        return None
    mine = (results.get(name) or {}).get("gpu_uuid")
    candidates = [r for r in (results.get(names[i - 1]), results.get(names[i - 1] + AGAIN)) if r]
    return next((r for r in candidates if r.get("gpu_uuid") == mine), candidates[0] if candidates else None)


def shown(mine: dict[str, dict], published: dict[str, dict] | None = None
          ) -> list[tuple[str, str, dict | None, dict | None, str]]:
    """What the lesson draws and prints, a bar a row: (name, label, its result here, its published result, its
    change against the bar before it (`reference`, `describe_change`), "" for the first bar or where the bar
    before it is not measured). A bar measured here is read against the bars measured here, the published ones
    where those are missing (and then not compared: other GPUs); a published bar against the published ones.
    A bar measured a second time (NAME_again: the reference of the part after it, on that part's GPU) gets a
    row of its own under the bar, so that the change of the bar below reads against a bar drawn beside it.
    `published` defaults to the published results of the bars and their second measurements."""
    published = _published_bars() if published is None else published
    rows = []
    for name, label, _ in waterfall_runs():
        r, p = mine.get(name), published.get(name)
        ref = reference({**published, **mine} if r else published, name) if (r or p) else None
        rows.append((name, label, r, p, describe_change(ref, r or p) if ref else ""))
        again = name + AGAIN
        if mine.get(again) or published.get(again):  # the bar the next one is read against, on that one's GPU
            rows.append((again, f"{label} (again, on the next bars' GPU)", mine.get(again),
                         published.get(again), ""))
    return rows


def changes(results: dict[str, dict]) -> list[tuple[str, str, dict | None]]:
    """Each bar's change after the first, from `results` ({name: result}, one source: yours or the published):
    (name, label, `bar_change` against its `reference`), None where the bar or its reference is missing or the
    two were measured on different GPUs."""
    out = []
    for name, label, _ in waterfall_runs()[1:]:
        bar = results.get(name)
        ref = reference(results, name) if bar else None
        c = bar_change(ref, bar) if ref else None
        out.append((name, label, c if c and c["within"] is not None else None))
    return out


def _part(rows: list[tuple[str, str, dict | None]], what: str) -> str:
    """A sentence on a run of bars: their ratios multiplied (each read on its own GPU), the changes that showed
    an effect from the largest, those inside their spread; or how many are measured where not all are."""
    known = [(label, c) for _, label, c in rows if c]
    if len(known) < len(rows):
        return f"{what}: {len(known)} of {len(rows)} bars measured and compared, so not added up"
    product = 1.0
    for _, c in known:
        product *= c["ratio"]
    effects = sorted(((label, c) for label, c in known if not c["within"]), key=lambda lc: -abs(math.log(lc[1]["ratio"])))
    inside = [label for label, c in known if c["within"]]
    text = f"{what}: {product:.2f}x the steady rate they start from (each bar's change multiplied)"
    if effects:
        text += "; outside their spread: " + ", ".join(f"{label} {c['ratio']:.2f}x" for label, c in effects)
    if inside:
        text += "; inside their spread (no effect shown): " + ", ".join(inside)
    return text


def _bar_names() -> list[str]:
    """Every bar's result name and its second measurement's (NAME_again)."""
    return [n for name, _, _ in waterfall_runs() for n in (name, name + AGAIN)]


def bars_in(results: dict[str, dict]) -> dict[str, dict]:
    """{name: result} of the waterfall's bars and their second measurements among `results`."""
    return {n: results[n] for n in _bar_names() if n in results}


def _published_bars() -> dict[str, dict]:
    """{name: result} of the published bars and their second measurements."""
    from tunekit_course import notebook

    return {n: r for n in _bar_names() if (r := notebook.published(n))}


def table(results: dict[str, dict]) -> str:
    """The waterfall as a markdown table, from the bars among `results` (one source): each bar's steady real
    tokens/s with its 10th-90th percentile, its change against the bar before it on the same GPU with that
    change's spread (`bar_change`; "inside its spread" where it showed no effect), its one-time cost, and the
    commit that measured it; a bar not measured says so. Under it, the two sentences of `summary`."""
    bars = bars_in(results)
    rows = ["| bar | steady real tok/s (p10–p90) | against the bar before (spread) | one-time s | commit |",
            "|---|---|---|---|---|"]
    for name, label, _, bar, _ in shown({}, bars):
        if bar is None:
            rows.append(f"| {label} | unmeasured | | | |")
            continue
        ref = None if name.endswith(AGAIN) else reference(bars, name)
        change = ""
        if ref:
            c = bar_change(ref, bar)
            change = f"{c['ratio']:.2f}x"
            if c["within"] is None:
                change += " (not compared: another GPU)"
            else:
                change += f" ({c['low']:.2f}–{c['high']:.2f}x)" + (": inside its spread" if c["within"] else "")
        spread = bar.get("tok_per_s_p10_p90")
        tps = f"{bar['tokens_per_s']:,.0f}" + (f" ({spread[0]:,.0f}–{spread[1]:,.0f})" if spread else "")
        rows.append(f"| {label} | {tps} | {change} | {bar['one_time_s']:.0f} | {(bar.get('commit') or '-')[:7]} |")
    return "\n".join([*rows, "", *(f"- {line}" for line in summary(bars))])


def yours_or_published(mine: dict[str, dict]) -> dict[str, dict]:
    """The bars the lesson's summary reads: each bar as measured here (`mine`, with the second measurements)
    where it was, else as published. No change is read across the two: a bar is only ever compared with the bar
    before it from its own GPU (`reference`, `bar_change`), so a learner who measured part of the waterfall sees
    that part from their GPU and the rest from the published bars."""
    return {**_published_bars(), **{n: mine[n] for n in _bar_names() if n in mine}}


def summary(results: dict[str, dict]) -> list[str]:
    """Two sentences for the lesson's summary, from the bars of `results` (one source): what the article's items
    did to the before's steady rate, and what the course's changes did after them."""
    rows = changes(results)
    return [_part(rows[:ARTICLE_ITEMS], f"The article's {ARTICLE_ITEMS} items, one bar each"),
            _part(rows[ARTICLE_ITEMS:], f"The course's {len(rows) - ARTICLE_ITEMS} changes after them")]


def main(argv: list[str]) -> int:
    # python -m tunekit_course.waterfall BUDGET_SECONDS [FIRST-LAST]   the bars (those numbered FIRST to LAST) not
    # measured yet, for at most that long (exit code 3: not all measured, go on in the next command)
    from tunekit_course.notebook import on_gpu

    if len(argv) not in (1, 2) or not argv[0].replace(".", "", 1).isdigit():
        print("usage: python -m tunekit_course.waterfall BUDGET_SECONDS [FIRST-LAST]", file=sys.stderr)
        return 2
    try:
        runs = with_reference(bar_range(argv[1])) if len(argv) == 2 else waterfall_runs()
    except ValueError as e:
        print(f"waterfall: {e}", file=sys.stderr)
        return 2
    return 0 if len(measure_waterfall(float(argv[0]), runs, least_s=150 * on_gpu())) == len(runs) else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
