"""Helpers the course notebooks share: choosing the preset for the hardware, measuring on this machine, the
published results beside yours, and the lesson plans.

A notebook picks the real (GPU) preset when a CUDA GPU is present and the tiny one otherwise, or whenever
TUNEKIT_SMOKE=1 — so the same notebook runs on any GPU for the course and on a CPU in CI. Heavy runs go
through the `tunekit` command in a child process: the GPU memory is freed when it exits, and the notebook
reads the result file back.

Where results go, and what the notebooks read:

- On a GPU a lesson measures *this* GPU: `measure` runs each command and writes its result to your own folder,
  `runs/results/<the GPU's name>` (`results_dir`, git-ignored), never to the published `notebooks/results`.
  A result you measured before on this GPU is read back and says so; TUNEKIT_REMEASURE=1 measures again.
  A config that would not fit this GPU's memory runs as the nearest one that does (`fit_here`), and says which;
  TUNEKIT_MEMORY_GB=N runs as on a card of N GB (the child processes are capped there too).
- TUNEKIT_REPLAY=1 replays the published run instead of measuring: `measure` reads `notebooks/results`,
  which is then read-only (nothing is written), on a laptop as on a GPU.
- Beside your figures the notebooks show the published H200 ones (`published`, `beside`; `sides` gathers both for
  the charts of tunekit_course/charts.py) and beside your verdicts the published verdicts (`verdict`).
- Publishing is the course's own step: `python -m tunekit_course.notebook --publish [FOLDER]` copies a folder of
  results (this GPU's by default) into `notebooks/results`.
- In smoke mode results go to `runs/smoke-results`, a scratch folder.

Executing a lesson (in place on the GPU machine, or replayed in memory) and making its outputs read correctly
untrusted is `tunekit_course.pages`'s; `python -m tunekit_course.notebook NOTEBOOK` still executes one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from tunekit import results
from tunekit.config import REPO_ROOT
from tunekit.optim import BNB_OPTIMIZERS
from tunekit_course import RESULTS
from tunekit_course.claims import SCALING_GPUS

RUNS = REPO_ROOT / "runs"  # your own folders (git-ignored): results by GPU, scratch runs, compile caches
PUBLISHED_GPU = "NVIDIA H200"  # where the published results (notebooks/results) were measured


def smoke_mode() -> bool:
    """True when TUNEKIT_SMOKE=1: notebooks and benches pick the tiny preset whatever the hardware."""
    return os.environ.get("TUNEKIT_SMOKE", "") not in ("", "0")


def on_gpu() -> bool:
    """True when the notebook should run its real, GPU-sized experiments."""
    return torch.cuda.is_available() and not smoke_mode()


def replay_mode() -> bool:
    """True when TUNEKIT_REPLAY=1: the notebooks read the published results instead of measuring."""
    return os.environ.get("TUNEKIT_REPLAY", "") not in ("", "0")


def gpu_results() -> bool:
    """True when a lesson's results are GPU-sized ones: measured on this GPU, or replayed from the published run."""
    return on_gpu() or replay_mode()


def pick_preset(gpu_preset: str) -> str:
    """`gpu_preset` on a GPU, `tiny` on CPU or in smoke mode; prints which and why."""
    if on_gpu():
        print(f"mode: GPU ({torch.cuda.get_device_name()}) -> preset {gpu_preset}")
        return gpu_preset
    why = "TUNEKIT_SMOKE=1" if smoke_mode() else "no CUDA GPU"
    print(f"mode: smoke ({why}) -> preset tiny; the committed outputs come from the GPU run")
    return "tiny"


# (GPU value, its CPU stand-in); FlexAttention has no backward on CPU
GPU_ONLY = {"method": ("qlora", "lora"), "attention": ("flex_attention", "sdpa"), "kernels": ("liger", "none"),
            "loss": ("liger", "chunked"), "fp8": (True, False)}
# bitsandbytes' optimizers (CUDA only) -> torch's of the same family
GPU_ONLY_OPTIMIZERS = {name: "lion" if "lion" in name else "adamw" for name in BNB_OPTIMIZERS}


def config_for(gpu_preset: str, **overrides):
    """The config a notebook cell measures: `gpu_preset` with `overrides` on a GPU; on CPU (smoke mode) the
    tiny preset with the same switches, at most batch 8 x 128 tokens, and the GPU-only ones swapped for
    their stand-ins (QLoRA -> LoRA and bitsandbytes' optimizers -> torch's: bitsandbytes needs CUDA;
    FlexAttention -> SDPA: flex has no backward on CPU; Liger and FP8 off: GPU kernels), so every cell runs."""
    from tunekit.presets import get_preset, tiny

    if gpu_results():  # replayed: the published run's configs (nothing runs them here)
        return get_preset(gpu_preset, **overrides)
    gpu_fields = get_preset(gpu_preset)
    keep = ("method", "grad_ckpt", "grad_ckpt_offload", "embed_offload", "optimizer", "loss", "lora_input_cast",
            "attention", "sdpa_backend", "batch_size", "packing", "compile", "kernels", "fp8", "tf32")
    kw = {k: getattr(gpu_fields, k) for k in keep}
    kw.update({k: v for k, v in overrides.items() if k in keep or k.startswith("bench_")})
    for field, (gpu_value, cpu_value) in GPU_ONLY.items():
        if kw.get(field) == gpu_value:
            kw[field] = cpu_value
    kw["optimizer"] = GPU_ONLY_OPTIMIZERS.get(kw["optimizer"], kw["optimizer"])
    if kw["method"] != "qlora":
        kw.pop("peft_kbit_prepare", None)  # QLoRA's own preparation
    kw["batch_size"] = min(kw["batch_size"], 8)
    return tiny(**kw, vocab_size=1024, max_length=128, out_dir=str(RUNS / "smoke"))


def slug(text: str) -> str:
    """A folder name for a GPU's name: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "gpu"


def gpu_folder() -> Path:
    """This machine's own folder of results: runs/results/<its GPU's name> (`slug`)."""
    return RUNS / "results" / slug(torch.cuda.get_device_name())


def results_dir() -> Path:
    """Where this run's results go: on a GPU your own folder for this GPU (`gpu_folder`), never the published
    one; in smoke mode a scratch folder; in replay mode (TUNEKIT_REPLAY=1) the published folder, read-only."""
    if replay_mode():
        return RESULTS
    return gpu_folder() if on_gpu() else RUNS / "smoke-results"


def here() -> dict[str, dict]:
    """{name: result} of the results in `results_dir()` ({} before the first): yours, or the published ones in
    replay mode."""
    out = results_dir()
    return results.by_name(out) if out.is_dir() else {}


def published(name: str) -> dict | None:
    """The published result NAME (notebooks/results/NAME.json), or None."""
    path = RESULTS / f"{name}.json"
    return results.load_results(path)[0] if path.exists() else None


def shown(path: str | Path) -> str:
    """`path` as a lesson prints it: relative to the checkout where it lies inside it (no path of this machine)."""
    path = Path(path)
    return str(path.relative_to(REPO_ROOT)) if path.is_absolute() and path.is_relative_to(REPO_ROOT) else str(path)


def command_line(args) -> str:
    """A command's arguments as a lesson prints them: a path inside the checkout relative to it (`shown`)."""
    return " ".join(shown(a) if os.path.isabs(str(a)) else str(a) for a in args)


_SITE_PACKAGES = re.compile(r"(?:/[^\s'\"]+)?/(?:site|dist)-packages/")


def tidy(line: str) -> str:
    """A line of a command's output as a lesson prints it: paths inside the checkout relative to it, a package's
    file from its `site-packages/` on (a traceback's or PyTorch's log's), so no folder of this machine shows."""
    return _SITE_PACKAGES.sub("site-packages/", line.replace(f"{REPO_ROOT}{os.sep}", ""))


@contextlib.contextmanager
def quiet():
    """The progress bars of transformers, datasets and huggingface_hub off inside (writing a model's shards,
    loading its weights, a dataset's maps): on a lesson's page each is a line of noise a cell's own output
    says better. Each library's setting is put back as it was."""
    import datasets
    import huggingface_hub.utils as hub
    from transformers.utils import logging as hf_logging

    was = (hf_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled(), hub.are_progress_bars_disabled())
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    hub.disable_progress_bars()
    try:
        yield
    finally:
        if was[0]:
            hf_logging.enable_progress_bar()
        if was[1]:
            datasets.enable_progress_bars()
        if not was[2]:
            hub.enable_progress_bars()


def save(result: dict) -> Path | None:
    """Save a result a cell measured in this kernel to `results_dir()`; in replay mode nothing is written."""
    if replay_mode():
        print(f"{result['name']}: not saved (replay mode: the published results are read-only)")
        return None
    path = results.save_result(result, results_dir())
    print(f"result -> {shown(path)}")
    return path


def _where(r: dict) -> str:
    """The GPU a result was measured on, in a few words: "H200", "2x H200"."""
    gpu = (r.get("gpu") or "CPU").removeprefix("NVIDIA ")
    return f"{r['world_size']}x {gpu}" if (r.get("world_size") or 1) > 1 else gpu


def _when(r: dict) -> str:
    return r["date"][:16].replace("T", " ") + " UTC"


def read_back(name: str, r: dict) -> str:
    """The line a cell prints for result `r` of your results folder, read back instead of measured: when, and
    whether on this GPU or on another machine of its kind whose result was copied in (two machines of one GPU
    model differ by up to ~20%: its figures are that machine's, not this one's)."""
    from tunekit.results import gpu_uuid

    there, here = r.get("gpu_uuid"), gpu_uuid()  # None: no GPU (a CPU run), or a result from before GPUs were recorded
    again = "; TUNEKIT_REMEASURE=1 measures again"
    if there is None and here is not None:  # which GPU measured it is not known
        return (f"{name}: measured {_when(r)} on {_where(r)}, read from your results folder (which machine was not "
                f"recorded: this one, or another whose result was copied in){again}")
    if there and here and here != there:
        return (f"{name}: measured {_when(r)} on another {_where(r)} machine and copied into your results folder "
                f"(its figures are that machine's, not this GPU's){again}")
    return f"{name}: your measurement of {_when(r)} on this GPU ({_where(r)}){again}"


_ABSOLUTE = re.compile(r"(?<![\w.])/[^\s'\"]+")
# a checkout's own folders: an absolute path through one is shown from it on (the last, where several)
_CHECKOUT = ("notebooks", "runs", "tunekit", "tunekit_course", "examples", "tests", "data", ".unsite")


def _in_checkout(path: str) -> str:
    """An absolute path of the machine that ran a command, as a lesson prints it: from the checkout's own
    folder on (`/srv/x/.unsite` -> `.unsite`), else its last part."""
    parts = path.split("/")
    at = max((i for i, p in enumerate(parts) if p in _CHECKOUT), default=len(parts) - 1)
    return "/".join(parts[at:])


def _command(args) -> str:
    """`tunekit ARGS` as the notebook prints it, without the result folder and with no absolute path (a path
    of the machine that ran it)."""
    return _ABSOLUTE.sub(lambda m: _in_checkout(m[0]), re.sub(r" --out[ =]\S+", "", " ".join(map(str, args))))


def entry_of(r: dict) -> str:
    """The command that made result `r`, without its result folder (a path of the machine that ran it)."""
    return _command([r.get("entry") or "-"])


def _replayed(args) -> bool:
    """In replay mode a command that writes a result file is not run (the cell reads the published one)."""
    if replay_mode() and "--out" in map(str, args):
        print(f"(replay mode: `tunekit {_command(args)}` not run; the cell reads the published result)")
        return True
    return False


# ---- fitting a run to this GPU's memory -------------------------------------------------------------------


def memory_budget() -> tuple[float, str]:
    """(bytes a run may hold on this GPU, the GPU in words): TUNEKIT_MEMORY_GB when set ("run as on a card of
    this size"), else GPU 0's memory less the CUDA context (tunekit/estimate.py's allowance for it)."""
    from tunekit.estimate import CUDA_CONTEXT_BYTES

    total = torch.cuda.get_device_properties(0).total_memory
    if gb := memory_cap_gb():
        return min(gb * 1e9, total - CUDA_CONTEXT_BYTES), f"a card of {gb:g} GB (TUNEKIT_MEMORY_GB)"
    return total - CUDA_CONTEXT_BYTES, f"{torch.cuda.get_device_name()} ({total / 2**30:.0f} GiB)"


def memory_cap_gb() -> float | None:
    """TUNEKIT_MEMORY_GB as a number ("run as on a card of this size"), or None: for runs in the kernel, which
    `memory.memory_cap` there as the child processes do."""
    return float(os.environ["TUNEKIT_MEMORY_GB"]) if os.environ.get("TUNEKIT_MEMORY_GB") else None


def _flags(change: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}={str(v).lower() if isinstance(v, bool) else v}" for k, v in change.items()]


def fit_here(args: list, nproc: int = 1) -> list[str]:
    """`tunekit ARGS...` fitted to this GPU's memory (or TUNEKIT_MEMORY_GB's card): unchanged when the estimated
    peak of its config fits, else the nearest config that does, said in a line (`nearest_fit`). Only `bench` and
    `train` of a preset; a no-op in smoke mode (on a CPU) and where the estimator does not apply (fp32 steps,
    `--compare`'s other stacks)."""
    args = [str(a) for a in args]
    if not on_gpu() or not args or args[0] not in ("bench", "train"):
        return args
    from tunekit.arguments import make_parser

    parsed, rest = make_parser().parse_known_args(args)
    if getattr(parsed, "compare", False):
        return args
    budget, where = memory_budget()
    fit = nearest_fit(parsed.preset, rest, budget, where, nproc)
    if fit is None:
        return args
    flags, lines, _ = fit
    print("\n".join(lines))
    return [*args, *flags]


def nearest_fit(preset: str, rest: list[str], budget: float, where: str = "this GPU",
                nproc: int = 1) -> tuple[list[str], list[str], float] | None:
    """The preset PRESET with fields REST fitted to `budget` bytes (a card of that size): None when its estimated
    peak fits as it is (tunekit/estimate.py, with the caching allocator's reserve, as `tunekit estimate` counts
    it; None too where the estimator does not apply, fp32 steps say); otherwise (the flags that make the nearest
    config that fits, the lines that say so, its estimated peak in bytes): under compile, the compiled blocks
    recomputing what the adapters read (`--compile-recompute`, at the micro-batch asked only), gradient
    checkpointing on, then QLoRA
    with checkpointing, then QLoRA with the checkpoints and embeddings in CPU memory and 8-bit AdamW, each at the
    largest micro-batch up to the one asked for that the estimator says fits, with the accumulation that keeps
    the samples of a step. Nothing here reads the GPU: lesson 5 plans cards it does not have with it."""
    from tunekit import fitting
    from tunekit.config import ConfigError
    from tunekit.estimate import Setup, estimate_memory_for
    from tunekit.presets import resolve

    try:
        cfg = resolve(preset, rest)
        setup = Setup.of(cfg, world_size=nproc)
        need = estimate_memory_for(setup)["total"]
    except (ConfigError, ValueError):
        return None
    factor = fitting.RESERVE_FACTOR
    if need * factor <= budget:
        return None
    lines = [(f"does not fit {where}: the estimated peak at micro-batch {cfg.batch_size} x {cfg.max_length} is "
              f"{need / 1e9:.1f} GB (~{need * factor / 1e9:.1f} GB with the allocator's reserve) against "
              f"{budget / 1e9:.1f} GB allocatable")]
    low = {"method": "qlora", "grad_ckpt": True, "grad_ckpt_offload": True, "embed_offload": True,
           "optimizer": "adamw8bit"}
    tries = [("gradient checkpointing on" if not cfg.grad_ckpt else "a smaller micro-batch", {"grad_ckpt": True})]
    if fitting.recompute_first(cfg):  # first, at the micro-batch asked only (its cost is measured there)
        tries.insert(0, ("the compiled blocks recomputing what the adapters read", {"compile_recompute": True}))
    # QLoRA with FP8 (its 4-bit codes read into FP8, `--fast-lora`) is not offered until a whole run has measured it
    if cfg.method != "full" and not cfg.fp8:
        tries += [("QLoRA with gradient checkpointing", {"method": "qlora", "grad_ckpt": True}),
                  ("QLoRA, checkpoints and embeddings in CPU memory, 8-bit AdamW", low)]
    for label, change in tries:
        change = {k: v for k, v in change.items() if getattr(cfg, k) != v}
        micro = fitting.estimate_max_batch(setup.but(**change), budget, limit=cfg.batch_size)
        if micro == 0 or (micro < cfg.batch_size and "compile_recompute" in change):
            continue
        if micro < cfg.batch_size:
            change.update(batch_size=micro, grad_accum=fitting.grad_accum_for(cfg.batch_size * cfg.grad_accum, micro))
        try:
            resolve(preset, [*rest, *_flags(change)])
        except ConfigError:
            continue
        est = estimate_memory_for(setup.but(**{k: v for k, v in change.items() if k != "grad_accum"}))["total"]
        lines.append(f"running the nearest config that fits instead: {label}, micro-batch {micro}"
                     + (f" x {change['grad_accum']} accumulated" if "grad_accum" in change else "")
                     + f" (estimate {est / 1e9:.1f} GB): {' '.join(_flags(change))}")
        return _flags(change), lines, est
    lines.append(fitting.cannot_fit_message(setup, budget) + "\nrunning it as asked all the same")
    return [], lines, need


_ONCE = ("attention: ",)  # a run's banner lines a lesson shows once: the same line again says nothing new
_SHOWN_ONCE: set[str] = set()  # those shown in this kernel (one notebook)


def _new(line: str) -> bool:
    """False for a banner line (`_ONCE`) this kernel has printed already: a lesson that runs `tunekit` five
    times shows its attention backend once, and again only where it changes."""
    if not line.startswith(_ONCE):
        return True
    if line in _SHOWN_ONCE:
        return False
    _SHOWN_ONCE.add(line)
    return True


_RECOMPILING = re.compile(r"\[__recompiles\] Recompiling function (\S+) in (\S+)")
_GUARD_FAILED = re.compile(r"\[__recompiles\]\s+- \d+/\d+: (.+)$")


def recompiles(lines: list[str]) -> str | None:
    """What a run's `TORCH_LOGS=recompiles` log says, in one line: how many times each function was compiled
    again and the guards that failed (a compiled graph is reused only where all of its guards hold); None
    where the log has no recompile."""
    counts: dict[tuple[str, str], int] = {}
    guards: dict[str, None] = {}  # in order, once each
    for line in lines:
        if m := _RECOMPILING.search(line):
            key = (m[1], tidy(m[2]).removeprefix("site-packages/"))
            counts[key] = counts.get(key, 0) + 1
        elif m := _GUARD_FAILED.search(line):
            guards[m[1].strip()] = None
    if not counts:
        return None
    what = "; ".join(f"{n} recompile(s) of {fn} ({where}): {n + 1} graphs of it" for (fn, where), n in
                     counts.items())
    return f"TORCH_LOGS=recompiles, in short: {what}. The guards that failed: {'; '.join(guards)}"


def run(*args: str, check: bool = True, env: dict | None = None, cwd: Path | None = None) -> int:
    """Run `tunekit ARGS...` in a child process, streaming its output into the notebook (a banner line shown
    before in this notebook left out, a recompile log summed up after it); `env` adds variables for this
    run only."""
    if _replayed(args):
        return 0
    cmd = [sys.executable, "-m", "tunekit.cli", *map(str, args)]
    extra = " ".join(f"{k}={shown(v)}" for k, v in (env or {}).items())
    print(f"$ {extra + ' ' if extra else ''}tunekit {command_line(args)}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    logged = []
    for line in map(tidy, proc.stdout):
        if "[__recompiles]" in line:
            logged.append(line)
        if _new(line):
            print(line, end="")
    code = proc.wait()
    if summary := recompiles(logged):
        print(f"\n{summary}")
    if check and code != 0:
        raise RuntimeError(f"tunekit {' '.join(map(str, args))} failed with exit code {code}")
    return code


def torchrun(nproc: int, *args: str, env: dict | None = None, check: bool = True, cwd: Path | None = None) -> int:
    """Launch `tunekit ARGS...` on `nproc` processes with torchrun (one per GPU, or gloo processes on a CPU),
    streaming rank 0's output; `env` adds variables (NCCL's, say) for this launch only. A notebook never
    starts a process group in its own kernel: each launch is a fresh set of processes."""
    import socket

    if _replayed(args):
        return 0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    extra = " ".join(f"{k}={shown(v)}" for k, v in (env or {}).items())
    print(f"$ {extra + ' ' if extra else ''}torchrun --nproc_per_node {nproc} -m tunekit.cli {command_line(args)}",
          flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(port), "-m", "tunekit.cli", *map(str, args)]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1",
                "LOGLEVEL": "ERROR", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, cwd=cwd)
    last, held = None, []  # `held`: a traceback, printed at the end unless it is only the launcher's report
    for line in map(tidy, proc.stdout):
        if line.startswith(("W1", "E1", "I1", "[W", "*****", "Setting OMP_NUM_THREADS")) or line == last \
                or not _new(line):
            continue  # the launcher's chatter, the same line from a second rank, a banner shown before
        if held or line.startswith("Traceback (most recent call last)"):
            held.append(line)
        else:
            print(line, end="")
        last = line
    code = proc.wait()
    if held and any("ChildFailedError" in h for h in held) and not any("[rank" in h for h in held):
        print(f"torchrun: a process failed (exit code {code}); its error is above")
    else:
        print("".join(held), end="")
    if check and code != 0:
        raise RuntimeError(f"torchrun ... tunekit {' '.join(map(str, args))} failed with exit code {code}")
    return code


def remeasure() -> bool:
    """True when TUNEKIT_REMEASURE=1: a result of yours on this GPU is measured again, not read back."""
    return os.environ.get("TUNEKIT_REMEASURE", "") not in ("", "0")


def yours(name: str) -> dict | None:
    """Your earlier result NAME on this GPU (in `results_dir()`), read back with the line that says so
    (`read_back`), where a lesson would otherwise measure it again; None off a GPU, where there is none, or
    with TUNEKIT_REMEASURE=1."""
    path = results_dir() / f"{name}.json"
    if not on_gpu() or remeasure() or not path.exists():
        return None
    r = json.loads(path.read_text())
    print(read_back(name, r))
    return r


def bench_here(configs: dict, memory_gb: float = 0.0) -> dict[str, dict]:
    """Each named config's step benched in this kernel (`bench.run_many`) into `results_dir()`, as `measure`
    does for a command: in replay mode the published results of these names; on a GPU your earlier result
    of a name read back (`yours`); the rest measured, capped at `memory_gb` where given. {name: result}; a
    config that ran out of memory is {"name", "error"}."""
    from tunekit import bench

    if replay_mode():
        return {n: r for n in configs if (r := published(n))}
    found = {n: r for n in configs if (r := yours(n))}
    rest = {n: c for n, c in configs.items() if n not in found}
    ran = bench.run_many(rest, results_dir(), reuse=not remeasure(), memory_gb=memory_gb, verbose=False) \
        if rest else {}
    return {n: found[n] if n in found else ran[n] for n in configs}


def measure(name: str, nproc: int, *args, env: dict | None = None) -> None:
    """Measure `tunekit ARGS... --name NAME --out <results_dir()>` here, on `nproc` processes (1: a plain child
    process), its config fitted to this GPU first (`fit_here`). On a GPU your own earlier result NAME in this
    GPU's folder is read back instead, and says so (TUNEKIT_REMEASURE=1 measures again); the published result
    is never taken for yours. In replay mode (TUNEKIT_REPLAY=1) the published result NAME is read instead, and
    nothing runs or is written."""
    if replay_mode():
        r = published(name)
        print(f"{name}: replaying the published {_where(r)} result of {_when(r)} (not measured here)" if r else
              f"{name}: no published result to replay")
        return
    if why := too_few_gpus(nproc):
        print(f"{name}: not measured here ({why}); the published result is shown beside yours")
        return
    if yours(name):
        return
    out = results_dir()
    # From the checkout, with the folder named inside it: what the command prints is no path of this machine
    rel = out.relative_to(REPO_ROOT) if out.is_relative_to(REPO_ROOT) else out
    args = (*fit_here(list(args), nproc), "--name", name, "--out", rel)
    if nproc == 1:
        run(*args, env=env, cwd=REPO_ROOT)
    else:
        torchrun(nproc, *args, env=env, cwd=REPO_ROOT)


def databench(experiment: str, *args) -> dict:
    """Lesson 1's `tunekit databench EXPERIMENT ARGS... --out <results_dir()>` and its result `data_<experiment>`,
    as `measure` does for a step: on a GPU your earlier result read back instead, saying so (TUNEKIT_REMEASURE=1
    measures again); in replay mode the published one, nothing run."""
    name = f"data_{experiment}"
    if not replay_mode() and (r := yours(name)):  # (yours: None off a GPU or with TUNEKIT_REMEASURE=1)
        return r
    run("databench", experiment, *args, "--out", results_dir())
    return json.loads((results_dir() / f"{name}.json").read_text())


def measure_in_parallel(plan: list[tuple[str, list, str]], gpus: int) -> None:
    """Run `measure` for each (name, args, cache) of `plan` on `gpus` GPUs at once, one run per GPU at a time
    (CUDA_VISIBLE_DEVICES); runs sharing a `cache` key go to one GPU in order (a cold compile, then the warm
    one), the others share what is left. For the GPU machine: a notebook runs its plan one at a time."""
    import threading
    from collections import deque

    queues = [deque() for _ in range(gpus)]
    by_cache: dict[str, int] = {}
    for item in plan:
        key = item[2].partition(":")[2]
        if key and key in by_cache:
            queues[by_cache[key]].append(item)
            continue
        i = min(range(gpus), key=lambda g: len(queues[g]))
        queues[i].append(item)
        if key:
            by_cache[key] = i

    def worker(gpu: int) -> None:
        while queues[gpu]:
            name, args, cache = queues[gpu].popleft()
            env = {"CUDA_VISIBLE_DEVICES": str(gpu), **cache_env(cache)}
            try:
                measure(name, 1, *args, env=env)
            except RuntimeError as e:  # one failed run does not stop the others; its error is printed
                print(f"{name}: {e}")

    threads = [threading.Thread(target=worker, args=(g,)) for g in range(gpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def cache_env(cache: str) -> dict:
    """The environment of a compile with inductor's and Triton's caches in a folder of its own. `cache`: ''
    (the default caches), 'cold:KEY' (KEY's folder, emptied now) or 'warm:KEY' (KEY's folder as the cold run
    left it)."""
    import shutil

    if not cache or replay_mode():  # replayed: nothing compiles, nothing is emptied
        return {}
    state, _, key = cache.partition(":")
    folder = RUNS / "compile-cache" / key
    if state == "cold":
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    return {"TORCHINDUCTOR_CACHE_DIR": str(folder), "TRITON_CACHE_DIR": str(folder / "triton")}


# ---- yours beside the published run ----------------------------------------------------------------------

# how `beside` writes a value of each key (default: 4 significant digits)
FORMATS = {"tokens_per_s": "{:,.0f} tok/s", "peak_memory_gb": "{:.1f} GB", "busbw_gbps": "{:,.0f} GB/s",
           "step_time_s": "{:.3f} s", "first_step_s": "{:.1f} s", "optimizer_state_gb": "{:.2f} GB",
           "samples_per_s": "{:,.1f} samples/s"}


def _fmt(key: str, v) -> str:
    if v is None:
        return "-"
    if key.endswith("_s_projected"):
        return f"{v / 60:,.1f} min"
    return FORMATS.get(key.rsplit(".", 1)[-1], "{:,.4g}").format(v)


def _changed(mine: dict, pub: dict) -> str:
    """What of the config a fitted run changed against the published one: "batch 4 -> 2, grad_ckpt on"."""
    a, b = mine.get("config") or {}, pub.get("config") or {}
    out = [f"batch {b.get('batch_size')} -> {a.get('batch_size')}"] if a.get("batch_size") != b.get("batch_size") else []
    out += [f"{k} {'on' if a.get(k) else 'off'}" for k in ("grad_ckpt", "grad_ckpt_offload", "embed_offload")
            if bool(a.get(k)) != bool(b.get(k))]
    out += [f"{k} {a.get(k)}" for k in ("method", "optimizer") if a.get(k) != b.get(k)]
    return ", ".join(out)


def _here_label(rs: dict[str, dict]) -> str:
    if not on_gpu():
        return "here (smoke: tiny model, CPU)"
    gpus = {r.get("gpu") for r in rs.values() if r.get("gpu")}
    cap = f", as a {memory_cap_gb():g} GB card" if memory_cap_gb() else ""
    return f"here, {gpus.pop() if len(gpus) == 1 else torch.cuda.get_device_name()}{cap}"


def beside(names, key: str = "tokens_per_s", mine: dict[str, dict] | None = None) -> str:
    """A plain-text table of results `names`: your value of `key` (`mine`, default `here()`), labelled with your
    GPU, the published one (labelled "published, NVIDIA H200"), and the ratio here / published where it means
    something (both measured, on a GPU: a smoke run's tiny model is no match for the 7B). A run `fit_here`
    changed is starred, with what changed. In replay mode: the published column alone."""
    names = list(names)
    pub = {n: published(n) for n in names}
    label = f"published, {PUBLISHED_GPU}"
    if replay_mode():
        width = max(map(len, names), default=6) + 2
        lines = [f"{'result':<{width}}{label} (replayed)"]
        lines += [f"{n:<{width}}{_fmt(key, results.value(pub[n], key))}" for n in names]
        return "\n".join(lines)
    mine = here() if mine is None else mine
    rows, notes = [], []
    for n in names:
        a, b = results.value(mine.get(n), key), results.value(pub[n], key)
        star = ""
        if n in mine and pub[n] and on_gpu() and (what := _changed(mine[n], pub[n])):
            star = "*"
            notes.append(f"* {n}: ran with {what}, not as published (fit_here: to fit this GPU)")
        ratio = f"{a / b:.2f}x" if on_gpu() and a is not None and b else "-"
        rows.append((n, _fmt(key, a) + star, _fmt(key, b), ratio))
    head = ("result", _here_label(mine), label, "here / published")
    widths = [max(len(r[i]) for r in [head, *rows]) + 2 for i in range(4)]
    lines = ["".join(f"{c:<{w}}" for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    return "\n".join(lines + notes)


def sides(mine: dict[str, dict] | None = None, names=None, smoke: bool = True) -> dict[str, dict[str, dict]]:
    """What a chart (tunekit_course/charts.py) draws, as {series label: {name: result}}: your results (`mine`,
    default `here()`), labelled with your GPU, then the published ones (`names` of them, default all), labelled
    "published, NVIDIA H200". In replay mode the published alone; in smoke mode yours too unless `smoke` is False
    (a chart whose tiny CPU figures mean nothing beside a GPU's: a CPU peak is the process's memory)."""
    label = f"published, {PUBLISHED_GPU}"
    pub = results.by_name(RESULTS) if names is None else {n: r for n in names if (r := published(n))}
    if replay_mode():
        return {f"{label} (replayed)": pub}
    mine = here() if mine is None else mine
    return {**({_here_label(mine): mine} if on_gpu() or smoke else {}), label: pub}


# what a claim's reading of results it does not expect (a run fitted to a smaller GPU, say) may raise
JUDGE_ERRORS = (KeyError, TypeError, ValueError, ZeroDivisionError, StopIteration, IndexError)


def _machine(rs: dict[str, dict], v, default: str) -> str:
    from tunekit_course import claims

    m = claims.machine_of(rs, v.files)
    return default if m == "-" else m


def verdict(claim: str, mine: dict[str, dict] | None = None, gpus: int = 1):
    """Print the verdict on `claim` from your results (`mine`, default `here()`) and the published verdict
    beside it, each labelled with where it was measured; returns yours (None in smoke or replay mode, or where the
    claim needs more than this machine's GPUs (`gpus` of them), where the published one is printed alone)."""
    from tunekit_course import claims

    rs = results.by_name(RESULTS)
    pub = claims.judge(claim, rs)
    pub_line = f"published, {_machine(rs, pub, PUBLISHED_GPU)}{' (replayed)' if replay_mode() else ''}: {pub}"
    if replay_mode():
        print(pub_line)
        return None
    if not on_gpu():
        print(f"{claim} from this run: no verdict (a smoke run on a tiny model)\n{pub_line}")
        return None
    if why := too_few_gpus(gpus):
        print(f"{claim} from your results: no verdict ({why})\n{pub_line}")
        return None
    mine = here() if mine is None else mine
    try:
        yours = claims.judge(claim, mine)
    except JUDGE_ERRORS as e:  # a fitted run the claim's reading does not expect: say so, show the published one
        print(f"{claim} from your results: not judged ({type(e).__name__}: {e})\n{pub_line}")
        return None
    if yours.verdict == "unmeasured":  # the file is missing from your folder, not from the published one
        yours.evidence = yours.evidence.replace("in notebooks/results", "among your results here")
    print(f"yours, {_machine(mine, yours, torch.cuda.get_device_name())}: {yours}")
    print(pub_line)
    return yours


def verdicts_table(mine: dict[str, dict] | None = None) -> str:
    """A markdown table of every claim: the verdict from your results beside the published one."""
    from tunekit_course import claims

    mine = here() if mine is None else mine
    rs = results.by_name(RESULTS)
    rows = [f"| # | yours ({_here_label(mine).removeprefix('here, ')}) | published, {PUBLISHED_GPU} |", "|---|---|---|"]
    for claim in (c for c in claims.CLAIMS if not claims.project_target(c)):
        try:
            yours = claims.judge(claim, mine).verdict
        except JUDGE_ERRORS as e:
            yours = f"not judged ({type(e).__name__})"
        rows.append(f"| {claim} | {yours} | {claims.judge(claim, rs).verdict} |")
    return "\n".join(rows)


# ---- how long a lesson takes ------------------------------------------------------------------------------

START_S = 10  # a child process's start (imports, the CUDA context), which no result file records


def run_seconds(r: dict) -> float:
    """About how long the run that made result `r` took: its wall time where recorded, else its build, warm-up
    (the first step among it) and timed steps, with the runs a result is made of (a noise result's processes,
    a comparison's stacks, a sweep's rows, a fit's trials)."""
    if r.get("wall_s"):
        return r["wall_s"]
    s = r.get("build_s") or 0
    s += sum(r["warmup_step_times_s"]) if r.get("warmup_step_times_s") else r.get("first_step_s") or 0
    s += (r.get("step_time_s") or 0) * len(r.get("step_times_s") or [])
    s += r.get("total_s") or r.get("seconds") or 0
    s += (r.get("steps") or 0) * ((r.get("compute_s_per_step") or 0) + (r.get("data_s_per_step") or 0))
    for key in ("runs", "stacks", "rows", "trials"):
        s += sum(run_seconds(x) for x in r.get(key) or [] if isinstance(x, dict))
    return s


def lesson_seconds(*prefixes: str, skip: tuple[str, ...] = (), rs: dict[str, dict] | None = None,
                   here: bool = False) -> float:
    """The published run's time for the results whose names start with `prefixes` (a lesson's: "l3_"), less
    those starting with `skip`: `run_seconds` of each plus `START_S`. `here`: only those this machine can run
    (not one of more processes than it has GPUs, which a lesson shows published)."""
    rs = results.by_name(RESULTS) if rs is None else rs
    picked = [r for n, r in rs.items() if prefixes and n.startswith(prefixes) and not (skip and n.startswith(skip))
              and (not here or fits_here(r))]
    return sum(run_seconds(r) + START_S for r in picked)


def _minutes(seconds: float) -> str:
    m = seconds / 60
    return "under a minute" if m < 1 else f"about {m:.0f} min" if m < 90 else f"about {m / 60:.1f} h"


def gpu_label() -> str:
    """This machine's GPUs in words: "NVIDIA H200 (140 GiB)", "2 x NVIDIA H200 (140 GiB each)"."""
    n, name = torch.cuda.device_count(), torch.cuda.get_device_name()
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    return f"{name} ({gib:.0f} GiB)" if n <= 1 else f"{n} x {name} ({gib:.0f} GiB each)"


def intro(*prefixes: str, skip: tuple[str, ...] = ()) -> str:
    """Print (and return) one sentence for a lesson's first cell: what it is about to measure, where, and how long
    its measurements took on the published H200 run (an estimate from its result files: `lesson_seconds` of the
    lesson's results, by name prefix). No prefixes: a lesson that reads the published results and checks a
    little live."""
    rs = results.by_name(RESULTS)  # read once for both sums below
    took = _minutes(lesson_seconds(*prefixes, skip=skip, rs=rs))
    if not prefixes:
        text = ("this lesson's benchmark tables are the published NVIDIA H200 results (each with the command that "
                "made it), and only its parity check runs here, in seconds.")
        text = (f"replay mode (TUNEKIT_REPLAY=1), which changes nothing in this lesson: {text}" if replay_mode() else
                f"On {gpu_label()} here: {text}" if on_gpu() else f"smoke mode: tiny model on CPU; {text}")
    elif replay_mode():
        text = (f"replay mode (TUNEKIT_REPLAY=1): this lesson reads the published {PUBLISHED_GPU} results instead of "
                f"measuring (they took {took} to measure there, an estimate) and writes nothing.")
    elif not on_gpu():
        text = (f"smoke mode: tiny model on CPU, a few minutes at most; on a GPU this lesson measures the 7B shape "
                f"(the published H200 run took {took}, an estimate), shown beside this run's figures.")
    else:
        cap, mine = memory_cap_gb(), lesson_seconds(*prefixes, skip=skip, rs=rs, here=True)
        text = (f"This lesson measures {gpu_label()} here"
                + (f", as a card of {cap:g} GB (TUNEKIT_MEMORY_GB)" if cap else "")
                + f"; on the published H200 run its measurements took {took}"
                + (f", those that fit this machine's GPUs {_minutes(mine)}" if prefixes and _minutes(mine) != took else "")
                + " (an estimate from the published results' build and step times), more on a slower GPU. Results -> "
                + shown(results_dir()) + ".")
    print(text)
    return text


def seed(*prefixes: str) -> list[Path]:
    """Copy into this GPU's folder the published results measured on a GPU of its model (and those of any GPU whose
    name starts with one of PREFIXES), so that executing a lesson reads them back, each saying it was measured on
    another machine, and measures only what it lacks: how the committed lessons are executed on the GPU machine
    (`python -m tunekit_course.notebook --seed [PREFIX...]`), a lesson's outputs then the published results'. A
    result already in the folder is kept; one of more processes than this machine has GPUs is left out (it could
    not be yours: a lesson shows it as published)."""
    import shutil

    if not on_gpu():
        raise FileNotFoundError("no CUDA GPU here (or TUNEKIT_SMOKE=1), so no GPU folder to seed")
    model, out, copied = torch.cuda.get_device_name(), gpu_folder(), []
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(RESULTS.glob("*.json")):
        r = json.loads(f.read_text())
        if (r.get("gpu") == model or f.name.startswith(prefixes)) and not (out / f.name).exists() \
                and fits_here(r):
            shutil.copy2(f, out / f.name)
            copied.append(out / f.name)
    return copied


def publish(folder: str | Path | None = None) -> list[Path]:
    """Copy the result files of `folder` (default: this machine's GPU folder, `gpu_folder()`) into the published
    folder, notebooks/results, with the chart of the same name beside any; print each. The course's own step
    (`python -m tunekit_course.notebook --publish [FOLDER]`): a notebook never writes there."""
    import shutil

    if folder is None:
        if not torch.cuda.is_available():
            raise FileNotFoundError("no CUDA GPU here, so no GPU folder of results: name the folder to publish "
                                    "(python -m tunekit_course.notebook --publish runs/results/GPU)")
        folder = gpu_folder()
    folder = Path(folder)
    if folder.is_file():
        raise NotADirectoryError(f"{folder} is a file: name the folder that holds the results to publish "
                                 f"(python -m tunekit_course.notebook --publish {folder.parent})")
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} does not exist: nothing to publish (measure first, or name the folder)")
    if folder.resolve() == RESULTS.resolve():
        raise ValueError(f"{folder} is the published folder itself")
    files = sorted(folder.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no result files: nothing to publish")
    results.load_results(*files)  # each a tunekit result, or nothing is copied
    RESULTS.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in files:
        for src in (f, f.with_suffix(".png")):
            if src.exists():
                shutil.copy2(src, RESULTS / src.name)
                copied.append(RESULTS / src.name)
                print(f"published {src.name} (from {folder})")
    return copied


def lesson4_plan(gpu: bool) -> dict[str, list[tuple[str, list, str]]]:
    """Lesson 4's measurements by section: (result name, `tunekit` arguments, compile cache: see `cache_env`).
    On a GPU: 7B LoRA/QLoRA steps (seq 2048), a 1.1B full fine-tune for the optimizers and fp32, a 10M model
    trained from scratch on tinyshakespeare. In smoke mode: the tiny model, GPU-only switches left out."""
    # 7B steps of about a second: 15 timed steps hold the median's error near 1% (noise_lora_b4: 0.2% spread)
    lora = ["bench", "--preset", "llama7b_lora", "--bench-max-steps", "15"]
    if not gpu:
        small = ["--bench-warmup", "1", "--bench-steps", "3", "--bench-max-steps", "3", "--max-length", "128"]
        tiny = ["bench", "--preset", "tiny", *small]
        tiny_converge = ["--max-steps", "20", "--eval-every", "10", "--hidden-size", "64", "--num-layers", "2",
                         "--num-heads", "4", "--intermediate-size", "128", "--batch-size", "8", "--max-length", "128",
                         "--warmup-steps", "2"]
        return {
            "tf32": [],
            "compile": [("l4_lora_eager", tiny, ""), ("l4_lora_regional_cold", [*tiny, "--compile", "regional"],
                                                     "cold:regional")],
            "optimizers": [(f"l4_opt_{o}", [*tiny, "--method", "full", "--optimizer", o], "") for o in ("adamw", "lion")],
            "converge": [(f"l4_converge_{o}", ["converge", "--preset", "shakespeare", "--sweep", f"{o}={lr}",
                                               *tiny_converge], "") for o, lr in (("adamw", 1e-3), ("lion", 1e-4))],
            "kernels": [], "fp8": []}
    one_b = ["bench", "--preset", "llama1b_full"]
    qlora = ["bench", "--preset", "llama7b_qlora", "--bench-max-steps", "15"]
    return {
        "tf32": [("l4_tf32_fp32_off", [*one_b, "--dtype", "fp32", "--batch-size", "2", "--tf32", "false"], ""),
                 ("l4_tf32_fp32_on", [*one_b, "--dtype", "fp32", "--batch-size", "2", "--tf32", "true"], ""),
                 ("l4_lora_tf32_off", [*lora, "--tf32", "false"], "")],
        "compile": [("l4_lora_eager", lora, ""),
                    ("l4_lora_regional_cold", [*lora, "--compile", "regional"], "cold:regional"),
                    ("l4_lora_regional_warm", [*lora, "--compile", "regional"], "warm:regional"),
                    ("l4_lora_model_cold", [*lora, "--compile", "model"], "cold:model"),
                    ("l4_qlora_eager", [*qlora], ""),
                    ("l4_qlora_regional_cold", [*qlora, "--compile", "regional"], "cold:qlora")],
        "optimizers": [(f"l4_opt_{o}", [*one_b, "--optimizer", o], "") for o in
                       ("adamw", "adamw_foreach", "adamw8bit", "paged_adamw8bit", "lion", "lion_pytorch", "lion8bit")],
        # two results, one per GPU; Lion's rates are AdamW's / 10 (the paper's rule), each range around its best
        "converge": [("l4_converge_adamw", ["converge", "--preset", "shakespeare", "--sweep",
                                            "adamw=1e-3,3e-3,1e-2;adamw8bit=1e-3,3e-3,1e-2"], ""),
                     ("l4_converge_lion", ["converge", "--preset", "shakespeare", "--sweep",
                                           "lion=1e-4,3e-4,1e-3;lion8bit=1e-4,3e-4,1e-3"], "")],
        "kernels": [("l4_lora_liger", [*lora, "--kernels", "liger", "--loss", "liger"], ""),
                    ("l4_lora_liger_regional", [*lora, "--kernels", "liger", "--loss", "liger", "--compile", "regional"],
                     "cold:liger")],
        "fp8": [("l4_lora_fp8", [*lora, "--fp8"], ""),
                ("l4_lora_fp8_regional", [*lora, "--fp8", "--compile", "regional"], "cold:fp8")]}


# Lesson 4's switches on one chart (charts.speedups): (what, the result with it, the result without it, the
# article's figure for it as (claim, what) of charts.ARTICLE, or None where the article is silent). Each is read
# against the same step without it: LoRA 7B eager with TF32 on, unless the row names another.
LESSON4_SPEEDUPS = [
    ("TF32, fp32 step of a 1.1B full fine-tune", "l4_tf32_fp32_on", "l4_tf32_fp32_off", ("C13", "speed-up")),
    ("TF32, bf16-autocast LoRA step", "l4_lora_eager", "l4_lora_tf32_off", ("C13", "speed-up")),
    ("regional compile, cold cache", "l4_lora_regional_cold", "l4_lora_eager", ("C14", "speed-up")),
    ("regional compile, warm cache", "l4_lora_regional_warm", "l4_lora_eager", ("C14", "speed-up")),
    ("whole-model compile, cold cache", "l4_lora_model_cold", "l4_lora_eager", ("C14", "speed-up")),
    ("regional compile, QLoRA with checkpointing", "l4_qlora_regional_cold", "l4_qlora_eager", ("C14", "speed-up")),
    ("8-bit AdamW, against AdamW (1.1B full)", "l4_opt_adamw8bit", "l4_opt_adamw", ("C15", "8-bit AdamW")),
    ("Lion, against AdamW (1.1B full)", "l4_opt_lion", "l4_opt_adamw", ("C15", "Lion")),
    ("Liger's fused kernels", "l4_lora_liger", "l4_lora_eager", None),
    ("Liger's kernels and regional compile", "l4_lora_liger_regional", "l4_lora_eager", None),
    ("FP8 matmuls (torchao)", "l4_lora_fp8", "l4_lora_eager", None),
    ("FP8 matmuls and regional compile", "l4_lora_fp8_regional", "l4_lora_eager", None),
]


# ---- scaling from 1 to 8 GPUs ------------------------------------------------------------------------

# workload: its `tunekit` arguments on a GPU; each runs under its parallelism on 1, 2, 4 and 8 GPUs
SCALING_WORKLOADS = {
    "ddp_lora": ["bench", "--preset", "llama7b_lora", "--parallel", "ddp"],  # LoRA 7B, batch 4 per GPU
    # full fine-tune 7B, batch 4 per GPU, each block compiled
    "fsdp_full": ["bench", "--preset", "llama7b_lora", "--method", "full", "--parallel", "fsdp", "--batch-size", "4",
                  "--compile", "regional"],
    "fsdp_qlora": ["bench", "--preset", "llama7b_qlora", "--parallel", "fsdp"],  # QLoRA 7B, checkpointing, batch 8
}
SCALING_SMOKE = ["--preset", "tiny", "--max-length", "128", "--batch-size", "2", "--bench-warmup", "1",
                 "--bench-steps", "2", "--bench-max-steps", "2"]


def scaling_plan(gpus: int, smoke: bool = False, workloads: tuple[str, ...] = tuple(SCALING_WORKLOADS)) \
        -> list[tuple[str, int, list[str]]]:
    """(result name `l3_scale_<workload>_<n>gpu`, processes, `tunekit` arguments) for each workload at each count
    of `SCALING_GPUS` up to `gpus`, fewest GPUs first (one GPU is each workload's baseline: the same step in one
    process). Smoke: the tiny model on 1 and 2 CPU processes (gloo), QLoRA as LoRA."""
    unknown = [w for w in workloads if w not in SCALING_WORKLOADS]
    if unknown:
        raise ValueError(f"scaling workloads {unknown}: choose from {', '.join(SCALING_WORKLOADS)}")
    counts = [n for n in SCALING_GPUS if n <= (2 if smoke else gpus)]
    plan = []
    for n in counts:
        for w in workloads:
            args = SCALING_WORKLOADS[w]
            if smoke:  # the same parallelism and method on the tiny model; bitsandbytes needs CUDA
                method = "full" if "full" in w else "lora"
                args = ["bench", *SCALING_SMOKE, "--method", method, "--parallel", args[args.index("--parallel") + 1]]
            plan.append((f"l3_scale_{w}_{n}gpu", n, list(args)))
    return plan


def measure_scaling(gpus: int, workloads: tuple[str, ...] = tuple(SCALING_WORKLOADS)) -> None:
    """Measure `scaling_plan` one launch at a time, each on its count of GPUs, with NVLink SHARP and multicast off
    (as every multi-GPU run of the course was measured). `python -m tunekit_course.notebook --measure scaling
    GPUS [WORKLOAD,...]`."""
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    for name, n, args in scaling_plan(gpus, not on_gpu(), workloads):
        measure(name, n, *args, env=env)


def skipped_sections() -> dict[str, str]:
    """{section of lesson 4: why it skips on this machine} for the sections whose package is missing here."""
    from tunekit import speedups

    needs = {"kernels": speedups.liger_available, "fp8": speedups.fp8_available}
    return {section: why for section, check in needs.items() if (why := check())}


def gpu_count() -> int:
    return torch.cuda.device_count() if on_gpu() else 0


def too_few_gpus(nproc: int) -> str | None:
    """Why this GPU machine cannot launch `nproc` processes, one on each GPU ("needs 2 GPUs, this machine has 1"),
    or None: where it has enough, and off a GPU (a smoke run's CPU processes stand in) or in replay mode."""
    n = gpu_count()
    if replay_mode() or not on_gpu() or nproc <= n:
        return None
    return f"needs {nproc} GPUs, this machine has {n}"


def fits_here(r: dict) -> bool:
    """Whether this machine can run result `r`'s processes (`too_few_gpus` of its world size)."""
    return not too_few_gpus(r.get("world_size") or 1)


def main(argv: list[str]) -> int:
    # python -m tunekit_course.notebook [--strict] NOTEBOOK...  execute notebooks in place (--strict: not on a GPU
    #                                                      where a lesson's section would skip for want of a package)
    # python -m tunekit_course.notebook --measure 4 GPUS   lesson 4's plan on GPUS GPUs at once (the notebook then reads it)
    # python -m tunekit_course.notebook --measure 4 GPUS SECTION,SECTION   only those sections
    # python -m tunekit_course.notebook --measure scaling GPUS [WORKLOAD,...]  1, 2, 4, 8 GPUs up to GPUS
    # python -m tunekit_course.notebook --publish [FOLDER]  copy a folder of results (this GPU's) to notebooks/results
    # python -m tunekit_course.notebook --seed [PREFIX...]  the published results of this GPU's model (and any GPU's
    #                                                      named PREFIX...) into its folder, read back by the lessons
    # Every --measure writes to results_dir(): this GPU's own folder, runs/results/<gpu>.
    if argv[:1] == ["--publish"]:
        try:
            copied = publish(argv[1] if len(argv) > 1 else None)
        except (FileNotFoundError, NotADirectoryError, ValueError) as e:
            print(f"--publish: {e}", file=sys.stderr)
            return 2
        print(f"{len(copied)} files copied into {RESULTS}")
        return 0
    if argv[:1] == ["--seed"]:
        try:
            copied = seed(*argv[1:])
        except FileNotFoundError as e:
            print(f"--seed: {e}", file=sys.stderr)
            return 2
        print(f"{len(copied)} published results copied into {shown(gpu_folder())}")
        return 0
    if argv[:2] == ["--measure", "scaling"]:
        measure_scaling(int(argv[2]), tuple(argv[3].split(",")) if len(argv) > 3 else tuple(SCALING_WORKLOADS))
    elif argv[:1] == ["--measure"] and argv[1:2] != ["4"]:  # lesson 5's whole runs are fullrun's, not a plan here
        print("--measure takes 4 or scaling; lesson 5's whole runs: python -m tunekit_course.fullrun SECONDS "
              "[NAME,...]", file=sys.stderr)
        return 2
    elif argv[:1] == ["--measure"]:
        plan = lesson4_plan(on_gpu())
        wanted = argv[3].split(",") if len(argv) > 3 else list(plan)
        # as the lesson's cells do: a section whose package is missing here is skipped, saying why
        missing = skipped_sections()
        for section in [s for s in wanted if s in missing and plan.get(s)]:
            print(f"{section}: skipped: {missing[section]}")
            wanted.remove(section)
        measure_in_parallel([item for s in wanted for item in plan[s]], int(argv[2]))
    else:
        from tunekit_course import pages

        strict = "--strict" in argv
        if on_gpu() and (missing := skipped_sections()):  # said before the minutes of a run, not found after
            for section, why in missing.items():
                print(f"lesson 4's {section} section will be skipped here: {why}", file=sys.stderr)
            if strict:
                print("--strict: not executing with sections skipped", file=sys.stderr)
                return 2
        for arg in (a for a in argv if a != "--strict"):
            print(f"executed {pages.execute(arg)}")
        return 0
    print(f"results -> {shown(results_dir())} (publish them with: python -m tunekit_course.notebook --publish)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
