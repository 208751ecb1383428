"""The run: open the folder, build the pieces, loop over steps, finish. Read `train` top to bottom.

The pieces come from `tunekit/build.py` (config -> model, optimizer, batches) and `tunekit/prepare.py` (the
data); one optimizer step is `step.train_step`. Speed choices, each with its reason:
- bf16 weights and autocast on GPUs that have it; fp32 on CPU (CPU bf16 matmuls are slow and inexact).
- No attention mask: batches are right-padded and attention is causal, so real tokens never see a pad.
  Without a mask SDPA can pick its fused flash/cuDNN kernels.
- Fused AdamW on CUDA (one kernel for all parameters instead of several per tensor).
- Progress, metrics and checkpoints happen once per step, outside the micro-step.

Around the loop, nothing a user ran is lost (README, "Reliability"): a run folder holds one run (checked by
`checkpoint.open_run` before any data or model work), its files are written once the run has started, a
non-finite loss stops the run with its metrics row kept, and SIGINT/SIGTERM finish the step and checkpoint
(tunekit/stopping.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
import signal
import time
from pathlib import Path

import torch

from tunekit import checkpoint, distributed, memory, runlock, speedups, stopping
from tunekit import model as mdl
from tunekit.build import (
    batch_plan,
    batches_from,
    build_training,
    collator,
    resolve_runtime,
    resolved_config,
    run_length,
    threads_for,
)
from tunekit.config import TuneConfig, save_config
from tunekit.data import batching, prepared
from tunekit.data.tokens import preview
from tunekit.io import atomic_write_json, atomic_write_text
from tunekit.prepare import prepare, split_eval
from tunekit.progress import MetricsLog, Position
from tunekit.step import count_targets, evaluate, to_device, train_step
from tunekit.stopping import (
    Diverged,
    Interrupted,
    read_metrics,  # noqa: F401  (train.read_metrics: a run's rows, for plotting)
)


def train(cfg: TuneConfig, resume: bool = False, stop_after: int | None = None, progress: bool = True,
          overwrite: bool = False, allow_config_change: bool = False) -> dict:
    """Train `cfg.max_steps` steps; checkpoint every `save_every`; with `resume`, continue from the newest
    checkpoint that verifies, exactly. `stop_after` ends the process's work after that step (as a kill
    would) — for time-boxed sessions and the resume test. Returns a summary with the loss curve.

    Nothing is lost: a folder holding another run is refused unless `overwrite` (its files are deleted once
    the new run has started); run files are written only once data and model are built; a resume refuses a
    changed config unless every change is in `config.RESUME_SAFE_FIELDS` and `allow_config_change`. A
    non-finite loss or gradient norm writes its metrics row and raises `Diverged`; SIGINT/SIGTERM finish the
    step, write a checkpoint and raise `Interrupted`."""
    if resume and overwrite:
        raise ValueError("--resume continues the run in the folder and --overwrite replaces it: pick one.")
    t0 = time.perf_counter()
    device, dtype = resolve_runtime(cfg)
    distributed.init(device)  # under torchrun: the process group, this rank's GPU (else nothing)
    main = distributed.is_main()  # rank 0 alone prints and writes the run's files
    cfg = batch_plan(cfg, distributed.world_size())
    run_dir = cfg.run_dir()
    say = print if progress and main else _quiet
    state = {"started": False, "signal": None, "step": 0, "checkpoint": None}  # shared with the signal handler
    # The lock (rank 0's: one launch is one writer) is taken before the folder is looked at and dropped before
    # an empty new folder is removed.
    with stopping.removed_if_left_empty(run_dir), runlock.hold(run_dir, "this run") if main else \
            contextlib.nullcontext(), stopping.stop_requests(state), speedups.tf32(cfg.tf32, device), \
            threads_for(cfg, device):
        opened = _open(cfg, run_dir, resolved_config(cfg, device, dtype), resume, overwrite, allow_config_change,
                       say, main)
        if opened.done is not None:
            return opened.done
        timings = {"start_s": time.perf_counter() - t0}  # the device resolved, the run folder checked
        cfg, tokenizer, ds, eval_ds, stats = _data(cfg, opened, progress and main, say)
        torch.manual_seed(cfg.seed)
        t_build = time.perf_counter()
        timings["prepare_s"] = t_build - t0 - timings["start_s"]  # tokenizing (or reading it back), held-out rows
        model, optimizer, scheduler, options = build_training(cfg, len(tokenizer), device, dtype, cfg.max_steps,
                                                              progress and main)
        timings["build_s"] = time.perf_counter() - t_build
        at = _resume(opened, model, optimizer, scheduler, say)
        # The run has started: only now are its files written (a failed start leaves the folder as it was).
        state.update(started=True, step=at.step, checkpoint=opened.ckpt)  # a signal now stops at a step's end
        rows = _start(cfg, run_dir, resolved_config(cfg, device, dtype), opened, stats, at.step, main, overwrite, say)
        last_finite = next(((r["step"], r["loss"]) for r in reversed(rows) if r["loss"] is not None), None)
        stream = batches_from(ds, cfg, tokenizer.pad_token_id, at.epoch, at.next_batch)
        log = MetricsLog(run_dir / "metrics.jsonl" if main else None, cfg.max_steps, at.step, progress, say)
        memory.reset_peak_memory(device)
        losses, eval_losses, saved_at, t_loop, eval_total = [], [], at.step, time.perf_counter(), 0.0
        world, step = distributed.world_size(), at.step
        host_ids = memory.host_embedded(model)  # the token ids stay on the host for a table there
        with speedups.frozen_heap(cfg.gc_freeze) as refreeze, log:  # what is built, out of the collector's way
            while step < cfg.max_steps:
                # This rank's samples, real tokens and target tokens, counted on the host before the batches
                # go to the GPU: counting them there would wait for the GPU (a host sync a micro-batch).
                micro, counts = [], [0, 0, 0]
                for _ in range(cfg.grad_accum):
                    epoch, index, batch = next(stream)
                    counts[0] += batching.count_samples(batch)
                    counts[1] += int(batch.pop("attention_mask").sum())
                    counts[2] += count_targets([batch])
                    micro.append(to_device(batch, device, host_ids))
                stop = state["signal"] is not None
                if world > 1:  # every rank's counts, and whether any was asked to stop: one collective a step
                    *counts, stop = distributed.all_reduce_sum(torch.tensor([*counts, int(stop)])).tolist()
                if stop:  # a signal (on any rank) ends the run after the step it came in, on every rank alike
                    state["signal"] = state["signal"] or signal.SIGTERM
                    break
                out = train_step(model, micro, optimizer, scheduler, cfg.max_grad_norm, n_targets=int(counts[2]),
                                 **options)
                step += 1
                at.advance(epoch, index, int(counts[0]), int(counts[1]), time.perf_counter() - t0)
                loss, grad_norm = out["loss"].item(), float(out["grad_norm"])
                if "first_step_s" not in timings:  # compiling and CUDA's warm-up happen here, once a run
                    timings["first_step_s"] = time.perf_counter() - t_loop
                    log.excluded += refreeze()  # what compiling made joins the frozen heap (not a step's time)
                losses.append(loss)
                diverged = not (math.isfinite(loss) and math.isfinite(grad_norm))
                eval_now = eval_ds is not None and not diverged and (
                    step == cfg.max_steps or (cfg.eval_every and step % cfg.eval_every == 0))
                eval_s = 0.0
                if eval_now:  # not counted in tok/s
                    t_eval = time.perf_counter()
                    eval_losses.append((step, evaluate(options["step_module"], model, eval_ds, cfg.batch_size,
                                                       collator(cfg, tokenizer.pad_token_id), device,
                                                       options["sdpa_backends"])))
                    eval_s = time.perf_counter() - t_eval
                    eval_total += eval_s
                log.tokens(int(counts[1]))
                if diverged or eval_now or step % cfg.log_every == 0 or step == cfg.max_steps:
                    log.row(step, loss, grad_norm, scheduler.get_last_lr()[0], at, device, eval_s,
                            eval_losses[-1][1] if eval_now else None)
                if diverged:
                    log.close()
                    last = (f"last finite loss {last_finite[1]:.4f} at step {last_finite[0]}" if last_finite
                            else "no finite loss before it")
                    raise Diverged(f"diverged at step {step}: loss {loss}, grad norm {grad_norm} ({last}); last "
                                   f"good checkpoint: {state['checkpoint'] or 'none'}. Lower --lr or clip with "
                                   "--max-grad-norm, and start again.")
                last_finite = (step, loss)
                log.step()
                if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
                    t_save = time.perf_counter()
                    state["checkpoint"] = checkpoint.save_checkpoint(run_dir, step, model, optimizer, scheduler,
                                                                     at.position(), cfg.keep_checkpoints)
                    saved_at = step  # the checkpoint's seconds are the wall-clock's, not the steps' (tok/s)
                    log.excluded += (spent := time.perf_counter() - t_save)
                    timings["checkpoint_s"] = timings.get("checkpoint_s", 0.0) + spent
                state["step"] = step
                if stop_after is not None and step >= stop_after:
                    break
        if state["signal"] is not None and step < cfg.max_steps:
            _interrupted(state, step, saved_at, run_dir, model, optimizer, scheduler, at, cfg.keep_checkpoints)
        summary = {"steps": step, "losses": losses, "final_loss": losses[-1] if losses else None,
                   "samples_seen": at.samples, "tokens_seen": at.tokens,
                   "epochs_seen": round(at.samples / max(1, stats["samples"]), 4),
                   "packing": stats["packing"], "data": stats, "run_dir": str(run_dir),
                   "eval_losses": eval_losses, "eval_loss": eval_losses[-1][1] if eval_losses else None,
                   "vocab_size": len(tokenizer), "params_trainable": mdl.count_parameters(model)[0],
                   # this process's wall-clock seconds: start (device, run folder), prepare (tokenizing or reading
                   # it back), build (model, adapters, wrapping), train (the steps, evaluations, checkpoints)
                   "timings": {**{k: round(v, 3) for k, v in timings.items()},
                               "train_s": round(time.perf_counter() - t_loop, 3), "eval_s": round(eval_total, 3)}}
        if step >= cfg.max_steps:  # (a signal now changes nothing: the run is finishing)
            _finish(cfg, run_dir, summary, opened.finishing, model, optimizer, scheduler, at, main)
        distributed.barrier()  # no rank leaves (and tears the group down) while another still talks to it
        return summary


# ---- opening the run ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Opened:
    """What the run folder said before any data or model work: the checkpoint to resume from (None: a new run),
    the config changes a resume allows, whether only the outputs after the final checkpoint are missing
    (`finishing`), and `done`: the summary when there is nothing to do."""

    ckpt: Path | None
    changes: list[str]
    finishing: bool = False
    done: dict | None = None


def _open(cfg: TuneConfig, run_dir: Path, resolved: TuneConfig, resume: bool, overwrite: bool,
          allow_config_change: bool, say, main: bool) -> _Opened:
    ckpt, changes = checkpoint.open_run(run_dir, resolved, resume, overwrite, allow_config_change, say, clean=main)
    step = checkpoint.checkpoint_step(ckpt) if ckpt else 0
    if ckpt is not None and (was := checkpoint.checkpoint_world(ckpt)) != distributed.world_size():
        raise checkpoint.CheckpointError(
            f"{ckpt} was written by a run on {was} process(es), this one has {distributed.world_size()}: each "
            f"rank's place in the data is counted in its own batches. Resume with the same launch "
            f"(torchrun --nproc_per_node {was}{' ...' if was > 1 else ''}), or start a new run.")
    planned = cfg.max_steps
    if cfg.epochs and ckpt is not None:  # the data decides the length: known here only if epochs is as saved
        saved_cfg = checkpoint.saved_config(run_dir)
        planned = saved_cfg.max_steps if saved_cfg.epochs == cfg.epochs else math.inf
    finishing = step >= planned and not finished(run_dir, resolved)
    if step >= planned and not finishing:  # before the data and the model are built
        say(f"nothing to do: {run_dir} already ran {step} of {planned} steps")
        stats = json.loads((run_dir / "summary.json").read_text()).get("data")
        return _Opened(ckpt, changes, done={"steps": step, "losses": [], "final_loss": None, "data": stats,
                                            "run_dir": str(run_dir)})
    if finishing:  # killed after its final checkpoint, before the outputs that follow it were written
        say(f"resume: {run_dir} ran all {step} steps but its outputs were not all written; writing them from {ckpt}")
    elif resume and ckpt is None:
        say(f"resume: no checkpoint in {run_dir}; starting fresh")
    return _Opened(ckpt, changes, finishing)


def _data(cfg: TuneConfig, opened: _Opened, verbose: bool, say):
    """The run's data: prepared (rank 0 tokenizes into the cache; the others then read what it wrote), one sample
    shown, held-out rows split off, and the run's length when it is given in epochs. Returns (cfg with packing
    and max_steps resolved, tokenizer, training rows, held-out rows or None, stats)."""
    tokenizer, ds, stats = distributed.main_first(lambda: prepare(cfg, verbose=verbose, commit=False,
                                                                  check_run=opened.ckpt is not None))
    say(preview(ds, tokenizer, stats))  # one sample as the model sees it, the masked part marked
    ds, eval_ds = distributed.main_first(lambda: split_eval(ds, cfg, tokenizer, stats))
    if eval_ds is not None:
        when = f"{'every ' + str(cfg.eval_every) + ' steps and ' if cfg.eval_every else ''}at the end"
        say(f"held out: {len(eval_ds)} rows of {cfg.eval_data} for the eval loss ({when})" if cfg.eval_data else
            f"held out: {len(eval_ds)} of {len(ds) + len(eval_ds)} rows for the eval loss ({when})")
    world = distributed.world_size()
    if len(ds) // world < cfg.batch_size:  # each rank reads len(ds) // world rows
        what = "packed rows" if stats["packing"] == "pack" else "samples"
        on = f" on each of {world} processes" if world > 1 else ""
        raise ValueError(f"{cfg.data}: {len(ds) // world} {what}{on}, fewer than one batch of {cfg.batch_size}.")
    cfg = run_length(dataclasses.replace(cfg, packing=stats["packing"]), len(ds), world, say)
    return cfg, tokenizer, ds, eval_ds, stats


def _resume(opened: _Opened, model, optimizer, scheduler, say) -> Position:
    """Load the checkpoint (open_run verified it) into the built pieces; where the run is."""
    for change in opened.changes:
        say(f"resume: {change} (--allow-config-change)")
    if opened.ckpt is None:
        return Position()
    saved = checkpoint.load_checkpoint(opened.ckpt, model, optimizer, scheduler, verify=False)
    data = saved["data"]
    say(f"resume: from {opened.ckpt} (step {saved['step']}, epoch {data['epoch']}, batch {data['next_batch']})")
    elapsed = data.get("elapsed_s", 0.0)
    return Position(saved["step"], data["epoch"], data["next_batch"], data.get("samples", 0), data.get("tokens", 0),
               elapsed, elapsed)


def _start(cfg: TuneConfig, run_dir: Path, resolved: TuneConfig, opened: _Opened, stats: dict, step: int,
           main: bool, overwrite: bool, say) -> list[dict]:
    """Write the run's files now that it has started: the earlier run's removed (--overwrite), the prepared data
    copied in with its record, checkpoints newer than the one resumed (they failed to verify) removed, the
    metrics cut back to the resumed step, the resolved config. Returns the metrics rows kept."""
    if main and overwrite and (removed := checkpoint.remove_run(run_dir)):
        say(f"overwrite: removed the earlier run's {', '.join(removed)} from {run_dir}")
    staged = stats.pop("staged", None)  # made in the cache: copied into the folder now that the run has started
    if main:  # the prepared data it trains on, and its record of them (data.json) that a resume checks
        prepared.commit(run_dir, staged, stats, resumed=opened.ckpt is not None)
    if main and opened.ckpt is not None:  # their steps are done again
        found = checkpoint.checkpoints(run_dir)
        for later in found[found.index(opened.ckpt) + 1:]:
            shutil.rmtree(later, ignore_errors=True)
    metrics_file = run_dir / "metrics.jsonl"
    rows = [r for r in stopping.read_metrics_file(metrics_file) if r["step"] <= step] if opened.ckpt else []
    if main:
        atomic_write_text(metrics_file, "".join(stopping.json_line(r) for r in rows))
        save_config(resolved, run_dir / "config.json")
    return rows


# ---- finishing ---------------------------------------------------------------------------------------------------


def _interrupted(state: dict, step: int, saved_at: int, run_dir: Path, model, optimizer, scheduler, at: Position,
                 keep: int) -> None:
    """A signal stopped the run at the end of `step`: write its checkpoint (unless it has one) and raise
    Interrupted saying what a resume continues from."""
    if saved_at != step:
        state["checkpoint"] = checkpoint.save_checkpoint(run_dir, step, model, optimizer, scheduler, at.position(), keep)
        what = f"at step {step}; checkpoint written: {state['checkpoint']}"
    elif state["checkpoint"] is not None:
        what = f"at step {step}; its checkpoint is {state['checkpoint']}"
    else:
        what = "before the first step finished; no checkpoint"
    raise Interrupted(state["signal"], step, state["checkpoint"], what)


def _finish(cfg: TuneConfig, run_dir: Path, summary: dict, finishing: bool, model, optimizer, scheduler, at: Position,
            main: bool) -> None:
    """The run is done: its final checkpoint, then the adapter (LoRA: a PEFT folder; full fine-tuning: the whole
    model, loadable with from_pretrained) and `summary.json`. A run `finishing` (killed after its final
    checkpoint) ran no step here: its last losses come from its own metrics."""
    if finishing:
        rows = stopping.read_metrics_file(run_dir / "metrics.jsonl")
        losses_run = [r["loss"] for r in rows if r.get("loss") is not None]
        summary.update(final_loss=losses_run[-1] if losses_run else None,
                       eval_losses=[(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None])
        summary["eval_loss"] = summary["eval_losses"][-1][1] if summary["eval_losses"] else None
    else:  # (finishing: the final checkpoint is there, verified)
        checkpoint.save_checkpoint(run_dir, summary["steps"], model, optimizer, scheduler, at.position(),
                                   cfg.keep_checkpoints)
    weights = distributed.full_trainable(model) if distributed.is_sharded(model) else None  # all ranks
    if main:
        mdl.save_adapter(model, run_dir / ("adapter" if cfg.method != "full" else "model"), weights)
        atomic_write_json(run_dir / "summary.json", {k: v for k, v in summary.items() if k != "losses"})


def finished(run_dir: Path, cfg: TuneConfig) -> bool:
    """Whether a run whose final checkpoint exists also wrote what follows it: the adapter (or the whole model)
    and `summary.json`. A kill between them leaves a run that a resume finishes rather than calls done."""
    out = run_dir / ("model/config.json" if cfg.method == "full" else "adapter/adapter_config.json")
    return out.exists() and (run_dir / "summary.json").exists()


def _quiet(*args, **kwargs) -> None:
    pass
