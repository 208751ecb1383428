"""Where a run is and what it reports: its position in the data and the wall-clock (`Position`, which a
checkpoint records), and its metrics rows and progress bar (`MetricsLog`). The loop in `tunekit/train.py`
advances the one and writes the other once a step."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from tunekit import distributed, memory, stopping


@dataclasses.dataclass
class Position:
    """Where the run is: the step it resumed at, the data position after the last finished step (epoch, next
    batch), the samples and real tokens trained on and the wall-clock seconds, counting the run this one
    resumes."""

    step: int = 0
    epoch: int = 0
    next_batch: int = 0
    samples: int = 0
    tokens: int = 0
    elapsed0: float = 0.0
    elapsed_s: float = 0.0

    def advance(self, epoch: int, index: int, samples: int, tokens: int, elapsed: float) -> None:
        self.epoch, self.next_batch = epoch, index + 1
        self.samples, self.tokens = self.samples + samples, self.tokens + tokens
        self.elapsed_s = round(self.elapsed0 + elapsed, 3)

    def position(self) -> dict:
        """What a checkpoint records of the data position (`batching.EpochSampler` resumes from it)."""
        return {"epoch": self.epoch, "next_batch": self.next_batch, "samples": self.samples, "tokens": self.tokens,
                "world": distributed.world_size(), "elapsed_s": self.elapsed_s}


class MetricsLog:
    """The run's progress: a metrics row (one JSON line, flushed) each `log_every` steps, and a bar of carriage
    returns on a terminal or a plain line a row in a log file. Only rank 0 has a file."""

    def __init__(self, path: Path | None, total: int, initial: int, progress: bool, say):
        from tqdm.auto import tqdm

        self.path, self.say, self.file = path, say, None
        self.bar = tqdm(total=total, initial=initial, desc="train") if progress and stopping.on_terminal() else None
        self.t_last, self.tokens_since, self.total = time.perf_counter(), 0, total
        self.excluded = 0.0  # seconds since the last row spent outside the steps (a checkpoint written)

    def __enter__(self):
        self.file = open(self.path, "a") if self.path is not None else None
        return self

    def __exit__(self, *exc):
        if self.file is not None:
            self.file.close()
        self.close()

    def tokens(self, n: int) -> None:
        self.tokens_since += n

    def row(self, step: int, loss: float, grad_norm: float, lr: float, at: Position, device: str, eval_s: float,
            eval_loss: float | None) -> None:
        now = time.perf_counter()
        alloc, _ = memory.peak_memory_gb(device)
        row = {"step": step, "loss": round(loss, 6), "lr": lr, "grad_norm": round(grad_norm, 6), "epoch": at.epoch,
               "samples": at.samples, "tokens": at.tokens,
               "tok_per_s": round(self.tokens_since / (now - self.t_last - eval_s - self.excluded), 1),
               "peak_mem_gb": round(alloc, 3), "elapsed_s": at.elapsed_s}
        if eval_loss is not None:
            row["eval_loss"] = round(eval_loss, 6)
        if self.file is not None:
            self.file.write(stopping.json_line(row))
            self.file.flush()
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tok_per_s']:.0f}", mem=f"{alloc:.1f}G")
        else:
            held = f" (held-out {eval_loss:.4f})" if eval_loss is not None else ""
            self.say(f"step {step}/{self.total}: loss {loss:.4f}{held}, lr {lr:.3g}, grad norm {grad_norm:.3g}, "
                     f"{row['tok_per_s']:,.0f} tok/s, peak {alloc:.2f} GB, {at.samples:,} samples seen", flush=True)
        self.t_last, self.tokens_since, self.excluded = now, 0, 0.0

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
