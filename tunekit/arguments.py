"""The `tunekit` command's arguments: each subcommand, its help and its own options (`COMMANDS`), and the parser
that reads them (`make_parser`). `tunekit.cli` runs what they name; a script that builds a `tunekit` command line
(the lessons' cells do) parses it here without importing what the commands run.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import textwrap
import typing

from tunekit.config import RESUME_SAFE_FIELDS, TuneConfig, field_types
from tunekit.presets import PRESETS

DESCRIPTION = """The `tunekit` command: train, bench, fit, databench, estimate, prepare, doctor, results, converge, export,
generate.

Every command but doctor takes `--preset NAME` and then any config field as `--field value`
(`tunekit train --preset tiny --lr 1e-3 --max-steps 20`); unknown fields are rejected.
`tunekit train --help` lists the fields with their docs.
"""


def field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal under it in TuneConfig)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(TuneConfig)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in itertools.pairwise(body):
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


class Command(typing.NamedTuple):
    """One subcommand: its one-line help, its description (None: the help), the preset it starts from (None: it
    takes no config fields) and its own arguments, each `arg(...)`: what `argparse.add_argument` takes."""

    help: str
    description: str | None
    preset: str | None
    arguments: tuple[tuple[tuple, dict], ...] = ()


def arg(*flags: str, **options) -> tuple[tuple, dict]:
    return flags, options


OUT = arg("--out", default="runs/bench", help="a .json file or a folder (default runs/bench)")
DEVICE = arg("--device", default="auto", choices=("auto", "cpu", "cuda"))
TRUST = arg("--trust-remote-code", action="store_true", help=TRUST_HELP)


def name(default: str = "", what: str = "the preset") -> tuple[tuple, dict]:
    return arg("--name", default=default, help=f"result name (default {default or what})")


# A command with a preset takes `--preset` and then every config field as `--field value`.
COMMANDS: dict[str, Command] = {
    "train": Command(
        "fine-tune a model",
        "Train for --max-steps steps, checkpointing every --save-every; --resume continues from the newest "
        "checkpoint\nthat verifies. Ctrl-C or SIGTERM finishes the step, writes a checkpoint and prints the command "
        "that\nresumes (exit 130 / 143); a diverging run stops with exit 1.", "tiny", (
            arg("--resume", action="store_true", help="continue the run in --out-dir from its newest checkpoint that "
                "verifies; the config must match the one the run started with"),
            arg("--overwrite", action="store_true", help="replace the run already in --out-dir (its files are "
                "deleted once the new run has started); without it, a folder holding another run is refused"),
            arg("--allow-config-change", action="store_true", help="with --resume, let these fields differ from the "
                f"saved config: {', '.join(RESUME_SAFE_FIELDS)} (a new max_steps recomputes the cosine schedule, so "
                "the learning rate jumps); any other change is refused"))),
    "bench": Command(
        "time the training step and write a result JSON",
        "Warm up, time --bench-steps steps, report the median; write JSON.", "tiny", (
            name(), OUT,
            arg("--repeat", type=int, default=1, help="bench in this many fresh processes and record the run-to-run "
                "spread (one result with every run)"),
            arg("--profile", action="store_true", help="where the step's time goes: torch.profiler over a few steps, "
                "kernel time by category, the costliest kernels, by the operator (forward or backward) that launched them, "
                "and the matrix products by shape (default name profile_<preset>)"),
            arg("--epoch", type=float, default=0.0, metavar="FRACTION", help="time `tunekit train` for this share of "
                "an epoch from a fresh folder (tokenizing, build, compile, steps, eval), and project a whole epoch "
                "(default name epoch_<preset>)"),
            arg("--train-loop", action="store_true", help="time `tunekit train` itself on the config's real data "
                "(its batches, DataLoader and logging) for --bench-max-steps steps, not the bare step on random "
                "tokens; tok/s counts real tokens (default name train_<preset>)"),
            arg("--compare", action="store_true", help="the same step, back to back on this GPU, in the plain "
                "HF+peft stack, tunekit and Unsloth (one process each); one result with the ratios and a chart "
                "beside it (default name compare_<preset>)"),
            arg("--stacks", default="hf_peft,tunekit,unsloth", help="with --compare: which stacks, in order"),
            arg("--unsloth-site", default=None, help="with --compare: Unsloth's folder of packages, as `python -m "
                "tunekit_course.unsloth_site` builds it (default "
                "$TUNEKIT_UNSLOTH_SITE, else .unsite/ in the repo when there)"))),
    "converge": Command(
        "train once per optimizer and learning rate; compare held-out losses",
        "Lesson 4: the same model, data and seed trained with each optimizer at each learning rate of --sweep; "
        "every run's loss curves into one result JSON.", "tiny", (
            arg("--sweep", required=True, help="OPTIMIZER=LR,LR;OPTIMIZER=LR,... e.g. 'adamw=3e-4,1e-3;lion=3e-5,1e-4'"),
            name("converge"), OUT)),
    "export": Command(
        "merge a finished run's adapter into a plain model folder and check it",
        "Rebuild the run's base in --dtype, attach its adapter, merge, save where from_pretrained reads it, reload, "
        "and compare logits with the unmerged model.", None, (
            arg("run_dir", help="the run folder (its config.json and adapter/)"),
            arg("--out", default="", help="where the merged model goes (default <run_dir>/merged)"),
            arg("--dtype", default="bf16", choices=("bf16", "fp16", "fp32")), DEVICE, TRUST)),
    "generate": Command(
        "answer prompts with a finished run's model (greedy)", None, None, (
            arg("run_dir", help="the run folder (its config.json and adapter/ or model/)"),
            arg("prompts", nargs="+", help="prompt texts, each as training rendered them (e.g. "
                "'Question: ...\nAnswer: ')"),
            arg("--max-new-tokens", type=int, default=64), DEVICE, TRUST)),
    "databench": Command(
        "lesson 1's data measurements (train | loader | read)",
        "train: C1, GPU wait and packing on the preset's model; loader: DataLoader knob sweep; read: RAM vs "
        "memory-mapped vs JSONL.", "tiny", (
            arg("experiment", choices=("train", "loader", "read")), OUT,
            arg("--steps", type=int, default=15, help="train: timed steps per variant"),
            arg("--corpus-mb", type=int, default=1000, help="read: size of the synthetic corpus (0: none)"),
            arg("--jsonl-rows", type=int, default=100_000, help="read: rows re-tokenized from JSONL at most"))),
    "fit": Command(
        "find the largest micro-batch that fits the GPU by trying steps",
        "Double, then bisect the micro-batch of full-length rows until a step runs out of memory; print it and the "
        "accumulation for --target-batch; write JSON.", "tiny", (
            arg("--target-batch", type=int, default=0, help="samples per optimizer step to reach"),
            arg("--memory-gb", type=float, default=0.0, help="cap GPU memory to this, as a smaller GPU would"),
            name("", "fit_<preset>"), OUT)),
    "estimate": Command(
        "predict the peak GPU memory of a training step, loading nothing", None, "llama7b_lora", (
            arg("--memory-gb", type=float, default=0.0, help="also say the largest micro-batch whose estimate fits "
                "this much memory"),
            arg("--gpus", type=int, default=1, help="per GPU of a torchrun launch on this many (DDP or FSDP2 as "
                "--parallel decides; default 1)"))),
    "prepare": Command(
        "tokenize the training data offline into <out-dir>/prepared", None, "tiny", (
            arg("--num-proc", type=int, default=None, help="tokenizer processes for datasets.map"),)),
    "commbench": Command(
        "all-reduce bandwidth between the processes of a torchrun launch",
        "Under torchrun: time all_reduce at several sizes; write a result JSON with the NCCL variables it ran "
        "under.", None, (
            name("commbench"), OUT, arg("--sizes-mb", default="1,16,64,256", help="message sizes, comma-separated MB"))),
    "doctor": Command(
        "what this machine has: GPU, bf16, optional packages", None, None, (
            arg("--distributed", action="store_true", help="the network NCCL will use: InfiniBand, interfaces, GPU "
                "peer access, NCCL variables, with what to set and why"),)),
    "results": Command(
        "print a markdown table of the step-benchmark result files", None, None, (
            arg("paths", nargs="*", help="result files or folders (default notebooks/results)"),
            arg("--claims", action="store_true", help="print the article's claims judged from the files"),
            arg("--update-readme", action="store_true", help="rewrite README.md's generated tables (results, "
                "claims, reference) from notebooks/results"))),
}


def make_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: `--resum` must not quietly mean `--resume`.
    parser = argparse.ArgumentParser(prog="tunekit", description=DESCRIPTION, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for command, c in COMMANDS.items():
        extra = {} if c.preset is None else {"formatter_class": argparse.RawDescriptionHelpFormatter,
                                             "epilog": fields_help(c.preset)}
        p = sub.add_parser(command, help=c.help, description=c.description, allow_abbrev=False, **extra)
        if c.preset is not None:
            p.add_argument("--preset", default=c.preset, help=f"one of {', '.join(PRESETS)} (default {c.preset})")
        for flags, options in c.arguments:
            p.add_argument(*flags, **options)
    parser.commands = sub.choices  # name -> subparser, for the leftover-argument check in main
    return parser


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
