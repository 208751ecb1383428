"""Run under torchrun by tests/test_distributed.py: `torchrun ... tests/dist_worker.py SPEC.json`.

SPEC holds `config` (TuneConfig fields), `resume` and `stop_after`: one call of `train.train` on every rank."""

import json
import sys

from tunekit import distributed, train
from tunekit.config import TuneConfig

spec = json.loads(open(sys.argv[1]).read())
try:
    train.train(TuneConfig(**spec["config"]), resume=spec.get("resume", False), stop_after=spec.get("stop_after"),
                progress=False)
finally:
    distributed.teardown()
