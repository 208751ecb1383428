"""Run under torchrun by tests/e2e/test_distributed.py: `torchrun ... tests/e2e/dist_worker.py SPEC.json`.

SPEC holds `config` (TuneConfig fields), `resume` and `stop_after`: one call of `train.train` on every rank;
`die_on_rank` makes that rank exit at its first training step, as a crashed process would."""

import faulthandler
import json
import os
import sys
from pathlib import Path

from tunekit import distributed, train
from tunekit.cli import leave
from tunekit.config import TuneConfig

faulthandler.enable()  # a rank that aborts (SIGABRT from C++) prints where its Python threads were
spec = json.loads(Path(sys.argv[1]).read_text())
if spec.get("die_on_rank") == int(os.environ["RANK"]):
    def die(*args, **kwargs):
        os._exit(3)

    train.train_step = die
try:
    train.train(TuneConfig(**spec["config"]), resume=spec.get("resume", False), stop_after=spec.get("stop_after"),
                progress=False)
finally:
    distributed.teardown()
print(f"rank {os.environ['RANK']}: the worker's code is done", file=sys.stderr, flush=True)
leave(0)  # as `python -m tunekit.cli` leaves a launch on CPUs: without the interpreter's exit (see cli.leave)
