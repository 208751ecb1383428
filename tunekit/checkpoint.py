"""Training checkpoints that resume exactly, and the run folder they live in.

A checkpoint holds what a run needs to continue as if it had never stopped: the trainable weights (a
PEFT adapter, or the full state dict), the optimizer and scheduler, every RNG state, and the data position.
Everything is written into a temp folder and renamed into place only when complete (`io.atomic_output`,
which every folder or file the project writes goes through), and the `latest` pointer
is replaced atomically after that — a run killed mid-save leaves the previous checkpoint intact.

`meta.json`, written last, records the sha256 and size of every file of the checkpoint. Loading checks them
(a truncated, zeroed or bit-flipped file is named, not fed to torch), and resuming takes the newest
checkpoint that verifies — whatever `latest` says, since a kill can fall between the rename and the pointer.

The run folder (`open_run`): a new run refuses a folder that holds another one unless told to overwrite it; a
resume refuses a config that differs from the saved one, except in `config.RESUME_SAFE_FIELDS` when allowed;
temps left by killed writes are removed at the next start.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from tunekit import distributed
from tunekit.config import RESUME_SAFE_FIELDS, ConfigError, TuneConfig, config_dict, load_config
from tunekit.io import (
    CheckpointError,
    atomic_output,
    atomic_write_text,
    check_writable,
    file_sha256,
    remove,
    temp_path,
)

LATEST = "latest"
META = "meta.json"
CKPT = re.compile(r"ckpt-(\d+)")
# What a training run writes into its folder (`prepared/` is a cache of the tokenized data, not part of a run).
RUN_FILES = ("config.json", "data.json", "metrics.jsonl", "summary.json", LATEST, "adapter", "model")


class RunFolderError(RuntimeError):
    """The run folder holds another run, or a resume cannot continue what is there."""


def rng_state() -> dict:
    """Every RNG's state in types a weights-only load reads back (tensors, tuples, ints, floats, strings):
    numpy's key array as an int64 tensor, since a pickled ndarray needs numpy's own unpickling."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` saved, exactly; also the ndarray form that checkpoints before it held."""
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# The trainable weights of a checkpoint; checkpoints before it held them in the pickle `trainable.pt`.
WEIGHTS, OLD_WEIGHTS = "trainable.safetensors", "trainable.pt"


def _own_storage(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor with a storage of its own, as safetensors requires: a view into a larger tensor (a
    grouped layer's slice of one weight) is copied, anything else is written as it is."""
    return {n: t if t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.contiguous().clone()
            for n, t in tensors.items()}


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only the parameters that train: the adapter for LoRA, everything for full fine-tuning."""
    return {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(run_dir: str | os.PathLike, step: int, model, optimizer, scheduler, data_state: dict,
                    keep: int = 2) -> Path:
    """Write `run_dir/ckpt-<step>/` atomically and point `run_dir/latest` at it. Keeps the newest `keep`.

    One process (or DDP, where every rank holds the same state): rank 0 writes `trainable.safetensors`, a PEFT
    `adapter/` and `state.pt`. FSDP2: every rank writes its own shards of the trainable weights and the
    optimizer state through `torch.distributed.checkpoint` into `sharded/` (nothing is gathered), and rank 0
    adds `state.pt` (scheduler, RNG, data position). Either way the folder appears complete or not at all,
    with every file's checksum in `meta.json`. `state.pt` holds only tensors and plain Python values, so
    `load_checkpoint` reads it with `weights_only=True`: no file of a checkpoint can run code when loaded."""
    run_dir = Path(run_dir)
    final = run_dir / f"ckpt-{step:07d}"
    sharded, main = distributed.is_sharded(model), distributed.is_main()
    if main:
        check_writable(run_dir)
    # Sharded, every rank writes into the one temp folder rank 0 renames: a name they all know.
    tag = "sharded" if sharded else None
    with atomic_output(final, tag=tag) if main else contextlib.nullcontext(temp_path(final, tag)) as tmp:
        if main:
            tmp.mkdir()
        state = {"scheduler": scheduler.state_dict(), "rng": rng_state(), "data": data_state, "step": step}
        if sharded:
            distributed.barrier()
            distributed.save_sharded(model, optimizer, tmp / "sharded")  # collective: each rank its own files
            distributed.barrier()
            state["sharded"] = True
        elif main:
            from safetensors.torch import save_file

            save_file(_own_storage(trainable_state_dict(model)), tmp / WEIGHTS)
            if hasattr(model, "peft_config"):  # also a standard PEFT adapter folder, loadable with PeftModel
                model.save_pretrained(tmp / "adapter")
            state["optimizer"] = optimizer.state_dict()
        if main:  # last: state.pt, then meta.json with every file's size and sha256
            torch.save(state, tmp / "state.pt")
            files = {str(f.relative_to(tmp)): {"sha256": file_sha256(f), "bytes": f.stat().st_size}
                     for f in sorted(tmp.rglob("*")) if f.is_file()}
            (tmp / META).write_text(json.dumps({"step": step, "data": data_state, "files": files}, indent=1) + "\n")
    if main:
        atomic_write_text(run_dir / LATEST, final.name + "\n")
        old = [p for p in checkpoints(run_dir) if p != final]
        for p in old[: max(0, len(old) - (keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)
    distributed.barrier()  # the other ranks go on once the checkpoint is complete
    return final


def checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """The `ckpt-<step>` folders of a run, oldest first (by step, not by name or time)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and CKPT.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(CKPT.fullmatch(p.name)[1]))


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step a checkpoint was written at, from its `meta.json`."""
    return json.loads((Path(path) / META).read_text())["step"]


def checkpoint_world(path: str | os.PathLike) -> int:
    """How many processes wrote the checkpoint (1 for checkpoints from before runs recorded it)."""
    return json.loads((Path(path) / META).read_text())["data"].get("world", 1)


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """None if every file of the checkpoint at `path` has the size and sha256 recorded when it was written;
    otherwise what is wrong, naming the file. A `meta.json` without its file list (checkpoints from before
    checksums, or one edited) is a problem too: what the checkpoint holds could not be checked."""
    path = Path(path)
    meta = path / META
    try:
        saved = json.loads(meta.read_text())
        if not isinstance(saved["step"], int) or not isinstance(saved["data"], dict):
            raise TypeError("its step is not a number or its data position not an object")
        files = saved.get("files")
        if not isinstance(files, dict) or not files:
            return (f"{meta} lists no files with their sha256 (written before checkpoints recorded them, or "
                    "edited), so the checkpoint cannot be checked and is not loaded")
        # What load_checkpoint reads must be among the files checked.
        weights = OLD_WEIGHTS if OLD_WEIGHTS in files and WEIGHTS not in files else WEIGHTS
        needed = ["state.pt"] + ([] if any(n.startswith("sharded/") for n in files) else [weights])
        if unlisted := [n for n in needed if n not in files]:
            return (f"{meta} does not list {', '.join(unlisted)}, so the checkpoint cannot be checked and is not "
                    "loaded")
    except FileNotFoundError:
        return f"{meta} is missing (the checkpoint was never finished)"
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{meta} is unreadable ({type(e).__name__}: {e})"
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if not (isinstance(want, dict) and {"sha256", "bytes"} <= want.keys()):
            return f"{meta} is unreadable (no sha256 and size for {name})"
        if size != want["bytes"]:
            return f"{f} is truncated or overwritten: {size} bytes, {want['bytes']} were written"
        if file_sha256(f) != want["sha256"]:
            return f"{f} is corrupt: its sha256 differs from the one recorded when it was written"
    return None


def find_checkpoint(run_dir: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint of `run_dir` that verifies, what is wrong with each newer one). The newest by
    step, not the one `latest` names: a kill between the folder's rename and the pointer's update leaves
    `latest` one checkpoint behind."""
    bad = []
    for path in reversed(checkpoints(run_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path, bad
        bad.append(problem)
    return None, bad


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint of `run_dir` that verifies (see `find_checkpoint`), or None."""
    return find_checkpoint(run_dir)[0]


def _old_rng_globals() -> list:
    """What a weights-only load needs to read the numpy RNG state of checkpoints before `rng_state` stored it
    as a tensor: numpy's ndarray rebuilt from bytes, with a uint32 dtype only (no object arrays, no calls)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    uint32 = type(np.dtype(np.uint32))
    return [np.ndarray, np.dtype, uint32,
            *((_reconstruct, f"{m}.multiarray._reconstruct") for m in ("numpy._core", "numpy.core"))]


def _load_file(path: Path):
    """A checkpoint file's tensors and plain values: safetensors, or a pickle read with `weights_only=True`,
    which refuses anything but tensors and plain Python values — a crafted pickle cannot run code."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(path)
        with torch.serialization.safe_globals(_old_rng_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise CheckpointError(f"cannot load checkpoint file {path}: {type(e).__name__}: {e}") from None
        called = re.search(r"GLOBAL ([\w.]+)", str(e))
        other = re.search(r"Unpickler error:\s*(.+?)(\.\s|\n|$)", str(e))
        what = f"it calls {called[1]}" if called else other[1] if other else "a weights-only load refuses it"
        raise CheckpointError(f"refusing checkpoint file {path}: it holds Python objects besides tensors and plain "
                              f"values, and loading them could run code ({what}). tunekit never writes such a "
                              "file: it was made or changed elsewhere. Resume from a checkpoint you trust, or "
                              "start over with --overwrite.") from None
    except Exception as e:  # noqa: BLE001 - torch.load fails in many ways on a damaged file
        raise CheckpointError(f"cannot load checkpoint file {path}: {type(e).__name__}: {e}") from None


def load_checkpoint(path: str | os.PathLike, model, optimizer, scheduler, verify: bool = True) -> dict:
    """Restore weights, optimizer, scheduler and RNG from `path`; return the saved data state and step.
    Checks every file against its recorded checksum first (`verify=False`: the caller just did)."""
    path = Path(path)
    if verify and (problem := verify_checkpoint(path)):
        raise CheckpointError(f"cannot load checkpoint: {problem}")

    if (path / "sharded").is_dir() or distributed.is_sharded(model):
        if not ((path / "sharded").is_dir() and distributed.is_sharded(model)):
            kind = "a sharded (FSDP2)" if (path / "sharded").is_dir() else "a single-process or DDP"
            raise CheckpointError(f"{path} was written by {kind} run; resume it the same way (--parallel and "
                                  "the launch)")
        state = _load_file(path / "state.pt")
        distributed.load_sharded(model, optimizer, path / "sharded")
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        return {"step": state["step"], "data": state["data"]}
    # Both files are read before anything changes, so a bad one leaves the model as it was.
    weights = path / WEIGHTS if (path / WEIGHTS).is_file() else path / OLD_WEIGHTS
    trainable, state = _load_file(weights), _load_file(path / "state.pt")
    params = dict(model.named_parameters())
    missing = [n for n in trainable if n not in params]
    if missing:
        raise ValueError(f"{path}: checkpoint has parameters the model lacks ({missing[:3]}...). "
                         "Was it written with another model or method?")
    with torch.no_grad():
        for n, t in trainable.items():
            params[n].copy_(t)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return {"step": state["step"], "data": state["data"]}


# ---- the run folder ----------------------------------------------------------------------------------


def run_contents(run_dir: str | os.PathLike) -> list[str]:
    """The names of what a training run left in `run_dir` (config, metrics, checkpoints, outputs); [] if
    it holds no run (absent, empty, or only prepared data)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    names = [n for n in RUN_FILES if (run_dir / n).exists()]
    return names + [p.name for p in checkpoints(run_dir)]


def remove_run(run_dir: str | os.PathLike) -> list[str]:
    """Delete what a run left in `run_dir` (not `prepared/`, the reusable tokenized data); return the names."""
    names = run_contents(run_dir)
    for name in names:
        remove(Path(run_dir) / name)
    return names


def clean_temp(run_dir: str | os.PathLike) -> list[str]:
    """Remove the hidden `.ckpt-*.tmp` folders and `.<file>.*.tmp` files that killed writes left in
    `run_dir` (`atomic_output` and `atomic_write_text` name their temps so); return their names."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = sorted(p for p in run_dir.glob(".*.tmp"))
    for p in found:
        remove(p)
    return [p.name for p in found]


def open_run(run_dir: Path, cfg: TuneConfig, resume: bool, overwrite: bool, allow_config_change: bool,
             say=print, clean: bool = True) -> tuple[Path | None, list[str]]:
    """Check the run folder before any data or model work; return (the checkpoint to resume from, the config
    changes a resume allows). With `clean` (rank 0 of a distributed run, or a single process), removes temps
    that killed writes left; otherwise changes nothing."""
    for name in clean_temp(run_dir) if clean else ():
        say(f"removed {run_dir / name}, left by an interrupted write")
    if not resume:
        if (found := run_contents(run_dir)) and not overwrite:
            raise RunFolderError(f"{run_dir} holds another run ({', '.join(found)}). Continue it with --resume, "
                                 "replace it with --overwrite, or choose another --out-dir.")
        return None, []
    changes = check_resume_config(run_dir, cfg, allow_config_change)
    ckpt, bad = find_checkpoint(run_dir)
    if bad and ckpt is None:
        raise CheckpointError(f"cannot resume {run_dir}: no checkpoint verifies:\n  " + "\n  ".join(bad)
                              + "\nRestore the files, or start over with --overwrite.")
    for problem in bad:
        say(f"resume: {problem}; falling back to {ckpt}, the newest checkpoint that verifies")
    return ckpt, changes


def derived(field: str, saved: dict, new: dict) -> bool:
    """Whether a difference in `field` between a run's saved config and the one resuming it is only what the
    run resolved: `packing: auto` became what the data decided, `max_steps` was computed from `epochs` and
    `eval_every: -1` became an epoch's steps (all from the data and max_length, which are compared). Runs
    saved before config.json recorded resolved values say `auto` for device and dtype: whatever that resolved
    to then passes."""
    if field == "packing":
        return new[field] == "auto"
    if field == "max_steps":
        return new["epochs"] > 0
    if field == "eval_every":
        return new[field] == -1 and new["epochs"] > 0
    return field in ("device", "dtype") and saved[field] == "auto"


def saved_config(run_dir: Path) -> TuneConfig:
    """The config a run recorded (resolved values included) in its config.json."""
    return load_config(run_dir / "config.json")


def check_resume_config(run_dir: Path, cfg: TuneConfig, allow_change: bool) -> list[str]:
    """Compare `cfg` (resolved) with the config the run in `run_dir` started with. Raise ConfigError listing
    the differences, unless each is in RESUME_SAFE_FIELDS and `allow_change`; return those changes.
    (`out_dir` is not compared: the folder is the run, however it is spelled.)"""
    path = run_dir / "config.json"
    if not path.exists():
        if checkpoints(run_dir):
            raise ConfigError(f"cannot resume {run_dir}: it has checkpoints but no config.json to check the "
                              "config against. Put the run's config.json back, or start over with --overwrite.")
        return []
    saved, new = config_dict(load_config(path)), config_dict(cfg)
    diffs = [(k, saved[k], new[k]) for k in new if k != "out_dir" and saved[k] != new[k] and not derived(k, saved, new)]
    lines = [f"{k}: {old!r} -> {value!r}" for k, old, value in diffs]
    unsafe = [k for k, _, _ in diffs if k not in RESUME_SAFE_FIELDS]
    head = f"cannot resume {run_dir}: the config differs from the one it started with ({path}):\n  "
    if unsafe:
        raise ConfigError(head + "\n  ".join(lines) + f"\n{', '.join(unsafe)} cannot change in the middle of a "
                          "run. Resume with the saved values, or start a new run in another --out-dir "
                          "(--overwrite replaces this one).")
    if diffs and not allow_change:
        raise ConfigError(head + "\n  ".join(lines) + "\nThese may change on resume: say so with "
                          "--allow-config-change.")
    return lines
