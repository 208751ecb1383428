"""Result files: one writer for every published figure, the code that made it, and when one may be reused.

Every measurement is one JSON file (the course publishes its own in `notebooks/results/`). `new_result` builds
the part every file shares — the keys any tool can read (`REQUIRED_KEYS`), the date, GPU, package versions,
the resolved config, and the *provenance*: the git commit and whether the code differed from it, a hash of
the code that measured (`code_hash`: the library, every `tunekit/**/*.py`, plus the files of an experiment
outside it, named in `code_files`), and the entry point and call that produced it. Nothing else builds that
header, so a figure can always be traced to the code and the command behind it. The course's own files
(claims, README tables, lesson plans) are not in the hash: editing them changes no measurement.

A result is reused instead of re-measured (`reusable`) only when its config, GPU, package versions *and*
`code_hash` all match: a change anywhere in the library re-measures everything that depends on it.

On a machine given a copy of the tree (the GPU machine), set `TUNEKIT_COMMIT` to the full hash of the commit
the copy was made from and `TUNEKIT_DIRTY=0` if it had no uncommitted changes; they take precedence over
git. `code_hash` is computed there from the files themselves, and `tests/unit/test_results.py` checks it against
the recorded commit, so a wrong commit cannot go unnoticed.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from tunekit import distributed
from tunekit.config import TuneConfig, config_dict
from tunekit.io import atomic_write_json

REQUIRED_KEYS = ("name", "preset", "gpu", "world_size", "tokens_per_s", "peak_memory_gb", "date")
PROVENANCE_KEYS = ("commit", "dirty", "code_hash", "entry", "call")
LIBRARY = Path(__file__).resolve().parent  # tunekit/
CHECKOUT = LIBRARY.parent  # what git is asked about, and what `code_files` are relative to


# ---- provenance ------------------------------------------------------------------------------------------


def source_hash(files: dict[str, bytes]) -> str:
    """A short hash of {relative path: bytes}, independent of order."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name] + b"\0")
    return h.hexdigest()[:16]


def code_hash(root: Path = LIBRARY, code_files: tuple[str, ...] | list[str] = ()) -> str:
    """The hash of the library's Python source as it is on disk now: every `*.py` under `root`, named by its path
    inside it (so a hash of a flat `tunekit/` is what it was before the library had folders), and the
    `code_files` (paths inside the checkout) of an experiment that lives outside it."""
    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.py"))}
    return source_hash({**files, **{name: (root.parent / name).read_bytes() for name in code_files}})


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(CHECKOUT), *args], check=False, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state() -> tuple[str | None, bool | None]:
    """(commit, whether the code differs from it): $TUNEKIT_COMMIT / $TUNEKIT_DIRTY when set, else git.

    The variables win over git because a copy of the tree can carry a stale `.git`: on the GPU machine the
    copy's `.git` said HEAD was the session's first commit, so git reported that commit, dirty."""
    if commit := os.environ.get("TUNEKIT_COMMIT"):
        dirty = os.environ.get("TUNEKIT_DIRTY")
        return commit, (None if dirty is None else dirty not in ("0", "false", ""))
    commit = _git("rev-parse", "HEAD")
    if commit:
        return commit, bool(_git("status", "--porcelain", "--", "tunekit", "tunekit_course"))
    return None, None


# environment variables that change a run's arithmetic or kernels
BEHAVIOUR_ENV = ("TUNEKIT_LORA_BMM", "TUNEKIT_BF16_BMM", "TUNEKIT_OFFLOAD_STREAM", "TUNEKIT_FP8_FAST_ACCUM",
                 "TUNEKIT_COMPILE_MODE", "TUNEKIT_COMPILED_LOSS")


def entry_point() -> str:
    """What was run: the notebook being executed, the `tunekit` command line, or the Python command."""
    argv0 = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    # the command, with the variables that change what the code does (`BEHAVIOUR_ENV`) in front
    env = [f"{k}={os.environ[k]}" for k in BEHAVIOUR_ENV if k in os.environ]
    command = " ".join([*env, "tunekit", *sys.argv[1:]]) if argv0 in ("tunekit", "cli.py") else None
    if nb := os.environ.get("TUNEKIT_NOTEBOOK"):  # set by tunekit_course.pages.execute, inherited by its children
        return f"notebook {nb} (python -m tunekit_course.notebook {nb})" + (f": {command}" if command else "")
    if command:
        return command
    return " ".join([*env, "python", *sys.argv]) if argv0 else "python (interactive)"


def provenance(call: str = "", code_files: tuple[str, ...] | list[str] = ()) -> dict:
    commit, dirty = git_state()
    return {"commit": commit, "dirty": dirty, "code_hash": code_hash(code_files=code_files), "entry": entry_point(),
            "call": call, **({"code_files": list(code_files)} if code_files else {})}


def code_file(module_file: str) -> str:
    """A module's file as `code_files` names it: its path inside the checkout (`tunekit_course/databench.py`)."""
    return Path(module_file).resolve().relative_to(CHECKOUT).as_posix()


# ---- the header every result file shares ----------------------------------------------------------------


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor() or 'unknown'})"


def gpu_uuid() -> str | None:
    """The physical GPU this process measures on (its UUID), None without CUDA: two machines of the same GPU model
    differ by more than many changes do (18% seen between two H200 machines), so results are compared as the
    same machine's only where their UUIDs say so."""
    import torch

    if not torch.cuda.is_available():
        return None
    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
    return str(uuid) if uuid is not None else None


def versions() -> dict:
    import importlib.metadata as md

    import torch

    out = {"python": platform.python_version(), "cuda": torch.version.cuda}
    for pkg in ("torch", "transformers", "peft", "accelerate", "datasets", "bitsandbytes", "flash-attn",
                "liger-kernel", "torchao", "trl"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def fp8_fast_accum() -> bool:
    """Whether FP8 input gradients accumulate fast in this process's runs and its children's:
    TUNEKIT_FP8_FAST_ACCUM where set (the command line applies it, `cli.apply_environment`), else the library's
    setting (`fastlora.FAST_ACCUM_BACKWARD`). Results before it became the default say it in `entry` alone."""
    if (value := os.environ.get("TUNEKIT_FP8_FAST_ACCUM")) is not None:
        return value != "0"
    from tunekit import fastlora

    return fastlora.FAST_ACCUM_BACKWARD


def new_result(name: str, cfg: TuneConfig | None, tokens_per_s: float | None, peak_memory_gb: float | None,
               call: str = "", world_size: int | None = None, code_files: tuple[str, ...] = (), **fields) -> dict:
    """A result dict: the shared header (required keys, date, provenance) then `fields`, config and versions.
    `world_size` defaults to the processes of the running process group (1 without one); `tokens_per_s` is
    per GPU. `code_files`: the files outside the library that the measurement ran (an experiment of the
    course's: `code_file(__file__)`), hashed with the library. A run with FP8 says how its input gradients
    accumulated (`fp8_fast_accum`)."""
    fp8 = {"fp8_fast_accum": fp8_fast_accum()} if cfg is not None and cfg.fp8 else {}
    return {
        "name": name, "preset": cfg.preset if cfg else "-", "gpu": gpu_name(),
        "world_size": world_size or distributed.world_size(),
        "tokens_per_s": tokens_per_s, "peak_memory_gb": peak_memory_gb,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu_uuid": gpu_uuid(), **provenance(call, code_files), **fp8, **fields,
        "config": config_dict(cfg) if cfg else None, "versions": versions(),
    }


# ---- files -------------------------------------------------------------------------------------------------


def save_result(result: dict, out: str | Path) -> Path:
    """Write one result; `out` is a .json path or a folder (then `<folder>/<name>.json`)."""
    out = Path(out)
    path = out if out.suffix == ".json" else out / f"{result['name']}.json"
    atomic_write_json(path, {k: v for k, v in result.items() if not k.startswith("_")})
    return path


def load_results(*paths: str | Path) -> list[dict]:
    """Read result files (or every *.json in given folders), checking each has the required keys."""
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(p.glob("*.json")) if p.is_dir() else [p])
    results = []
    for f in files:
        try:
            r = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}: line {e.lineno}: not valid JSON ({e.msg})") from None
        missing = [k for k in REQUIRED_KEYS if k not in r]
        if missing:
            raise ValueError(f"{f}: not a tunekit result, missing keys {missing}")
        r["_file"] = str(f)
        results.append(r)
    return results


def by_name(*paths: str | Path) -> dict[str, dict]:
    """{name: result} for the result files under `paths`."""
    return {r["name"]: r for r in load_results(*paths)}


def reusable(path: str | Path, cfg: TuneConfig) -> dict | None:
    """The result saved at `path` if the same code (`code_hash`), config, GPU and package versions made it."""
    path = Path(path)
    if not path.exists():
        return None
    old = json.loads(path.read_text())
    same = (old.get("config") == config_dict(cfg) and old.get("gpu") == gpu_name()
            and old.get("code_hash") == code_hash(code_files=old.get("code_files", ()))
            and old.get("versions") == versions())
    return old if same else None


# ---- noise -----------------------------------------------------------------------------------------------


def value(r: dict | None, key: str) -> float | None:
    """`r[key]`, a dotted key reading into dicts (`timings.first_step_s`); None where it is missing or not a
    number."""
    for part in key.split("."):
        r = r.get(part) if isinstance(r, dict) else None
    return r if isinstance(r, (int, float)) and not isinstance(r, bool) else None


def noise_band(a: dict, b: dict, noise: dict[str, dict] | None = None) -> float:
    """The relative difference below which two speed results are the same within noise: the larger of the
    two results' own step-time spread and the run-to-run spread measured for their batch size (a `noise_*`
    result: the same config benched in separate processes)."""
    band = max(a.get("step_time_spread") or 0.0, b.get("step_time_spread") or 0.0)
    # a cited figure, or a stack's row of a comparison, has no config: it brings its own spread only
    batches = [r["config"]["batch_size"] for r in (a, b) if r.get("config")]
    if not batches:
        return band
    batch = min(batches)
    for n in (noise or {}).values():
        if "between_run_spread" in n:
            small = batch <= 2
            if (n["config"]["batch_size"] <= 2) == small:
                band = max(band, n["between_run_spread"])
    return band


def compare(a: dict, b: dict, noise: dict[str, dict] | None = None, key: str = "tokens_per_s") -> tuple[float, str]:
    """(a/b, words): '1.23x' or '1.02x, same within noise (band ±4%)'."""
    ratio = a[key] / b[key]
    band = noise_band(a, b, noise)
    if abs(ratio - 1) <= band:
        return ratio, f"{ratio:.2f}x, same within noise (±{band:.0%})"
    return ratio, f"{ratio:.2f}x"


# ---- tables and plots -------------------------------------------------------------------------------------


def format_table(results: list[dict]) -> str:
    """A markdown table: one row a step result. `spread` is half the interquartile range of the step times
    over their median; `commit` is the code that measured it (`+`: with uncommitted changes to it)."""
    def mfu(r: dict) -> str:
        return "" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"

    def setup(r: dict) -> str:
        c = r.get("config", {})
        parts = [c.get("method", "?"), f"b{c.get('batch_size', '?')}x{c.get('max_length', '?')}"]
        if c.get("grad_accum", 1) > 1:
            parts.append(f"accum {c['grad_accum']}")
        if c.get("grad_ckpt"):
            parts.append("ckpt")
        if r.get("world_size", 1) > 1:
            parts.append(f"{distributed.choose_parallel(c.get('parallel', 'auto'), c.get('method', 'lora'))} x{r['world_size']}")
        return ", ".join(parts)

    def spread(r: dict) -> str:
        return "-" if r.get("step_time_spread") is None else f"±{r['step_time_spread'] / 2:.1%}"

    head = ("| name | setup | gpu | tok/s per GPU | spread | step s | peak alloc GB | MFU | commit | date |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {r['name']} | {setup(r)} | {r['gpu']} | {r['tokens_per_s']:,.0f} | {spread(r)} | "
            f"{r.get('step_time_s', float('nan')):.3f} | {r['peak_memory_gb']:.2f} | {mfu(r)} | "
            f"{(r.get('commit') or '-')[:7]}{'+' if r.get('dirty') else ''} | {r['date'][:10]} |"
            for r in results]
    return "\n".join([head, *rows])


def plot_results(results: list[dict], reference: dict[str, float] | None = None, title: str = ""):
    """Bars of tok/s and peak memory per result; `reference` adds labelled horizontal lines (tok/s)."""
    import matplotlib.pyplot as plt

    names = [r["name"] for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 0.5 * len(names) + 2))
    ax1.barh(names, [r["tokens_per_s"] for r in results], color="tab:blue")
    ax1.set_xlabel("tokens/s per GPU (higher is better)")
    for label, value in (reference or {}).items():
        ax1.axvline(value, ls="--", color="gray")
        ax1.text(value, len(names) - 0.5, f" {label}", rotation=90, va="top", fontsize=8, color="gray")
    ax2.barh(names, [r["peak_memory_gb"] for r in results], color="tab:orange")
    ax2.set_xlabel("peak allocated memory, GB (lower is better)")
    ax2.set_yticks([])
    fig.suptitle(title or f"{results[0]['gpu']}" if results else title)
    fig.tight_layout()
    return fig
