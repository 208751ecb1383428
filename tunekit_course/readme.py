"""The README's generated blocks, rendered from the published result files (`tunekit results --update-readme`):
the article's headline as lesson 5 measured it, every step result, lesson 5's whole runs and its waterfall, the claims and
tunekit's own targets (`claims`), the comparison with the plain stack and Unsloth, the TRL race and the model
families. tests/course/test_readme.py fails when the README is stale.
"""

from __future__ import annotations

import re
from pathlib import Path

from tunekit.config import REPO_ROOT
from tunekit.results import by_name, format_table
from tunekit_course import RESULTS, waterfall
from tunekit_course.ahead import headroom_table
from tunekit_course.claims import (
    WHOLE_RUNS,
    claims_table,
    judge,
    machine_of,
    reference_table,
    speed_table,
    targets_table,
)


def step_results(rs: dict[str, dict]) -> list[dict]:
    return [r for r in rs.values() if "step_time_s" in r]


def whole_runs_table(rs: dict[str, dict]) -> str:
    """Lesson 5's whole runs, each measured from start to end and never projected: the four of `WHOLE_RUNS` in
    order ("unmeasured" where there is no result yet), then any run stopped before its end (`l5_..._stopped`,
    `"whole": false`), which counts no wall-clock. Per run: its epochs, wall-clock (its segments summed), steady
    real tokens/s with the 10th-90th percentile of its logged rows, peak memory, the held-out loss after each
    epoch, and the commit that ran it; under the table, the baselines that say what a held-out loss is worth."""
    names = [*WHOLE_RUNS, *sorted(n for n in rs if n.startswith("l5_") and n.endswith("_stopped"))]
    head = ("| name | recipe | epochs | wall-clock, min | steady real tok/s (p10–p90) | peak GB | "
            "held-out loss after each epoch | commit |")
    rows = [head, "|---|---|---|---|---|---|---|---|"]
    for name in names:
        base = name.removesuffix("_stopped")
        label = WHOLE_RUNS.get(base, base)
        if (r := rs.get(name)) is None:
            rows.append(f"| {name} | {label} | | unmeasured | | | | |")
            continue
        epochs = (r.get("config") or {}).get("epochs")
        whole = r.get("whole", True)
        if whole:
            segs = len(r.get("segments") or [])
            wall = f"{r['wall_s'] / 60:.1f}" + (f" ({segs} segments)" if segs > 1 else "")
            epochs_cell = f"{epochs:g}" if epochs else "-"
        else:  # its wall-clock is of no whole run: left out, as is any projection of it
            label += f": stopped at step {r['steps']}, not a whole run (why: its result file's `data`)"
            wall = "-"
            epochs_cell = f"{r['epochs_seen']:.2f} of {epochs:g}" if epochs and r.get("epochs_seen") else "-"
        spread = r.get("tok_per_s_p10_p90")
        tps = f"{r['tokens_per_s']:,.0f}" + (f" ({spread[0]:,.0f}–{spread[1]:,.0f})" if spread else "")
        losses = ", ".join(f"{loss:.2f}" for _, loss in r.get("eval_losses") or []) or "-"
        rows.append(f"| {name} | {label} | {epochs_cell} | {wall} | {tps} | {r['peak_memory_gb']:.1f} | {losses} | "
                    f"{(r.get('commit') or '-')[:7]} |")
    base = next((rs[n]["baselines"] for n in names if n in rs and rs[n].get("baselines")), None)
    if base:
        rows.append(f"\nHeld-out baselines on the same GSM8K test tokens: uniform {base['uniform']:.2f}, unigram "
                    f"{base['unigram']:.2f}, bigram {base['bigram']:.2f} (cross-entropy, nats a token).")
    return "\n".join(rows)


def fp8_band_table(rs: dict[str, dict]) -> str:
    """The whole runs of tunekit's recipe in bf16 and FP8 (two kinds) at two seeds (`runlog.BAND_RUNS`), a row
    each, and what they say of each FP8 kind against bf16's run-to-run band (`runlog.fp8_bands`);
    "unmeasured" rows where a run has no result."""
    from tunekit_course.runlog import BAND_KINDS, BAND_RUNS, fp8_bands

    head = ("| name | base weights | seed | GPU | wall-clock, min | steady real tok/s (p10–p90) | peak GB | "
            "held-out loss after each epoch | commit |")
    rows = [head, "|---|---|---|---|---|---|---|---|---|"]
    for name, kind, seed in BAND_RUNS:
        kind = BAND_KINDS[kind]
        if (r := rs.get(name)) is None:
            rows.append(f"| {name} | {kind} | {seed} | | unmeasured | | | | |")
            continue
        spread = r.get("tok_per_s_p10_p90")
        tps = f"{r['tokens_per_s']:,.0f}" + (f" ({spread[0]:,.0f}–{spread[1]:,.0f})" if spread else "")
        losses = ", ".join(f"{loss:.3f}" for _, loss in r.get("eval_losses") or []) or "-"
        rows.append(f"| {name} | {kind} | {seed} | {(r.get('gpu') or '-').removeprefix('NVIDIA ')} | "
                    f"{r['wall_s'] / 60:.1f} | {tps} | {r['peak_memory_gb']:.1f} | {losses} | "
                    f"{(r.get('commit') or '-')[:7]} |")
    rows += [f"\n{sentence}." for _, _, sentence in fp8_bands(rs)]
    return "\n".join(rows)


def headline(rs: dict[str, dict]) -> str:
    """The article's headline claim (C16) as lesson 5 measured it, for the top of the README."""
    v = judge("C16", rs)
    where = f" ({machine_of(rs, v.files)}, `notebooks/05_full_7b_run.ipynb`)" if v.files else ""
    return f"**The article's headline, 14 days -> 3 (C16): {v.verdict}**{where}. {v.evidence[0].upper()}{v.evidence[1:]}."


def render_readme(text: str, rs: dict[str, dict]) -> str:
    """`text` with every generated block (`<!-- NAME:start -->` ... `<!-- NAME:end -->`) rendered anew."""
    from tunekit import families
    from tunekit_course.trl_race import trl_table

    blocks = {"headline": headline(rs), "results": format_table(sorted(step_results(rs), key=lambda r: r["name"])),
              "epochs": whole_runs_table(rs), "fp8band": fp8_band_table(rs), "waterfall": waterfall.table(rs),
              "claims": claims_table(rs, targets=False), "targets": targets_table(rs),
              "reference": reference_table(rs), "speedpush": speed_table(rs), "headroom": headroom_table(rs),
              "trl": trl_table(rs), "families": families.table()}
    for name, body in blocks.items():
        pattern = re.compile(rf"(<!-- {name}:start -->\n)(?:.*?\n)?(<!-- {name}:end -->)", re.DOTALL)
        if not pattern.search(text):
            raise ValueError(f"README has no <!-- {name}:start --> ... <!-- {name}:end --> block")
        text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
    return text


def update_readme(path: Path = REPO_ROOT / "README.md", results_dir: Path = RESULTS) -> bool:
    """Rewrite the README's generated blocks from the result files; True if anything changed."""
    from tunekit.io import atomic_write_text

    old = Path(path).read_text()
    new = render_readme(old, by_name(results_dir))
    if new != old:
        atomic_write_text(path, new)
    return new != old
