"""Run under torchrun by tests/e2e/test_distributed.py: `torchrun ... tests/e2e/dist_worker.py SPEC.json`.

SPEC holds `config` (TuneConfig fields), `resume` and `stop_after`: one call of `train.train` on every rank;
`die_on_rank` makes that rank exit at its first training step, as a crashed process would."""

import faulthandler
import json
import os
import sys
from pathlib import Path

from tunekit import distributed, train
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
# The run is done and written. On a busy 2-core machine about one launch in 25 then lost a rank to SIGABRT
# ("terminate called without an active exception", no Python frame left) inside the interpreter's exit,
# after both ranks had printed the line below: torch's and gloo's C++ teardown at exit, not tunekit's code.
# The worker leaves without it (os._exit), as a rank whose work succeeded.
print(f"rank {os.environ['RANK']}: the worker's code is done", file=sys.stderr, flush=True)
sys.stdout.flush()
os._exit(0)
