"""The course around the tunekit library: what only the lessons use.

- `claims`: the article's claims judged from the published results, and the README's generated tables.
- `notebook`: what the lesson notebooks share (presets that fit the machine, measuring in subprocesses, the
  lesson plans) and their executor (`python -m tunekit_course.notebook`).
- `cards`: what to run on each common card size, from a lesson's own results.
- `charts`: the lessons' charts, one function a chart, each taking result dicts and returning the figure.
- `databench`: lesson 1's data measurements; `compare`: the same step in the plain HF + peft stack, tunekit
  and Unsloth (`unsloth_site`: the folder of packages Unsloth runs from); `race`: lesson 4's optimizer
  convergence; `accumulation`: lesson 3's accumulation check.
- `fullrun`: lesson 5's whole runs, across GPU commands; `waterfall`: its bars, one change each; `runlog`: what
  a run's folder and result say (both read it, and the claims and charts); `detach`: either run's commands in a
  process that outlives the command that started it.
- `trl_race`, `own_script`: TRL's `SFTTrainer` plain and with tunekit's two lines; the tiny model the lessons'
  "in your own script" cells use. `agreement`: the committed notebooks' verdicts against the published results;
  `gcpause`: how long Python's garbage collector stops a run, with and without `gc_freeze`.

The library (`tunekit/`) never imports this package; only the command line reaches it, for the course's own
commands (`tunekit results`, `databench`, `converge`, `bench --compare`).
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the course checkout: notebooks/, data/, README.md
RESULTS = ROOT / "notebooks" / "results"  # the published results
