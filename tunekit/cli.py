"""The `tunekit` command: train, bench, fit, databench, estimate, prepare, doctor, results, converge, export,
generate.

Every command but doctor takes `--preset NAME` and then any config field as `--field value`
(`tunekit train --preset tiny --lr 1e-3 --max-steps 20`); unknown fields are rejected.
`tunekit train --help` lists the fields with their docs.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import shlex
import signal
import sys
import textwrap
import threading

from tunekit.config import PRESETS, RESUME_SAFE_FIELDS, ConfigError, TuneConfig, field_types, resolve


def field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal under it in TuneConfig)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(TuneConfig)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def fields_help(preset: str = "tiny") -> str:
    """The config fields with their docs and their values in `preset` (the command's default preset)."""
    defaults = PRESETS[preset]()
    docs = field_docs()
    lines = [(f"config fields (override any with --field value; defaults are the {preset} preset's, and "
              "another --preset changes them):")]
    for name, typ in field_types().items():
        lines.append(f"  --{name.replace('_', '-')} {typ.__name__.upper()} (default {getattr(defaults, name)!r})")
        lines.append(textwrap.fill(docs.get(name, ""), 100, initial_indent=" " * 6, subsequent_indent=" " * 6,
                                   break_on_hyphens=False))
    return "\n".join(lines)


TRUST_HELP = ("run the Python code a model or tokenizer folder brings with it (transformers' trust_remote_code); "
              "off by default, and never taken from the run's own config.json: read that code first")


def make_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: `--resum` must not quietly mean `--resume`.
    parser = argparse.ArgumentParser(prog="tunekit", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    common = dict(formatter_class=argparse.RawDescriptionHelpFormatter, epilog=fields_help(), allow_abbrev=False)
    p = sub.add_parser("train", help="fine-tune a model", description="Train for --max-steps steps, "
                       "checkpointing every --save-every; --resume continues from the newest checkpoint\n"
                       "that verifies. Ctrl-C or SIGTERM finishes the step, writes a checkpoint and prints the "
                       "command that\nresumes (exit 130 / 143); a diverging run stops with exit 1.", **common)
    p.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out-dir from its newest checkpoint that verifies; the config must "
                   "match the one the run started with")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --out-dir (its files are deleted once the new run has "
                   "started); without it, a folder holding another run is refused")
    p.add_argument("--allow-config-change", action="store_true",
                   help="with --resume, let these fields differ from the saved config: "
                   f"{', '.join(RESUME_SAFE_FIELDS)} (a new max_steps recomputes the cosine schedule, so the "
                   "learning rate jumps); any other change is refused")
    p = sub.add_parser("bench", help="time the training step and write a result JSON",
                       description="Warm up, time --bench-steps steps, report the median; write JSON.", **common)
    p.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--name", default="", help="result name (default: the preset)")
    p.add_argument("--out", default="runs/bench", help="a .json file or a folder (default runs/bench)")
    p.add_argument("--repeat", type=int, default=1, help="bench in this many fresh processes and record the "
                   "run-to-run spread (one result with every run)")
    p.add_argument("--profile", action="store_true", help="where the step's time goes: torch.profiler over a few "
                   "steps, kernel time by category and the costliest kernels (default name profile_<preset>)")
    p.add_argument("--epoch", type=float, default=0.0, metavar="FRACTION",
                   help="time `tunekit train` for this share of an epoch from a fresh folder (tokenizing, build, "
                   "compile, steps, eval), and project a whole epoch (default name epoch_<preset>)")
    p.add_argument("--train-loop", action="store_true", help="time `tunekit train` itself on the config's real "
                   "data (its batches, DataLoader and logging) for --bench-max-steps steps, not the bare step on "
                   "random tokens; tok/s counts real tokens (default name train_<preset>)")
    p.add_argument("--compare", action="store_true", help="the same step, back to back on this GPU, in the plain "
                   "HF+peft stack, tunekit and Unsloth (one process each); one result with the ratios and a chart "
                   "beside it (default name compare_<preset>)")
    p.add_argument("--stacks", default="hf_peft,tunekit,unsloth", help="with --compare: which stacks, in order")
    p.add_argument("--unsloth-site", default=None, help="with --compare: the folder build-unsloth-site made "
                   "(default $TUNEKIT_UNSLOTH_SITE, else .unsite/ in the repo when there)")
    p = sub.add_parser("converge", help="train once per optimizer and learning rate; compare held-out losses",
                       description="Lesson 4: the same model, data and seed trained with each optimizer at each "
                       "learning rate of --sweep; every run's loss curves into one result JSON.", **common)
    p.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--sweep", required=True, help="OPTIMIZER=LR,LR;OPTIMIZER=LR,... e.g. "
                   "'adamw=3e-4,1e-3;lion=3e-5,1e-4'")
    p.add_argument("--name", default="converge", help="result name (default converge)")
    p.add_argument("--out", default="runs/bench", help="a .json file or a folder (default runs/bench)")
    p = sub.add_parser("export", help="merge a finished run's adapter into a plain model folder and check it",
                       description="Rebuild the run's base in --dtype, attach its adapter, merge, save where "
                       "from_pretrained reads it, reload, and compare logits with the unmerged model.",
                       allow_abbrev=False)
    p.add_argument("run_dir", help="the run folder (its config.json and adapter/)")
    p.add_argument("--out", default="", help="where the merged model goes (default <run_dir>/merged)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)
    p = sub.add_parser("generate", help="answer prompts with a finished run's model (greedy)", allow_abbrev=False)
    p.add_argument("run_dir", help="the run folder (its config.json and adapter/ or model/)")
    p.add_argument("prompts", nargs="+", help="prompt texts, each as training rendered them (e.g. "
                   "'Question: ...\nAnswer: ')")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)
    p = sub.add_parser("databench", help="lesson 1's data measurements (train | loader | read)",
                       description="train: C1, GPU wait and packing on the preset's model; loader: DataLoader "
                       "knob sweep; read: RAM vs memory-mapped vs JSONL.", **common)
    p.add_argument("experiment", choices=("train", "loader", "read"))
    p.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--out", default="runs/bench", help="a .json file or a folder (default runs/bench)")
    p.add_argument("--steps", type=int, default=15, help="train: timed steps per variant")
    p.add_argument("--corpus-mb", type=int, default=1000, help="read: size of the synthetic corpus (0: none)")
    p.add_argument("--jsonl-rows", type=int, default=100_000, help="read: rows re-tokenized from JSONL at most")
    p = sub.add_parser("fit", help="find the largest micro-batch that fits the GPU by trying steps",
                       description="Double, then bisect the micro-batch of full-length rows until a step runs "
                       "out of memory; print it and the accumulation for --target-batch; write JSON.", **common)
    p.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--target-batch", type=int, default=0, help="samples per optimizer step to reach")
    p.add_argument("--memory-gb", type=float, default=0.0, help="cap GPU memory to this, as a smaller GPU would")
    p.add_argument("--name", default="", help="result name (default fit_<preset>)")
    p.add_argument("--out", default="runs/bench", help="a .json file or a folder (default runs/bench)")
    p = sub.add_parser("estimate", help="predict the peak GPU memory of a training step, loading nothing",
                       **{**common, "epilog": fields_help("llama7b_lora")})
    p.add_argument("--preset", default="llama7b_lora", help=f"one of {', '.join(PRESETS)} (default llama7b_lora)")
    p.add_argument("--memory-gb", type=float, default=0.0,
                   help="also say the largest micro-batch whose estimate fits this much memory")
    p.add_argument("--gpus", type=int, default=1, help="per GPU of a torchrun launch on this many (DDP or FSDP2 "
                   "as --parallel decides; default 1)")
    p = sub.add_parser("prepare", help="tokenize the training data offline into <out-dir>/prepared", **common)
    p.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--num-proc", type=int, default=None, help="tokenizer processes for datasets.map")
    p = sub.add_parser("commbench", help="all-reduce bandwidth between the processes of a torchrun launch",
                       description="Under torchrun: time all_reduce at several sizes; write a result JSON with the "
                       "NCCL variables it ran under.", allow_abbrev=False)
    p.add_argument("--name", default="commbench", help="result name (default commbench)")
    p.add_argument("--out", default="runs/bench", help="a .json file or a folder (default runs/bench)")
    p.add_argument("--sizes-mb", default="1,16,64,256", help="message sizes, comma-separated MB")
    p = sub.add_parser("doctor", help="what this machine has: GPU, bf16, optional packages", allow_abbrev=False)
    p.add_argument("--distributed", action="store_true", help="the network NCCL will use: InfiniBand, "
                   "interfaces, GPU peer access, NCCL variables, with what to set and why")
    p = sub.add_parser("results", help="print a markdown table of the step-benchmark result files",
                       allow_abbrev=False)
    p.add_argument("paths", nargs="*", help="result files or folders (default notebooks/results)")
    p.add_argument("--claims", action="store_true", help="print the article's claims judged from the files")
    p.add_argument("--update-readme", action="store_true",
                   help="rewrite README.md's generated tables (results, claims, reference) from notebooks/results")
    parser.commands = sub.choices  # name -> subparser, for the leftover-argument check in main
    return parser


def resume_command(argv: list[str]) -> str:
    """The command line that continues the run `tunekit <argv>` started."""
    args = [a for a in argv if a != "--overwrite"]
    return shlex.join(["tunekit", *args, *([] if "--resume" in args else ["--resume"])])


def unknown_arguments(command: argparse.ArgumentParser, rest: list[str], takes_fields: bool) -> str | None:
    """What is wrong with the arguments argparse left over: one that abbreviates an option of `command`
    (never accepted: `--resum` must not mean `--resume`), or, for a command without config fields, any."""
    options = list(command._option_string_actions)
    for arg in rest:
        key = arg.split("=")[0]
        close = [o for o in options if key.startswith("--") and len(key) > 2 and o.startswith(key) and o != key]
        if close and key[2:].replace("-", "_") not in field_types():
            return f"unknown option {key}: did you mean {' or '.join(close)}? (options are not abbreviated)"
    return None if takes_fields or not rest else f"unrecognized arguments: {' '.join(rest)}"


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP before a command caught it: raised like Ctrl-C's KeyboardInterrupt, so the blocks
    that remove temps (`atomic_output`) run and the command ends with one line instead of dying mid-write."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def _raise_stopped(signum, frame):
    raise Stopped(signum)


def _signal_name(e: KeyboardInterrupt) -> tuple[str, int]:
    signum = getattr(e, "signum", signal.SIGINT)
    return signal.Signals(signum).name, 128 + signum


def say_error(message: str) -> None:
    """Print the command's last line to stderr; a terminal that hung up (SIGHUP) takes it nowhere."""
    try:
        print(message, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    # The entry point owns the process: SIGTERM and SIGHUP stop as Ctrl-C does from the first line on (left
    # to their default they kill it at once, during torch's import as anywhere). `train` catches all three
    # once it has started, to finish the step; the handlers are put back on the way out.
    old = {}
    if threading.current_thread() is threading.main_thread():
        old = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s}
    try:
        return _main(argv)
    except KeyboardInterrupt as e:  # before (or after) a command's own handling
        name, code = _signal_name(e)
        say_error(f"tunekit: interrupted by {name}")
        return code
    finally:  # a run launched by torchrun leaves its process group cleanly
        for s, h in old.items():
            signal.signal(s, h)
        if (dist := sys.modules.get("tunekit.distributed")) is not None:
            dist.teardown()


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = make_parser()
    args, rest = parser.parse_known_args(argv)
    takes_fields = args.command not in ("doctor", "results", "commbench", "export", "generate")
    if msg := unknown_arguments(parser.commands[args.command], rest, takes_fields):
        print(f"tunekit {args.command}: error: {msg}", file=sys.stderr)
        return 2
    if args.command == "doctor":
        from tunekit import doctor

        return doctor.main(distributed=args.distributed)
    if args.command == "results":
        from tunekit import claims, results

        try:
            rs = results.by_name(*(args.paths or [claims.RESULTS]))
            if args.update_readme:
                print("README.md " + ("updated" if claims.update_readme() else "already up to date"))
            elif args.claims:
                print(claims.claims_table(rs))
            else:
                print(results.format_table(sorted(claims.step_results(rs), key=lambda r: r["name"])))
        except (ValueError, OSError) as e:
            print(f"tunekit results: error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "train":
        return _train(args, rest, argv)
    if args.command == "commbench":
        from tunekit import distributed
        from tunekit.results import save_result

        try:
            result = distributed.run_commbench(args.name, tuple(float(x) for x in args.sizes_mb.split(",")))
        except (ValueError, RuntimeError) as e:
            print(f"tunekit commbench: error: {e}", file=sys.stderr)
            return 2
        if result is not None:
            for r in result["rows"]:
                print(f"{r['mb']:>6g} MB  {1e3 * r['seconds']:8.3f} ms  algbw {r['algbw_gbps']:7.2f} GB/s  "
                      f"busbw {r['busbw_gbps']:7.2f} GB/s")
            print(f"result -> {save_result(result, args.out)}")
        return 0
    if args.command in ("export", "generate"):
        return _export(args)
    try:
        cfg = resolve(args.preset, rest)
        if args.command == "bench":
            from tunekit.bench import measure_noise, run_bench
            from tunekit.results import save_result

            if args.compare:
                from tunekit.compare import run_compare, save_chart

                result = run_compare(args.preset, rest, args.name, tuple(filter(None, args.stacks.split(","))),
                                     args.unsloth_site)
                path = save_result(result, args.out)
                print(f"result -> {path}\nchart -> {save_chart(result, path.with_suffix('.png'))}")
                return 0
            if args.profile:
                from tunekit.bench import profile_step

                result = profile_step(cfg, name=args.name)
            elif args.epoch:
                from tunekit.bench import run_epoch

                result = run_epoch(cfg, args.epoch, args.name)
            elif args.train_loop:
                from tunekit.bench import run_train_loop

                if args.repeat > 1:
                    raise ValueError("--repeat applies to the step bench; run --train-loop once per process")
                result = run_train_loop(cfg, args.name)
            elif args.repeat > 1:
                result = measure_noise(args.preset, rest, args.name or f"noise_{cfg.preset}", args.repeat)
            else:
                result = run_bench(cfg, args.name)
            from tunekit import distributed

            if distributed.is_main():  # under torchrun, rank 0 writes the result (tok/s per GPU)
                print(f"result -> {save_result(result, args.out)}")
        elif args.command == "converge":
            from tunekit.results import save_result
            from tunekit.speedups import parse_sweep, run_convergence

            result = run_convergence(cfg, parse_sweep(args.sweep), args.name)
            print(f"result -> {save_result(result, args.out)}")
        elif args.command == "fit":
            from tunekit.bench import find_micro_batch
            from tunekit.results import save_result

            result = find_micro_batch(cfg, args.target_batch, args.memory_gb, args.name)
            print(f"result -> {save_result(result, args.out)}")
        elif args.command == "databench":
            from tunekit import databench
            from tunekit.results import save_result

            if args.experiment == "train":
                result = databench.run_train_experiment(cfg, steps=args.steps)
            elif args.experiment == "loader":
                result = databench.run_loader_experiment(cfg)
            else:
                result = databench.run_read_experiment(cfg, args.corpus_mb, args.jsonl_rows)
            print(f"result -> {save_result(result, args.out)}")
        elif args.command == "estimate":
            from tunekit import estimate
            from tunekit.config import config_dict

            if args.gpus < 1:
                raise ValueError("--gpus must be 1 or more")
            conf = {**config_dict(cfg), "world_size": args.gpus}
            if not cfg.vocab_size:
                raise ValueError("estimate needs --vocab-size (the tokenizer is not loaded)")
            print(estimate.format_estimate(estimate.estimate_memory_for(**conf)))
            if args.memory_gb:
                budget = args.memory_gb * 1e9
                best = estimate.estimate_max_batch(conf, budget)
                if best == 0:
                    print(estimate.cannot_fit_message(conf, budget))
                    return 1
                allocated = estimate.estimate_max_batch(conf, budget, reserve_factor=1.0)
                accum = estimate.grad_accum_for(cfg.batch_size * cfg.grad_accum, best)
                print(f"fits {args.memory_gb:g} GB up to micro-batch {best} x {cfg.max_length} counting reserved memory "
                      f"(~{estimate.RESERVE_FACTOR:g}x the estimate: the caching allocator's fragmentation), "
                      f"{allocated} counting allocated memory alone")
                print(f"for {cfg.batch_size * cfg.grad_accum} samples a step: "
                      f"--batch-size {min(best, cfg.batch_size)} "
                      f"--grad-accum {accum if best < cfg.batch_size else cfg.grad_accum}")
        elif args.command == "prepare":
            from tunekit import runlock, stopping
            from tunekit.train import prepare

            with stopping.removed_if_left_empty(cfg.run_dir()), runlock.hold(cfg.run_dir(), "tunekit prepare"):
                prepare(cfg, num_proc=args.num_proc)
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError, OSError) as e:
        print(f"tunekit {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


def _export(args) -> int:
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
        name, code = _signal_name(e)
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


def _train(args, rest: list[str], argv: list[str]) -> int:
    """`tunekit train`: exit 0 when done, 2 on bad input or a folder it must not touch, 1 when the run
    diverged, 128 + the signal (130 for Ctrl-C, 143 for SIGTERM) when stopped — each with one line, no
    traceback."""
    def early(e: KeyboardInterrupt) -> int:
        name, code = _signal_name(e)
        say_error(f"tunekit train: interrupted by {name} before training started; the run folder is as it was.")
        return code

    try:
        from tunekit import train as tr
    except KeyboardInterrupt as e:  # Ctrl-C (or SIGTERM, SIGHUP) while torch imports
        return early(e)
    out_dir = None
    try:
        cfg = resolve(args.preset, rest)
        out_dir = cfg.out_dir
        summary = tr.train(cfg, resume=args.resume, overwrite=args.overwrite,
                           allow_config_change=args.allow_config_change)
    except tr.Diverged as e:
        say_error(f"tunekit train: {e}")
        return 1
    except tr.Interrupted as e:
        say_error(f"tunekit train: {e}. Continue with: {resume_command(argv)}")
        return 128 + e.signum
    except KeyboardInterrupt as e:  # before train caught the signals
        return early(e)
    except Exception as e:  # one line for every failure, a full disk included
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


if __name__ == "__main__":
    sys.exit(main())
