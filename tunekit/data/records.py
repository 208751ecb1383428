"""Records: read a file, a `save_to_disk` folder, a named or a hub dataset into a file-backed `datasets.Dataset`,
checked record by record, in a layout tunekit knows.

- **The `datasets` cache** (https://huggingface.co/docs/datasets/about_cache) works only on datasets backed by
  files, so `load_records` writes a JSONL/JSON/text file once as arrow under the cache (keyed by the file's
  bytes) and memory-maps it: later reads, and the tokenization after them, are file lookups. Costs the disk of
  one converted copy.
- **Records are checked before `datasets` sees them** (`_check_values`): every field keeps one JSON type
  across records and nests at most `MAX_NESTING` lists/objects deep, else an error names the line and the
  field. `datasets.Dataset.from_dict` retries a type mismatch level by level, so a deeply nested value that
  disagrees with another record's takes time doubling with each level before it fails (22 levels: 20 s; the
  50 of a 110-byte record: years). Costs one walk over the records in Python.
- **Users' own data** (the README's "Your own data" lists the layouts): `fields` maps a file's fields onto a
  layout (`apply_fields`); `instruction` + `instances` records become one sample per instance.
- **Named datasets** (`NAMED`: `gsm8k`, `gsm8k-test`, `tinyshakespeare`) come from a local copy under
  `shared_data()` when there is one, else from the hub; `source_digest` fingerprints a dataset's content for
  the keys of what is made from it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from tunekit.data.layouts import INSTANCES, DataError, _check_text, _json_type, parse_fields
from tunekit.hub import load_from_hub
from tunekit.io import REPO_ROOT, atomic_output, atomic_write_text, file_sha256
from tunekit.io import cache_dir as cache_root  # `cache_dir` is also an argument name below

# Named datasets: a local copy under `shared_data()` when one is there (tests, GPU runs), else the hub (a user's
# machine).
NAMED = {
    "gsm8k": ("gsm8k/train.jsonl", ("openai/gsm8k", "main", "train")),
    "gsm8k-test": ("gsm8k/test.jsonl", ("openai/gsm8k", "main", "test")),
    "tinyshakespeare": ("tinyshakespeare/input.txt", ("karpathy/tiny_shakespeare", None, "train")),
}


def shared_data() -> Path:
    """Where local copies of public datasets live: $TUNEKIT_DATA_DIR when set (read at each call), else
    ../shared/data beside the checkout."""
    return Path(os.environ.get("TUNEKIT_DATA_DIR", REPO_ROOT.parent / "shared" / "data"))


def local_copy(name: str) -> Path | None:
    """The local copy of the named dataset `name` (`NAMED`), or None when there is none (it comes from the hub)."""
    path = shared_data() / NAMED[name][0]
    return path if path.exists() else None
# The hash of this file goes into every cache key: datasets fingerprints a module-level function by its
# name, not its code, so without it an edited reader or tokenizer would reuse results of the old one.
CODE_VERSION = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
# How deep a field may nest lists and objects: a chat is 2 (a list of {role, content}), a tool call in a chat
# about 6. Deeper is refused before `datasets` sees it (see the module docstring: a mismatch there takes time
# doubling with each level).
MAX_NESTING = 16


# ---- reading ---------------------------------------------------------------------------------------


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, record) for each non-blank line, or a DataError naming the file and line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 (byte {e.start}). Re-encode the file as UTF-8.") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno}). "
                                "Each line must be one JSON object.") from None
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}.")
            yield lineno, rec


def read_jsonl(path: Path) -> list[dict]:
    return [rec for _, rec in iter_jsonl(path)]


def read_json(path: Path) -> list[dict]:
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a valid UTF-8 JSON file ({e}).") from None
    if not isinstance(records, list):
        raise DataError(f"{path}: expected a JSON list of objects.")
    for i, rec in enumerate(records, 1):
        if not isinstance(rec, dict):
            raise DataError(f"{path}: record {i}: expected a JSON object, got {type(rec).__name__}.")
    return records


def read_text(path: Path) -> list[dict]:
    """Plain text: one record per paragraph (blocks separated by a blank line)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 (byte {e.start}). Re-encode the file as UTF-8.") from None
    return [{"text": p.strip()} for p in text.split("\n\n") if p.strip()]


READERS = {".jsonl": read_jsonl, ".json": read_json, ".txt": read_text, ".md": read_text, "": read_text}


def resolve_source(source: str) -> str:
    """A named dataset -> its local copy if present; a relative path -> cwd first, then the repo root."""
    if source in NAMED:
        return str(local_copy(source) or source)
    p = Path(source)
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        return str(REPO_ROOT / p)
    return source


def save_records(records, name: str = "records") -> Path:
    """In-memory records (a list of dicts, or a `datasets.Dataset`) as a JSONL file under the cache, named by its
    content (`<name>-<sha256>.jsonl`): what `tunekit.finetune(cfg, data=records)` trains on, so the prepared-data
    cache and a resume key on the records' content as on any file. A record that is not a JSON object, or holds
    a value JSON cannot write, is a DataError naming its position."""
    if hasattr(records, "to_list") and hasattr(records, "column_names"):  # a datasets.Dataset
        records = records.to_list()
    if isinstance(records, (str, bytes, dict)) or not hasattr(records, "__iter__"):
        raise DataError(f"data: expected a list of records (dicts) or a datasets.Dataset, not {type(records).__name__}"
                        "; a file or a dataset name goes in the config's `data` field")
    lines = []
    for i, rec in enumerate(records, 1):
        if not isinstance(rec, dict):
            raise DataError(f"data: record {i} is {_json_type(rec)}, expected an object (a dict of fields).")
        try:
            lines.append(json.dumps(rec, ensure_ascii=False, allow_nan=False) + "\n")
        except (TypeError, ValueError) as e:
            raise DataError(f"data: record {i}: {e}. Give its fields text, numbers, lists or objects.") from None
    if not lines:
        raise DataError("data: no records.")
    text = "".join(lines)
    path = cache_root() / "records" / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.jsonl"
    if not path.exists():
        atomic_write_text(path, text)
    return path


def load_records(source: str, cache_dir: str | os.PathLike | None = None, fields: str = ""):
    """Read a dataset into a file-backed `datasets.Dataset`: JSONL, JSON, parquet, plain text, a
    `save_to_disk` folder, a named dataset (`gsm8k`, `tinyshakespeare`) or a hub dataset name.

    JSONL/JSON/text files are checked (errors name the line) and converted once to arrow under
    `cache_dir` (default `$TUNEKIT_CACHE/datasets`), keyed by the file's bytes; later calls memory-map it.
    The records come back in a layout tunekit knows: see `apply_fields` (`fields` maps the data's own names).
    A hub name fails within seconds when the hub is offline or unreachable and the cache lacks it."""
    return apply_fields(_read_records(source, cache_dir), fields, source)


def _read_records(source: str, cache_dir: str | os.PathLike | None = None):
    import datasets

    resolved = resolve_source(source)
    path = Path(resolved)
    if source in NAMED and resolved == source:  # no local copy: fetch from the hub
        repo, subset, split = NAMED[source][1]
        return load_from_hub(lambda: datasets.load_dataset(repo, subset, split=split), repo, "dataset")
    if path.is_dir():
        return datasets.load_from_disk(str(path))
    suffix = path.suffix.lower()
    if not path.exists():
        if suffix or source.startswith((".", "/", "~")) or source.count("/") != 1:
            raise DataError(f"data file not found: {source} (looked in {Path.cwd()} and {REPO_ROOT}). "
                            "Pass --data with a JSONL/JSON/parquet/text file or a dataset name.")
        # a hub name like "org/name"
        return load_from_hub(lambda: datasets.load_dataset(source, split="train"), source, "dataset")
    root = Path(cache_dir) if cache_dir else cache_root() / "datasets"
    if suffix == ".parquet":  # datasets' parquet builder keys its arrow copy by path and mtime: a folder per content
        return datasets.Dataset.from_parquet(str(path), cache_dir=str(root / "hf" / _file_digest(path)))
    if suffix not in READERS:
        raise DataError(f"{path}: unknown file type {suffix!r}; use .jsonl, .json, .parquet or .txt.")
    folder = root / f"{path.stem}-{_file_digest(path)}"
    if not (folder / "state.json").exists():
        if suffix == ".jsonl":  # errors name the line
            records, wheres = [], []
            for lineno, rec in iter_jsonl(path):
                records.append(rec)
                wheres.append(f"{path}:{lineno}")
        else:
            records = READERS[suffix](path)
            wheres = [f"{path}: record {i}" for i in range(1, len(records) + 1)]
        if not records:
            raise DataError(f"{path}: no records.")
        _check_values(records, wheres)
        keys = dict.fromkeys(k for rec in records for k in rec)  # every record's fields (from_list: the first's)
        try:
            ds = datasets.Dataset.from_dict({k: [rec.get(k) for rec in records] for k in keys})
        except (TypeError, ValueError) as e:  # pyarrow's ArrowInvalid / ArrowTypeError derive from these
            raise DataError(_disagreement(records, wheres, path, e)) from None
        _save_new(ds, folder)
    return datasets.load_from_disk(str(folder))


def _nesting_over(value, limit: int) -> bool:
    """Whether `value` nests lists/objects more than `limit` deep (stops looking as soon as it does)."""
    stack = [(value, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, (list, dict)):
            if depth > limit:
                return True
            stack.extend((y, depth + 1) for y in (x.values() if isinstance(x, dict) else x))
    return False


def _check_values(records: list[dict], wheres: list[str]) -> None:
    """A DataError naming the record and the field unless every field keeps one JSON type (numbers: one type)
    in every record and nests at most MAX_NESTING deep: checked here in milliseconds, where `datasets` would
    take time doubling with each level of a mismatched nested value."""
    first: dict[str, tuple[str, str]] = {}  # field -> (its type, the record that gave it)
    for rec, where in zip(records, wheres):
        for name, value in rec.items():
            if value is None:
                continue
            if isinstance(value, (list, dict)) and _nesting_over(value, MAX_NESTING):
                raise DataError(f"{where}: field '{name}' nests lists or objects more than {MAX_NESTING} deep. "
                                "Fields are text, chats (lists of {'role', 'content'}) or shallow metadata: "
                                "flatten the field or remove the record.")
            kind = _json_type(value)
            seen = first.setdefault(name, (kind, where))
            if seen[0] != kind:
                raise DataError(f"{where}: field '{name}' is {kind} ({json.dumps(value, default=str)[:40]}), but "
                                f"{seen[0]} in {seen[1]}: records disagree on the type of a field. Give each field "
                                "one type (e.g. always a string) in every record.")


def _disagreement(records: list[dict], wheres: list[str], path: Path, error: Exception) -> str:
    """Which record and field pyarrow could not fit in one type (inside lists or objects: `_check_values` saw
    the same type at the top), for the message of `error`."""
    import pyarrow as pa

    keys = dict.fromkeys(k for rec in records for k in rec)
    for name in keys:
        present = [(rec[name], where) for rec, where in zip(records, wheres) if rec.get(name) is not None]
        for value, where in present[1:]:
            try:
                pa.array([present[0][0], value])
            except (TypeError, ValueError, pa.ArrowException):
                return (f"{where}: field '{name}' holds values of another type than in {present[0][1]} "
                        f"({json.dumps(value, default=str)[:40]}): records disagree on the type of a field "
                        f"({error}). Give each field one type (e.g. always a string) in every record.")
    return (f"{path}: records disagree on the type of a field ({error}). Give each field one type (e.g. always a "
            "string) in every record.")


def source_digest(source: str) -> str:
    """A fingerprint of a dataset's content, for the keys of what is made from it: the sha256 of a file's bytes;
    of a `save_to_disk` folder's files (not the `cache-*` files that `datasets.map` adds beside them); for a
    hub dataset, datasets' own fingerprint of it (it follows the revision in the hub cache).

    Never size and mtime: an edit that keeps both (`cp -p`, `rsync -a`, a same-length change) would reuse what
    was made from the old data. The cost is a read of the data at each call: milliseconds for GSM8K's few MB,
    about a second per GB."""
    resolved = resolve_source(source)
    path = Path(resolved)
    local = not (source in NAMED and resolved == source)
    if local and path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and not f.name.startswith(("cache-", "tmp")))
        h = hashlib.sha256(b"save_to_disk|")
        for f in files:
            h.update(f"{f.relative_to(path)}\0{file_sha256(f)}\0".encode())
        return h.hexdigest()
    if local and path.is_file():
        return file_sha256(path)
    return f"hub:{_read_records(source)._fingerprint}"  # (a missing file: the same error as load_records)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256(f"{CODE_VERSION}|{path.suffix.lower()}|".encode())
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


@contextlib.contextmanager
def progress_bars_off(off: bool = True):
    """`datasets`' progress bars off for the block (`off`), as they were after it: the setting is process-wide."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if off:
        disable_progress_bars()
    try:
        yield
    finally:
        if off and not was_disabled:
            enable_progress_bars()


def _save_new(ds, folder: Path) -> None:
    """save_to_disk atomically; if another process got there first, keep theirs. Without a progress bar: this
    one-off cache copy of a local file takes seconds, and a bar that appears only on a cold cache would make
    the same call print differently from one run to the next (nbval compares a notebook cell that calls it)."""
    with progress_bars_off(), atomic_output(folder, keep_existing=True) as tmp:
        ds.save_to_disk(str(tmp))


# ---- layouts and field mapping -----------------------------------------------------------------------


def apply_fields(ds, fields: str = "", source: str = "dataset"):
    """The records in a layout tunekit knows. `fields` (see `parse_fields`) keeps the mapped fields alone,
    renamed to the layout's names; `instruction` + `instances` records are then expanded into one
    instruction/input/output sample per instance (cached like any `datasets.map`)."""
    try:
        mapping = parse_fields(fields)
    except DataError as e:
        raise DataError(f"fields {fields!r}: {e}") from None
    keys = {"input": "input", "output": "output"}  # inside each instance
    if "instances" in mapping:
        keys.update({k: mapping.pop(k) for k in ("input", "output") if k in mapping})
    if mapping:
        missing = [name for name in mapping.values() if name not in ds.column_names]
        if missing:
            raise DataError(f"{source}: fields {fields!r} names {missing}, which the data does not have "
                            f"(it has {sorted(ds.column_names)}).")
        ds = ds.select_columns(list(mapping.values()))
        ds = ds.rename_columns({name: target for target, name in mapping.items() if name != target})
    if all(c in ds.column_names for c in INSTANCES):
        ds = ds.map(_expand_instances, batched=True, with_indices=True, remove_columns=ds.column_names,
                    desc="instances", fn_kwargs={"source": source, "input_key": keys["input"],
                                                     "output_key": keys["output"], "code_version": CODE_VERSION})
    return ds


def _expand_instances(batch: dict, indices: list[int], source: str, input_key: str, output_key: str,
                      code_version: str) -> dict:
    """One instruction/input/output sample per instance; errors name the record and the instance."""
    out = {"instruction": [], "input": [], "output": []}
    for row, instruction, instances in zip(indices, batch["instruction"], batch["instances"]):
        where = f"{source}: record {row + 1}"
        _check_text(instruction, "instruction", where)
        if not isinstance(instances, list) or not instances:
            raise DataError(f"{where}: 'instances' must be a non-empty list of {{'{input_key}', '{output_key}'}} "
                            "objects. Fill or remove the record.")
        for j, inst in enumerate(instances, 1):
            at = f"{where}: instance {j}"
            if not isinstance(inst, dict):
                raise DataError(f"{at} is {_json_type(inst)}, expected an object with '{input_key}' and "
                                f"'{output_key}'.")
            _check_text(inst.get(output_key), output_key, at, inst)
            extra = inst.get(input_key)
            if extra is not None and not isinstance(extra, str):
                raise DataError(f"{at}: '{input_key}' is {_json_type(extra)}, expected text (or no field at all).")
            out["instruction"].append(instruction)
            out["input"].append(extra or "")
            out["output"].append(inst[output_key])
    return out


# ---- formatting ------------------------------------------------------------------------------------


# ---- tokenization ----------------------------------------------------------------------------------


# ---- what the model will see -------------------------------------------------------------------------


# ---- saving and loading tokenized data ----------------------------------------------------------------
