"""Benchmarks: what a training step, a run and the parts under them cost, each written as a result file.

- `timing`: the clock (warm-up, median, spread), FLOPs and MFU.
- `step`: the training step on random tokens (`tunekit bench`), its profile, repeats in fresh processes.
- `loop`: `tunekit train` itself timed on real data, for some steps or a share of an epoch.
- `fit`: the largest micro-batch that fits, found by trying steps (`tunekit fit`).
- `ops`: single operations: attention kernels, TF32 matmul precision.
- `comm`: all-reduce bandwidth between the processes of a torchrun launch (`tunekit commbench`).

Every public name of these is also `tunekit.bench.<name>` (`bench.run_bench`, ...), imported on first use.
"""

from __future__ import annotations

from tunekit.parts import lazy_face

PARTS = ("timing", "step", "loop", "fit", "ops", "comm")
__getattr__, __dir__ = lazy_face(__name__, PARTS)
