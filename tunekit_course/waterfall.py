"""Lesson 5's waterfall: from the article's before to tunekit's recipe, one change a bar, each bar a measurement
that can hold up. Each bar is `tunekit train` of `article_before` with every change so far, from a fresh folder
(`fullrun.run_segment`), stopped once its steps beyond the first span `STEADY_S` seconds: its steady real
tokens/s, the 10th-90th percentile of its steps (the spread a change must leave to count) and its one-time cost
(start, data, build, compile: the first step's end on the run's clock) apart. The whole waterfall takes about
40 minutes on an H200; `python -m tunekit_course.waterfall SECONDS` goes on where the last command stopped.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tunekit_course.fullrun import derived_fields, done, logged_rows, run_folder, run_segment, segments

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
    ("tunekit's attention choice (cuDNN first on Hopper)", {"attention": "auto", "sdpa_backend": "auto"}),
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
    return new_result(name, cfg, derived.pop("tokens_per_s"), max(r["peak_mem_gb"] for r in rows),
                      call=f"waterfall.waterfall_bar({name!r}, {label!r}, {folder.name!r})",
                      code_files=(code_file(__file__),), label=label, one_time_s=rows[0]["elapsed_s"],
                      steps=len(rows), steady_s=round(rows[-1]["elapsed_s"] - rows[0]["elapsed_s"], 1),
                      weights=cfg.model or "random-init", **derived)


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


def main(argv: list[str]) -> int:
    # python -m tunekit_course.waterfall BUDGET_SECONDS   the bars not measured yet, for at most that long
    # (exit code 3: not all measured, go on in the next command)
    from tunekit_course.notebook import on_gpu

    if len(argv) != 1 or not argv[0].replace(".", "", 1).isdigit():
        print("usage: python -m tunekit_course.waterfall BUDGET_SECONDS", file=sys.stderr)
        return 2
    return 0 if len(measure_waterfall(float(argv[0]), least_s=150 * on_gpu())) == len(WATERFALL) + 1 else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
