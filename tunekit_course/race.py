"""Lesson 4's optimizer race: the same model, data and seed trained with each optimizer at each learning rate,
every run's loss curves in one result (`tunekit converge`).
"""

from __future__ import annotations

from tunekit.optim import lion_settings
from tunekit.results import code_file


def parse_sweep(text: str) -> dict[str, list[float]]:
    """`"adamw=3e-4,1e-3;lion=3e-5,1e-4"` -> `{"adamw": [3e-4, 1e-3], "lion": [3e-5, 1e-4]}`."""
    from tunekit.validation import OPTIMIZERS

    sweep = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, lrs = part.partition("=")
        name = name.strip()
        if name not in OPTIMIZERS or not lrs.strip():
            raise ValueError(f"--sweep {part!r}: expected OPTIMIZER=LR,LR,... with OPTIMIZER one of "
                             f"{', '.join(OPTIMIZERS)}")
        try:
            sweep[name] = [float(x) for x in lrs.split(",")]
        except ValueError:
            raise ValueError(f"--sweep {part!r}: learning rates are numbers such as 3e-4") from None
    if not sweep:
        raise ValueError("--sweep is empty; e.g. 'adamw=3e-4,1e-3;lion=3e-5,1e-4'")
    return sweep


def run_convergence(cfg, sweep: dict[str, list[float]], name: str, verbose: bool = True) -> dict:
    """Train `cfg` once per (optimizer, learning rate) of `sweep` — same data, same seed, same held-out rows
    (`cfg.eval_split`) — and record every run's training and held-out loss curves, its speed and its memory.
    Lion runs take the paper's weight decay rule: 10x the config's (`lion_settings`). Each run is scored by
    the lowest held-out loss along its curve (where early stopping would keep it: a small corpus trained for
    many epochs overfits, and the final loss then rewards whatever learns slowest); the best learning rate of
    each optimizer is the one with the lowest score. One scratch folder serves every run (`--overwrite` keeps
    its tokenized data)."""
    import dataclasses
    import statistics
    import tempfile
    import time
    from pathlib import Path

    from tunekit import train as tr
    from tunekit.results import new_result
    from tunekit.stopping import read_metrics

    if not cfg.eval_split:
        raise ValueError("run_convergence compares held-out losses: set --eval-split (e.g. 0.05)")
    folder = Path(cfg.out_dir or tempfile.mkdtemp(prefix="tunekit-converge-"))
    runs = []
    for optimizer, lrs in sweep.items():
        for lr in lrs:
            wd = lion_settings(lr, cfg.weight_decay)["weight_decay"] if "lion" in optimizer else cfg.weight_decay
            run = dataclasses.replace(cfg, optimizer=optimizer, lr=lr, weight_decay=wd, out_dir=str(folder))
            t0 = time.perf_counter()
            summary = tr.train(run, progress=False, overwrite=True)
            wall = time.perf_counter() - t0
            rows = read_metrics(folder)
            every = max(1, len(rows) // 200)  # at most ~200 points of the training curve
            low = min(summary["eval_losses"], key=lambda e: e[1])
            runs.append({
                "optimizer": optimizer, "lr": lr, "weight_decay": wd, "best_eval_loss": low[1],
                "best_eval_step": low[0], "final_eval_loss": summary["eval_loss"],
                "final_train_loss": summary["final_loss"], "eval": summary["eval_losses"],
                "train": [[r["step"], r["loss"]] for r in rows[::every]],
                "tok_per_s": statistics.median(r["tok_per_s"] for r in rows[len(rows) // 10:]),
                "peak_memory_gb": rows[-1]["peak_mem_gb"], "wall_s": round(wall, 1)})
            if verbose:
                print(f"{optimizer:<14} lr {lr:<8.2g} wd {wd:<5g} held-out loss: lowest {low[1]:.4f} (step {low[0]}), "
                      f"final {summary['eval_loss']:.4f} (train {summary['final_loss']:.4f}), {wall:.0f} s", flush=True)
    best = {}
    for r in runs:
        if r["optimizer"] not in best or r["best_eval_loss"] < best[r["optimizer"]]["best_eval_loss"]:
            best[r["optimizer"]] = r
    return new_result(name, cfg, None, None, code_files=(code_file(__file__),), call=f"speedups.run_convergence(TuneConfig(**config), {sweep!r}, "
                      f"{name!r})", runs=runs,
                      best={k: {"lr": v["lr"], "best_eval_loss": v["best_eval_loss"], "best_eval_step": v["best_eval_step"]}
                            for k, v in best.items()},
                      weights="random init, trained from scratch", data=f"{cfg.data}, {cfg.eval_split:g} held out")
