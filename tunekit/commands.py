"""What each `tunekit` command does, once its arguments are parsed (`tunekit.arguments`): `RUN[name](args, cfg, rest)`
with the resolved config (None for a command without config fields) and the config fields as given; `train`,
`export` and `generate` own their errors and signals. Each imports what it needs when it runs, so `tunekit
--help` loads no model code.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from contextlib import contextmanager

from tunekit.config import ConfigError
from tunekit.presets import resolve


def resume_command(argv: list[str]) -> str:
    """The command line that continues the run `tunekit <argv>` started."""
    args = [a for a in argv if a != "--overwrite"]
    return shlex.join(["tunekit", *args, *([] if "--resume" in args else ["--resume"])])


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP before a command caught it: raised like Ctrl-C's KeyboardInterrupt, so the blocks
    that remove temps (`atomic_output`) run and the command ends with one line instead of dying mid-write."""

    def __init__(self, signum: int):
        self.signum = signum
        RECEIVED.append(signum)
        super().__init__(signal.Signals(signum).name)


# The signals a `Stopped` was raised for in this process. A library's import can swallow the exception (seen in CI:
# the signal landed inside transformers' lazy import, which went on with a half-imported module and failed later
# with a ModuleNotFoundError), so `train` looks here too: a signal received is a stop, whatever broke after it.
RECEIVED: list[int] = []


@contextmanager
def signals_held():
    """Ctrl-C, SIGTERM and SIGHUP while torch and transformers import are noted in RECEIVED, not raised: an
    exception raised inside a C extension's import can break it in ways no `except` catches (seen in CI: SIGHUP
    0.3 s after start aborted the process inside torch's import, exit -6 with a C++ stack, no line of ours). The
    command looks at RECEIVED once the imports are done; a second signal of the same kind raises at once, for an
    import that hangs. The handlers are put back on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def hold(signum, frame):
        if signum in RECEIVED:
            raise Stopped(signum)
        RECEIVED.append(signum)

    kinds = [signal.SIGINT, signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])]
    old = {s: signal.signal(s, hold) for s in kinds}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def signal_name(e: KeyboardInterrupt) -> tuple[str, int]:
    signum = getattr(e, "signum", signal.SIGINT)
    return signal.Signals(signum).name, 128 + signum


def say_error(message: str) -> None:
    """Print the command's last line to stderr; a terminal that hung up (SIGHUP) takes it nowhere."""
    try:
        print(message, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _saved(result: dict | None, out: str) -> None:
    """Write a command's result file (under torchrun, rank 0 alone: tok/s are per GPU) and say where."""
    from tunekit import distributed
    from tunekit.results import save_result

    if result is not None and distributed.is_main():
        print(f"result -> {save_result(result, out)}")


def env_memory_cap():
    """(a `memory.memory_cap` context, its GB or None) from TUNEKIT_MEMORY_GB: `tunekit bench` and `tunekit train`
    run as on a card of that size (the course's notebooks set it to fit a smaller GPU). Without a CUDA GPU there
    is nothing to cap: it says so and caps nothing."""
    import contextlib
    import os

    gb = float(os.environ.get("TUNEKIT_MEMORY_GB") or 0) or None
    if gb is None:
        return contextlib.nullcontext(), None
    import torch

    from tunekit import distributed, memory

    if not torch.cuda.is_available():
        print(f"TUNEKIT_MEMORY_GB={gb:g} ignored: no CUDA GPU to cap")
        return contextlib.nullcontext(), None
    print(f"TUNEKIT_MEMORY_GB={gb:g}: GPU memory capped at {gb:g} GB (memory.memory_cap)")
    return memory.memory_cap(gb, device=distributed.local_rank()), gb


def _doctor(args, cfg, rest) -> int:
    from tunekit import doctor

    return doctor.main(distributed=args.distributed)


def _results(args, cfg, rest) -> int:
    from tunekit import results
    from tunekit_course import RESULTS, claims, readme

    rs = results.by_name(*(args.paths or [RESULTS]))
    if args.update_readme:
        print("README.md " + ("updated" if readme.update_readme() else "already up to date"))
    elif args.claims:
        print(claims.claims_table(rs))
    else:
        print(results.format_table(sorted(readme.step_results(rs), key=lambda r: r["name"])))
    return 0


def _commbench(args, cfg, rest) -> int:
    from tunekit.bench.comm import run_commbench

    result = run_commbench(args.name, tuple(float(x) for x in args.sizes_mb.split(",")))
    for r in (result or {}).get("rows", []):
        print(f"{r['mb']:>6g} MB  {1e3 * r['seconds']:8.3f} ms  algbw {r['algbw_gbps']:7.2f} GB/s  "
              f"busbw {r['busbw_gbps']:7.2f} GB/s")
    _saved(result, args.out)
    return 0


def _bench(args, cfg, rest) -> int:
    from tunekit import bench

    if args.compare:  # the course's three-stack comparison
        from tunekit.results import save_result
        from tunekit_course.compare import run_compare, save_chart

        result = run_compare(args.preset, rest, args.name, tuple(filter(None, args.stacks.split(","))),
                             args.unsloth_site)
        path = save_result(result, args.out)
        print(f"result -> {path}\nchart -> {save_chart(result, path.with_suffix('.png'))}")
        return 0
    if args.train_loop and args.repeat > 1:
        raise ValueError("--repeat applies to the step bench; run --train-loop once per process")
    if args.repeat > 1:  # fresh processes, each capping itself (TUNEKIT_MEMORY_GB is theirs too)
        result = bench.measure_noise(args.preset, rest, args.name or f"noise_{cfg.preset}", args.repeat)
        _saved(result, args.out)
        return 0
    cap, gb = env_memory_cap()
    with cap:
        if args.profile:
            result = bench.profile_step(cfg, name=args.name)
        elif args.epoch:
            result = bench.run_epoch(cfg, args.epoch, args.name)
        elif args.train_loop:
            result = bench.run_train_loop(cfg, args.name)
        else:
            result = bench.run_bench(cfg, args.name, memory_cap_gb=gb)
    _saved(result, args.out)
    return 0


def _converge(args, cfg, rest) -> int:
    from tunekit_course.race import parse_sweep, run_convergence

    _saved(run_convergence(cfg, parse_sweep(args.sweep), args.name), args.out)
    return 0


def _fit(args, cfg, rest) -> int:
    from tunekit.bench.fit import find_micro_batch

    _saved(find_micro_batch(cfg, args.target_batch, args.memory_gb, args.name), args.out)
    return 0


def _databench(args, cfg, rest) -> int:
    from tunekit_course import databench

    if args.experiment == "train":
        result = databench.run_train_experiment(cfg, steps=args.steps)
    elif args.experiment == "loader":
        result = databench.run_loader_experiment(cfg)
    else:
        result = databench.run_read_experiment(cfg, args.corpus_mb, args.jsonl_rows)
    _saved(result, args.out)
    return 0


def _estimate(args, cfg, rest) -> int:
    from tunekit import estimate, fitting

    if args.gpus < 1:
        raise ValueError("--gpus must be 1 or more")
    if not cfg.vocab_size:
        raise ValueError("estimate needs --vocab-size (the tokenizer is not loaded)")
    setup = estimate.Setup.of(cfg, world_size=args.gpus)
    print(estimate.format_estimate(estimate.estimate_memory_for(setup)))
    if not args.memory_gb:
        return 0
    budget = args.memory_gb * 1e9
    best = fitting.estimate_max_batch(setup, budget)
    if best == 0:
        print(fitting.cannot_fit_message(setup, budget))
        return 1
    allocated = fitting.estimate_max_batch(setup, budget, reserve_factor=1.0)
    accum = fitting.grad_accum_for(cfg.batch_size * cfg.grad_accum, best)
    print(f"fits {args.memory_gb:g} GB up to micro-batch {best} x {cfg.max_length} counting reserved memory "
          f"(~{fitting.RESERVE_FACTOR:g}x the estimate: the caching allocator's fragmentation), "
          f"{allocated} counting allocated memory alone")
    print(f"for {cfg.batch_size * cfg.grad_accum} samples a step: --batch-size {min(best, cfg.batch_size)} "
          f"--grad-accum {accum if best < cfg.batch_size else cfg.grad_accum}")
    return 0


def _prepare(args, cfg, rest) -> int:
    from tunekit import runlock, stopping
    from tunekit.prepare import prepare

    with stopping.removed_if_left_empty(cfg.run_dir()), runlock.hold(cfg.run_dir(), "tunekit prepare"):
        prepare(cfg, num_proc=args.num_proc)
    return 0


RUN = {"doctor": _doctor, "results": _results, "commbench": _commbench, "bench": _bench, "converge": _converge,
       "fit": _fit, "databench": _databench, "estimate": _estimate, "prepare": _prepare}


def export(args) -> int:
    """`tunekit export RUN` and `tunekit generate RUN PROMPT...`: a finished run's model, merged or answering."""
    from tunekit import export
    from tunekit.config import ConfigError
    from tunekit.model import DTYPE, resolve_device

    try:
        device = resolve_device(args.device)
        if args.command == "export":
            r = export.merge_run(args.run_dir, args.out or None, device, DTYPE[args.dtype],
                                 trust_remote_code=args.trust_remote_code)
            print(f"merged -> {r['merged_dir']} ({r['dtype']}); largest logit difference, relative: merged vs "
                  f"adapter {r['merged_vs_adapter']:.1e}, reloaded vs merged {r['reloaded_vs_merged']:.1e}")
        else:
            texts = export.generate(args.run_dir, args.prompts, args.max_new_tokens, device,
                                    trust_remote_code=args.trust_remote_code)
            for prompt, text in zip(args.prompts, texts):
                print(f"{prompt}{text}\n")
    except KeyboardInterrupt as e:
        name, code = signal_name(e)
        what = "; nothing was written (its temp folder was removed)" if args.command == "export" else ""
        say_error(f"tunekit {args.command}: interrupted by {name}{what}")
        return code
    except Exception as e:  # one line for every failure, a full disk included
        from tunekit import stopping

        if (full := stopping.no_space_message(e, getattr(args, "out", "") or args.run_dir)) is None and not isinstance(
                e, (ConfigError, ValueError, FileNotFoundError, RuntimeError, OSError)):
            raise
        say_error(f"tunekit {args.command}: error: {full or e}")
        return 2
    return 0


def train(args, rest: list[str], argv: list[str]) -> int:
    """`tunekit train`: exit 0 when done, 2 on bad input or a folder it must not touch, 1 when the run
    diverged, 128 + the signal (130 for Ctrl-C, 143 for SIGTERM) when stopped — each with one line, no
    traceback."""
    def early(e: KeyboardInterrupt) -> int:
        name, code = signal_name(e)
        say_error(f"tunekit train: interrupted by {name} before training started; the run folder is as it was.")
        return code

    try:
        with signals_held():
            from tunekit import train as tr
            from tunekit.stopping import Diverged, Interrupted
    except KeyboardInterrupt as e:  # a second Ctrl-C (or SIGTERM, SIGHUP) while torch imports
        return early(e)
    except ImportError:  # a signal landed inside a C extension's import, which then fails as a second load
        if RECEIVED:  # (numpy: "cannot load module more than once per process"): the signal's stop all the same
            return early(Stopped(RECEIVED[-1]))
        raise
    if RECEIVED:  # a signal whose exception an import swallowed
        return early(Stopped(RECEIVED[-1]))
    out_dir = None
    try:
        cfg = resolve(args.preset, rest)
        out_dir = cfg.out_dir
        cap, _ = env_memory_cap()
        with cap:
            summary = tr.train(cfg, resume=args.resume, overwrite=args.overwrite,
                               allow_config_change=args.allow_config_change)
    except Diverged as e:
        say_error(f"tunekit train: {e}")
        return 1
    except Interrupted as e:
        say_error(f"tunekit train: {e}. Continue with: {resume_command(argv)}")
        return 128 + e.signum
    except KeyboardInterrupt as e:  # before train caught the signals
        return early(e)
    except Exception as e:  # one line for every failure, a full disk included
        if RECEIVED:  # what broke after a signal whose exception a library swallowed: the signal's stop
            return early(Stopped(RECEIVED[-1]))
        full = tr.stopping.no_space_message(e, out_dir) if out_dir else None
        if full is None and not isinstance(e, (ConfigError, ValueError, FileNotFoundError, RuntimeError, OSError)):
            raise
        say_error(f"tunekit train: error: {full}. Continue with: {resume_command(argv)}" if full else
                  f"tunekit train: error: {e}")
        return 2
    if tr.distributed.is_main():  # under torchrun, once
        try:
            print(f"done: {summary['steps']} steps, loss {summary['losses'][0]:.3f} -> {summary['final_loss']:.3f}"
                  if summary["losses"] else "done: nothing to do")
            print(f"outputs in {summary['run_dir']}")
        except (OSError, ValueError):  # the terminal hung up; the run is done all the same
            pass
    return 0
