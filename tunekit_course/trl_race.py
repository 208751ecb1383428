"""TRL's `SFTTrainer` on GSM8K, plain and with tunekit's speed-ups, side by side on one GPU, back to back.

The script is examples/sft_trl.py, as a user runs it; what differs between the stacks is only what that script
switches:

- `trl`: plain TRL — batches padded to their longest sample, SDPA attention, TRL's own chunked loss (it never
  holds the logits either), no checkpointing, bf16.
- `trl_packing`: TRL's own packing (`packing=True`: best-fit rows of `max_length`, padding-free batches of one
  long row). Its batch size counts rows: `rows` rows a step.
- `trl_tunekit`: the same script with `tunekit.speed_up` (fused LoRA, regional compile, FlexAttention for the
  packed rows) and `tunekit.PackingCollator` (each step's samples packed into rows, one shape).
- `trl_tunekit_eager` (asked for by name): the same without regional compile, which costs its first step a
  compilation of every block: the trade for a short run.

`trl` and `trl_tunekit` train the same samples in every step (`samples` a step, the same order, seed and
initial weights): their first losses must agree (`loss_agreement`), or they are not computing the same thing.
Each stack runs in a fresh process from random-init weights of the 7B shape (speed and memory are those of real
weights; the losses mean nothing). Timed: the optimizer steps after `warmup` (compilation and the first shapes
untimed), wall clock between the trainer's step ends; counted: the tokens of the samples each step trained on,
padding left out (`tokens_per_s`, real tokens), and the batch's full size (padding in). Peak memory is
`torch.cuda.max_memory_allocated` from the model's build on.

    python -m tunekit_course.trl_race --out notebooks/results     # the three stacks, one result file
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tunekit.config import REPO_ROOT
from tunekit.results import code_file
from tunekit_course.compare import _child

STACKS = ("trl", "trl_packing", "trl_tunekit")
EXTRA = ("trl_tunekit_eager",)  # tunekit's two lines without compiling: no first-step compile to pay
EXAMPLE = REPO_ROOT / "examples" / "sft_trl.py"


def example():
    """examples/sft_trl.py as a module: the script the stacks run."""
    spec = importlib.util.spec_from_file_location("sft_trl", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Counted:
    """A collator that records, per batch, the tokens of its samples and the size of what it returns."""

    def __init__(self, collate):
        self.collate, self.real, self.full = collate, [], []

    def __call__(self, features):
        batch = self.collate(features)
        self.real.append(sum(len(f["input_ids"]) for f in features))
        self.full.append(int(batch["input_ids"].numel()))
        return batch


def gsm8k_file() -> str:
    """The local GSM8K train file, else the hub's name for it."""
    from tunekit.data.records import local_copy

    path = local_copy("gsm8k")
    return str(path) if path else "openai/gsm8k"


def run_stack(stack: str, shape: str = "llama7b", samples: int = 32, rows: int = 4, steps: int = 24,
              warmup: int = 8, max_length: int = 2048) -> dict:
    """Train `warmup + steps` optimizer steps of one stack in this process; its row of the comparison."""
    from transformers import TrainerCallback

    from tunekit import memory
    from tunekit import model as mdl
    from tunekit.bench.timing import spread
    from tunekit.build import run_arch
    from tunekit.prepare import build_tokenizer
    from tunekit.presets import llama7b_lora, tiny

    if stack not in STACKS + EXTRA:
        raise ValueError(f"stack {stack!r}: choose one of {', '.join(STACKS + EXTRA)}")
    ex = example()
    cfg = llama7b_lora() if shape == "llama7b" else tiny(hidden_size=64, num_layers=2, num_heads=4,
                                                          intermediate_size=128, data="gsm8k", tokenizer_vocab=1024)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = build_tokenizer(cfg)
    memory.reset_peak_memory(device)
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model = mdl.build_model(run_arch(cfg, len(tokenizer)), "", torch.bfloat16 if device == "cuda" else torch.float32,
                            device, "sdpa", cfg.seed)
    torch.manual_seed(cfg.seed + 1)
    model = ex.with_lora(model, r=cfg.lora_r)
    total = warmup + steps
    per_step = rows if stack == "trl_packing" else samples
    dataset = ex.gsm8k(gsm8k_file(), limit=per_step * total * (16 if stack == "trl_packing" else 1) + 64)

    ends: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        trainer = ex.trainer_for(model, tokenizer, dataset, out, fast=stack.startswith("trl_tunekit"),
                                 compile="none" if stack == "trl_tunekit_eager" else "regional",
                                 packing=stack == "trl_packing", batch_size=per_step, max_length=max_length,
                                 max_steps=total, logging_steps=1, disable_tqdm=True, seed=cfg.seed)
        counted = trainer.data_collator = Counted(trainer.data_collator)
        trainer.add_callback(Timer())
        build_s = time.perf_counter() - t0
        trainer.train()
    times = [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])]
    real, full = sum(counted.real[warmup:total]), sum(counted.full[warmup:total])
    wall = ends[-1] - ends[warmup - 1]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    alloc, _ = memory.peak_memory_gb(device)
    return {"stack": stack, "tokens_per_s": round(real / wall, 1), "padded_tokens_per_s": round(full / wall, 1),
            "padding": round(1 - real / full, 4), "peak_memory_gb": round(alloc, 3),
            "step_time_s": round(statistics.median(times), 5), "step_time_spread": round(spread(times), 4),
            "step_times_s": [round(t, 5) for t in times], "steps_timed": len(times), "warmup_steps": warmup,
            "batch": {"samples" if stack != "trl_packing" else "rows": per_step, "max_length": max_length},
            "tokens_per_step": round(real / len(times), 1), "build_s": round(build_s, 1),
            "first_step_s": round(ends[0] - t0 - build_s, 1), "losses": [round(x, 5) for x in losses],
            "speed_ups": getattr(model, "tunekit_speed_ups", None)}


def race(name: str = "trl_gsm8k_llama7b", stacks: tuple[str, ...] = STACKS, shape: str = "llama7b",
         samples: int = 32, rows: int = 4, steps: int = 24, warmup: int = 8, verbose: bool = True) -> dict:
    """Run each stack in a fresh process, back to back; one result with a row per stack and the ratios."""
    from tunekit.presets import llama7b_lora
    from tunekit.results import new_result

    size = ["--shape", shape, "--samples", str(samples), "--rows", str(rows), "--steps", str(steps),
            "--warmup", str(warmup)]
    out = []
    for stack in stacks:
        t0 = time.perf_counter()
        row, why = _child(["--stack", stack, *size], timeout=1200, module="tunekit_course.trl_race")
        out.append(row or {"stack": stack, "error": why})
        if verbose:
            print(f"{stack:<12} " + (f"{row['tokens_per_s']:>9,.0f} real tok/s  padding {row['padding']:.0%}  peak "
                                     f"{row['peak_memory_gb']:6.2f} GB  first loss {row['losses'][0]:.4f}" if row
                                     else f"failed: {why}") + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    ok = {r["stack"]: r for r in out if "tokens_per_s" in r}
    ratios = {f"{a}_vs_{b}": round(ok[a]["tokens_per_s"] / ok[b]["tokens_per_s"], 3)
              for a, b in (("trl_tunekit", "trl"), ("trl_tunekit", "trl_packing"), ("trl_packing", "trl"),
                           ("trl_tunekit_eager", "trl"))
              if a in ok and b in ok}
    same = [ok[s]["losses"][0] for s in ("trl", "trl_tunekit", "trl_tunekit_eager") if s in ok][:2]
    agreement = abs(same[0] - same[1]) / abs(same[0]) if len(same) == 2 else None
    ours = ok.get("trl_tunekit") or ok.get("trl_tunekit_eager") or {}
    return new_result(name, llama7b_lora() if shape == "llama7b" else None, ours.get("tokens_per_s"),
                      ours.get("peak_memory_gb"), code_files=(code_file(__file__), "examples/sft_trl.py"),
                      call=f"trl_race.race({name!r}, stacks={tuple(stacks)!r}, shape={shape!r}, samples={samples}, "
                           f"rows={rows}, steps={steps}, warmup={warmup})",
                      stacks=out, ratios=ratios, loss_agreement=None if agreement is None else round(agreement, 5),
                      weights="random init of the shape, the same seed in every stack",
                      data="GSM8K train as prompt-completion records (the loss on the answer), the same order in "
                           "trl and trl_tunekit", tokens="real tokens of the samples trained on, padding left out")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tunekit_course.trl_race", description=__doc__.splitlines()[0])
    p.add_argument("--stack", choices=STACKS + EXTRA, help="run one stack in this process (the race's child)")
    p.add_argument("--stacks", default=",".join(STACKS))
    p.add_argument("--shape", default="llama7b", choices=("llama7b", "tiny"))
    p.add_argument("--samples", type=int, default=32, help="samples a step (trl, trl_tunekit)")
    p.add_argument("--rows", type=int, default=4, help="packed rows a step (trl_packing)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--name", default="trl_gsm8k_llama7b")
    p.add_argument("--out", default="", help="a folder for the result file")
    p.add_argument("--json", default="", help="(child) where to write the stack's row")
    a = p.parse_args(argv)
    if a.stack:
        row = run_stack(a.stack, a.shape, a.samples, a.rows, a.steps, a.warmup)
        Path(a.json).write_text(json.dumps(row))
        return 0
    result = race(a.name, tuple(a.stacks.split(",")), a.shape, a.samples, a.rows, a.steps, a.warmup)
    if a.out:
        from tunekit.results import save_result

        print(f"wrote {save_result(result, a.out)}")
    return 0 if all("tokens_per_s" in r for r in result["stacks"]) else 1


if __name__ == "__main__":
    sys.exit(main())


def trl_table(rs: dict[str, dict]) -> str:
    """Every TRL race result (`race`): each stack's real tok/s, padding, peak memory and first step (compilation
    included) in that one run, tunekit's ratios, and how far apart the first losses of `trl` and `trl_tunekit`
    were (the same samples and weights: the same loss)."""
    rows = ["| run | stack | real tok/s | padding | peak GB | first step s | vs plain TRL | loss agreement | commit |",
            "|---|---|---|---|---|---|---|---|---|"]
    labels = {"trl": "plain TRL (padded batches)", "trl_packing": "TRL, its own packing (`packing=True`)",
              "trl_tunekit": "TRL + `tunekit.speed_up` + `tunekit.PackingCollator`",
              "trl_tunekit_eager": "the same, `speed_up(compile=\"none\")`"}
    for r in sorted((r for r in rs.values() if str(r.get("call", "")).startswith("trl_race.")), key=lambda r: r["name"]):
        plain = next((x for x in r["stacks"] if x["stack"] == "trl" and "tokens_per_s" in x), None)
        for x in r["stacks"]:
            if "tokens_per_s" not in x:
                rows.append(f"| `{r['name']}` | {labels.get(x['stack'], x['stack'])} | failed | | | | | | |")
                continue
            ratio = f"{x['tokens_per_s'] / plain['tokens_per_s']:.2f}x" if plain else "-"
            agree = f"{r['loss_agreement']:.1e}" if x["stack"].startswith("trl_tunekit") and r["loss_agreement"] is not None \
                else ""
            rows.append(f"| `{r['name']}` | {labels.get(x['stack'], x['stack'])} | {x['tokens_per_s']:,.0f} | "
                        f"{x['padding']:.0%} | {x['peak_memory_gb']:.1f} | {x['first_step_s']:.0f} | {ratio} | "
                        f"{agree} | {(r['commit'] or '-')[:7]} |")
    if len(rows) == 2:
        rows.append("| *(no TRL race result yet)* |  |  |  |  |  |  |  |  |")
    return "\n".join(rows)
