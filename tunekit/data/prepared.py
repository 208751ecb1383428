"""Prepared data: the tokenized dataset and the tokenizer a run trains on, reused only once checked.

`train.prepare` tokenizes a run's data once into `<run>/prepared/`; later starts, a resume, `generate` and
`export` read it back. What makes that safe, and what each part costs:

- **A key that follows the content** (`data.source_digest`): the sha256 of the data file's bytes (a
  `save_to_disk` folder: of its files), never its size and mtime, which `cp -p` and `rsync -a` keep across an
  edit. Costs a read of the data at each start: milliseconds for GSM8K, about a second a GB.
- **The sha256 of every prepared file** in `stats.json`, as `meta.json` holds for a checkpoint (`load`): a
  bit flip, a truncated, deleted or swapped tokenizer is found before anything reads it, and the folder is
  made again, saying so, instead of a traceback or a wrong tokenizer. Costs a read of the prepared files at
  each reuse.
- **Made outside the run folder, copied in once the run has started** (`commit`): a start prepares into
  the cache (`$TUNEKIT_CACHE/prepared/<key>`, which a later start with the same key reuses) and the run
  folder gets its copy only after the run has started, so a start that fails leaves `prepared/` as it was.
  The copy is hard links where the file system allows them (no second copy on disk; a file damaged in one
  place is damaged in both, and the checksums find it in both).
- **The run's record of what it trained on**, `<run>/data.json` (the data's sha256, the tokenizer's digest,
  the sample and token counts), written when the run starts: a resume refuses other data or another
  tokenizer, naming which (`check_data`, `check_run`); `export` and `generate` check the tokenizer with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from tunekit.data.layouts import DataError
from tunekit.data.records import CODE_VERSION
from tunekit.io import atomic_output, atomic_write_json, cache_dir, file_sha256

STATS = "stats.json"
RECORD = "data.json"
START_OVER = "start over with --overwrite (or another --out-dir)"
# What a run's record holds: its data, the tokenizer, and the counts of what it trains on.
COUNTS = ("samples", "tokens", "target_tokens", "packed_rows", "packing")
RECORDED = ("data", "data_sha256", "key", "tokenizer_sha256", "vocab_size", *COUNTS)
# The files of a saved tokenizer, by how their names start (fast and sentencepiece tokenizers, chat templates).
TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "spiece", "chat_template")


def tokenizer_digest(tokenizer) -> str:
    """A sha256 of what decides how a tokenizer encodes: its vocabulary (added tokens included), its special
    tokens and its chat template. Not its saved files, whose format changes between library versions, nor
    the backend's serialization, which keeps the padding and truncation of the last call."""
    parts = {"vocab": sorted(tokenizer.get_vocab().items()), "special": tokenizer.special_tokens_map,
             "chat_template": getattr(tokenizer, "chat_template", None)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def tokenizer_source(name: str) -> str:
    """What names the tokenizer in a prepared key: a hub name as it is; a local folder by the sha256 of its
    tokenizer files too (not its weights), so another tokenizer put in its place is not taken for the old."""
    folder = Path(name).expanduser()
    if not (name and folder.is_dir()):
        return name
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.name.startswith(TOKENIZER_FILES))
    return name + "|" + "|".join(f"{f.name}:{file_sha256(f)}" for f in files)


def cache_folder(key: str) -> Path:
    """Where a start prepares the data of `key` (this tunekit's code: another tokenizes anew)."""
    return cache_dir() / "prepared" / f"{key}-{CODE_VERSION[:8]}"


def file_sums(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): file_sha256(f) for f in sorted(folder.rglob("*"))
            if f.is_file() and f.name != STATS}


def save(folder: Path, tokenizer, ds, stats: dict) -> None:
    """The dataset, the tokenizer and `stats.json` (with every file's sha256) into `folder`, whole or not at
    all; a folder another process finished first is kept."""
    with atomic_output(folder, keep_existing=True) as tmp:
        tmp.mkdir()
        ds.save_to_disk(str(tmp / "dataset"))
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        (tmp / STATS).write_text(json.dumps({**stats, "files": file_sums(tmp)}, indent=2, default=str) + "\n")


def _verified_stats(folder: Path, key: str | None, part: str = "", check: bool = True) -> tuple[dict | None, str | None]:
    """(stats, None) when `folder/stats.json` is for `key` (any, if None) and every file it lists under `part`
    has its sha256; (None, None) when there is no prepared folder or it was made for another key; (None,
    what is wrong) otherwise."""
    stats_file = folder / STATS
    if not stats_file.exists():
        return None, (f"{stats_file} is missing" if folder.is_dir() and any(folder.iterdir()) else None)
    try:
        stats = json.loads(stats_file.read_bytes())
    except (OSError, ValueError) as e:  # (a UnicodeDecodeError is a ValueError)
        return None, f"{stats_file} is unreadable ({type(e).__name__}: {e})"
    if not isinstance(stats, dict):
        return None, f"{stats_file} is unreadable (not a JSON object)"
    if key is not None and stats.get("key") != key:
        return None, None  # made for other data or settings
    files = stats.pop("files", None)
    if not isinstance(files, dict) or not files:
        return None, f"{stats_file} lists no checksums (prepared by an older tunekit)"
    for name, want in files.items() if check else ():
        if not name.startswith(part):
            continue
        f = folder / name
        if not f.is_file():
            return None, f"{f} is missing"
        if file_sha256(f) != want:
            return None, f"{f} is corrupt or replaced: its sha256 differs from the one in {stats_file}"
    return stats, None


def _read_tokenizer(folder: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:  # as `model.load_tokenizer` gives it to training
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load(folder: Path, key: str, trust_remote_code: bool = False, verify: bool = True):
    """((tokenizer, dataset, stats), None) from a prepared folder made for `key` whose every file verifies;
    (None, None) when there is none for `key`; (None, what is wrong) when it is damaged. Never a traceback:
    what fails to read is a problem to report, and the caller prepares the data again. `trust_remote_code`:
    as the run's config says (a tokenizer whose class is code in its folder). `verify=False`: the folder was
    written a moment ago (by this `save`, or another start's of the same key), so its files are not read twice."""
    import datasets

    stats, problem = _verified_stats(folder, key, check=verify)
    if stats is None:
        return None, problem
    try:
        tokenizer = _read_tokenizer(folder / "tokenizer", trust_remote_code)
        ds = datasets.load_from_disk(str(folder / "dataset"))
    except Exception as e:  # noqa: BLE001 - a damaged folder fails in many ways; it is made again
        return None, f"{folder} cannot be read ({type(e).__name__}: {str(e)[:200]})"
    stats["tokenizer_sha256"] = tokenizer_digest(tokenizer)  # of what was read back, as a resume compares it
    return (tokenizer, ds, stats), None


def load_tokenizer(folder: Path, trust_remote_code: bool = False):
    """(tokenizer, None) from a prepared folder whose tokenizer files verify; (None, None) if there is no
    prepared folder; (None, what is wrong) otherwise. Folders prepared before checksums load unchecked."""
    stats, problem = _verified_stats(folder, None, "tokenizer/")
    if stats is None and problem and problem.endswith("(prepared by an older tunekit)"):
        problem = None
    elif stats is None:
        return None, problem
    try:
        return _read_tokenizer(folder / "tokenizer", trust_remote_code), None
    except Exception as e:  # noqa: BLE001 - a damaged tokenizer fails in many ways
        return None, f"{folder / 'tokenizer'} cannot be read ({type(e).__name__}: {str(e)[:200]})"


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)


def copy_in(source: Path, out: Path) -> None:
    """`source` (a prepared folder in the cache) as `out`, replacing what is there, whole or not at all."""
    with atomic_output(out) as tmp:
        shutil.copytree(source, tmp, copy_function=_link_or_copy)


# ---- the run's record ----------------------------------------------------------------------------------


def read_record(run_dir: Path) -> dict | None:
    """What `run_dir`'s run trained on (its `data.json`), or None for a run from before tunekit recorded it."""
    path = Path(run_dir) / RECORD
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_bytes())
        why = None if isinstance(record, dict) else "not a JSON object"
    except (OSError, ValueError) as e:
        why = f"{type(e).__name__}: {e}"
    if why:
        raise DataError(f"{path} is unreadable ({why}); it records the data and tokenizer {run_dir} trained "
                             "on. Restore it, or delete it to go on without checking them.")
    return record


def commit(run_dir: Path, staged: str | None, stats: dict, resumed: bool) -> None:
    """Once the run has started: the prepared folder it trains on (`staged`, made in the cache) copied into
    `run_dir/prepared`, and its record written, `data.json` (a resume keeps the one it was checked against)."""
    if staged:
        copy_in(Path(staged), Path(run_dir) / "prepared")
    path = Path(run_dir) / RECORD
    if not (resumed and path.exists()):
        atomic_write_json(path, {k: stats.get(k) for k in RECORDED if k in stats})


def check_data(record: dict | None, digest: str, source: str, run_dir: Path) -> None:
    """Before any work on a resume: the data must be what the run started on."""
    if record and record.get("data_sha256") not in (None, digest):
        raise DataError(f"cannot resume {run_dir}: {source} has changed since the run started (its content's "
                             f"sha256 differs from the one in {Path(run_dir) / RECORD}): the resumed run would train "
                             f"on other samples, and a tokenizer trained on them would change too. Restore the file "
                             f"as it was, or {START_OVER}.")


def check_run(record: dict | None, stats: dict, run_dir: Path, tokenizer_source: str) -> None:
    """On a resume: the tokenizer and the prepared samples must be those the run trained on."""
    if not record:
        return
    where = Path(run_dir) / RECORD
    if record.get("tokenizer_sha256") not in (None, stats.get("tokenizer_sha256")):
        raise DataError(f"cannot resume {run_dir}: the tokenizer ({tokenizer_source}) is not the one the run "
                             f"trained with (its digest differs from the one in {where}): the model's token ids "
                             f"would mean other text. Put that tokenizer back, or {START_OVER}.")
    if diffs := [f"{k} {record[k]} -> {stats.get(k)}" for k in COUNTS if k in record and record[k] != stats.get(k)]:
        raise DataError(f"cannot resume {run_dir}: the data prepared now differs from what the run trained "
                             f"on ({', '.join(diffs)}; {where}). Resume with the tunekit version that started "
                             f"the run, or {START_OVER}.")
