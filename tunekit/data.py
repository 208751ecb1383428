"""Data: read records, format prompt -> response (or a chat), tokenize offline with a cache, save.

Each technique, with what it saves and what it costs:

- **Offline tokenization** with `datasets.map(batched=True, num_proc=N)`
  (https://huggingface.co/docs/datasets/process#map): tokenize once before training, so the loop only
  indexes integers. Saves the tokenizer's time on every step of every epoch; costs one pass up front and the
  disk for the result. Labels copy the input ids with the prompt masked to -100, so the loss is taken on
  the response alone (for chats: on the assistant turns alone).
- **The `datasets` cache** (https://huggingface.co/docs/datasets/about_cache): `map` names its output file
  after a fingerprint of its input dataset, the function and its arguments (tokenizer, `max_length`), so the
  same call on the same data is a file lookup and any change recomputes. It works only on datasets backed by
  files, so `load_records` writes a JSONL/JSON/text file once as arrow under the cache (keyed by the file's
  bytes) and memory-maps it. Costs the disk of one converted copy plus each tokenized variant.
- **Records are checked before `datasets` sees them** (`_check_values`): every field keeps one JSON type
  across records and nests at most `MAX_NESTING` lists/objects deep, else an error names the line and the
  field. `datasets.Dataset.from_dict` retries a type mismatch level by level, so a deeply nested value that
  disagrees with another record's takes time doubling with each level before it fails (22 levels: 20 s; the
  50 of a 110-byte record: years). Costs one walk over the records in Python.
- **Parquet or `save_to_disk`** for the tokenized result: parquet is compressed and portable; `save_to_disk`
  is arrow, memory-mapped when loaded, so opening it is instant.
- **Memory-mapped vs in RAM** (`load_tokenized(path, in_memory)`): memory-mapped costs no load time and no
  RAM of its own (pages come from the OS page cache on first touch, from disk if they are not there);
  `in_memory=True` reads it all into the process first: load time and RAM, for reads that never touch disk.

Users' own data (the README's "Your own data" lists the layouts): `fields` maps a file's fields onto a layout
(`apply_fields`); `instruction` + `instances` records become one sample per instance; single-text records train
only after a `response_template` marker (TRL's completion-only collator, matched on the text rather than on token
ids); chats render through a chosen `chat_template`. Samples that truncation leaves without a target token are
dropped and counted, and a dataset left with none is an error. `preview` shows one sample with its masked part.

Batches (padding, length grouping, packing, the DataLoader and its knobs) are `tunekit/batching.py`; its
public names are importable from here too (`data.Collator`, `data.build_dataloader`, `data.pack_dataset`, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tunekit.batching import (  # noqa: F401  (re-exported: data.Collator etc. keep working)
    IGNORE,
    Collator,
    EpochSampler,
    LengthGroupedSampler,
    build_dataloader,
    default_num_workers,
    lengths_of,
    pack_dataset,
    padding_stats,
    plan_packing,
)
from tunekit.checkpoint import atomic_output, file_sha256
from tunekit.config import REPO_ROOT
from tunekit.config import cache_dir as cache_root  # `cache_dir` is also an argument name below

# Where local copies of public datasets live: ../shared/data beside the repo, or $TUNEKIT_DATA_DIR.
SHARED_DATA = Path(os.environ.get("TUNEKIT_DATA_DIR", REPO_ROOT.parent / "shared" / "data"))
# Named datasets: a local copy when one is there (tests, GPU runs), else the hub (a user's machine).
NAMED = {
    "gsm8k": (SHARED_DATA / "gsm8k" / "train.jsonl", ("openai/gsm8k", "main", "train")),
    "gsm8k-test": (SHARED_DATA / "gsm8k" / "test.jsonl", ("openai/gsm8k", "main", "test")),
    "tinyshakespeare": (SHARED_DATA / "tinyshakespeare" / "input.txt", ("karpathy/tiny_shakespeare", None, "train")),
}
# Field layouts we recognise, tried in order: (prompt fields, response field). `messages` is a chat.
LAYOUTS = [(("question",), "answer"), (("prompt",), "response"), (("instruction", "input"), "output"),
           (("prompt",), "completion"), ((), "messages"), ((), "text")]
# `instruction` + `instances` (a list of {input, output} objects, as Self-Instruct and Super-NaturalInstructions
# store tasks) is expanded by `load_records` into one instruction/input/output sample per instance.
INSTANCES = ("instruction", "instances")
# What `fields` may map onto: (the fields a layout needs, the ones it may have). For `instances`, `input` and
# `output` name the keys inside each instance.
WHOLE_LAYOUTS = [(frozenset(p[:1]) | {r}, frozenset(p[1:])) for p, r in LAYOUTS] + [
    (frozenset(INSTANCES), frozenset({"input", "output"}))]
FIELD_NAMES = sorted(set().union(*(need | may for need, may in WHOLE_LAYOUTS)))
CHAT_ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}  # {"from", "value"} turns
# How chats are rendered: the tokenizer's template when it has one (auto), tunekit's `<|role|>` one (builtin),
# the tokenizer's or an error (tokenizer), ChatML (for base models without a template), or a Jinja template
# (given as a file or as the text itself).
CHAT_TEMPLATES = ("auto", "builtin", "tokenizer", "chatml")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The hash of this file goes into every cache key: datasets fingerprints a module-level function by its
# name, not its code, so without it an edited reader or tokenizer would reuse results of the old one.
CODE_VERSION = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
# How deep a field may nest lists and objects: a chat is 2 (a list of {role, content}), a tool call in a chat
# about 6. Deeper is refused before `datasets` sees it (see the module docstring: a mismatch there takes time
# doubling with each level).
MAX_NESTING = 16


class DataError(ValueError):
    """Bad input data; the message names the file, line or field, and what to do."""


class ChatTemplateError(DataError):
    """The chat template failed to render a conversation (a Jinja error, the sandbox's SecurityError)."""


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
        local, _ = NAMED[source]
        return str(local) if local.exists() else source
    p = Path(source)
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        return str(REPO_ROOT / p)
    return source


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

    from tunekit.model import load_from_hub

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


def _save_new(ds, folder: Path) -> None:
    """save_to_disk atomically; if another process got there first, keep theirs. Without a progress bar: this
    one-off cache copy of a local file takes seconds, and a bar that appears only on a cold cache would make
    the same call print differently from one run to the next (nbval compares a notebook cell that calls it)."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        with atomic_output(folder, keep_existing=True) as tmp:
            ds.save_to_disk(str(tmp))
    finally:
        if not was_disabled:
            enable_progress_bars()


# ---- layouts and field mapping -----------------------------------------------------------------------


def parse_fields(spec: str) -> dict[str, str]:
    """`fields` text -> {layout field: the data's field}. `'prompt=question,response=answer'` means: the data's
    `question` is the layout's `prompt`, its `answer` the `response`. The names must make one whole layout
    (`WHOLE_LAYOUTS`); a DataError says what is wrong otherwise."""
    mapping: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        target, eq, name = (x.strip() for x in part.partition("="))
        if not (eq and target and name):
            raise DataError(f"{part!r} is not LAYOUT_FIELD=YOUR_FIELD (e.g. prompt=question,response=answer)")
        if target not in FIELD_NAMES:
            raise DataError(f"{target!r} is not a layout field; the layout fields are {', '.join(FIELD_NAMES)}")
        if target in mapping or name in mapping.values():
            raise DataError(f"{part!r}: each layout field and each of your fields may appear once")
        mapping[target] = name
    if mapping and not any(need <= set(mapping) <= need | may for need, may in WHOLE_LAYOUTS):
        layouts = "; ".join("+".join(sorted(need)) + "".join(f" [+{m}]" for m in sorted(may))
                            for need, may in WHOLE_LAYOUTS)
        raise DataError(f"{'+'.join(mapping)} is not one whole layout; map every field of one of: {layouts}")
    return mapping


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


def detect_layout(columns: list[str], where: str = "dataset") -> tuple[tuple[str, ...], str]:
    for prompt_fields, response in LAYOUTS:
        if response in columns and all(f in columns for f in prompt_fields[:1]):
            return prompt_fields, response
    known = "; ".join("/".join(p + (r,)) for p, r in LAYOUTS) + "; " + "/".join(INSTANCES)
    raise DataError(f"{where}: has fields {sorted(columns)}, none of the known layouts ({known}). "
                    "Map your fields onto one with --fields LAYOUT_FIELD=YOUR_FIELD,... (e.g. "
                    "--fields prompt=q,response=a; the README's 'Your own data' lists the layouts), "
                    "or rename them in the file.")


def format_prompt(rec: dict, prompt_fields: tuple[str, ...]) -> str:
    if not prompt_fields:
        return ""
    if prompt_fields == ("question",):
        return f"Question: {rec['question'].strip()}\nAnswer: "
    if prompt_fields == ("instruction", "input"):
        extra = (rec.get("input") or "").strip()
        return f"{rec['instruction'].strip()}\n{extra}\n\n" if extra else f"{rec['instruction'].strip()}\n\n"
    return rec[prompt_fields[0]]


def record_text(rec: dict, prompt_fields: tuple[str, ...], response_field: str) -> str:
    """All the text of one record (prompt and response, or every chat turn): what a tokenizer trains on."""
    if response_field == "messages":
        return "\n".join(m.get("content") or "" for m in rec.get("messages") or [] if isinstance(m, dict))
    fields = (*prompt_fields[:1], response_field)
    if not all(isinstance(rec.get(f), str) for f in fields):
        return ""
    return format_prompt(rec, prompt_fields) + rec[response_field]


def _json_type(value) -> str:
    """A value's type as the file spells it: 'a number', 'a list', ..."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {list: "a list", tuple: "a list", dict: "an object", str: "text"}.get(type(value), type(value).__name__)


def _check_text(value, name: str, where: str, rec: dict | None = None) -> None:
    """A DataError unless `value` is non-blank text: missing, of another type (said, with the type wanted) or
    blank."""
    if value is None:
        have = f" (it has {sorted(k for k, v in rec.items() if v is not None)})" if rec is not None else ""
        raise DataError(f"{where}: missing field '{name}'{have}. Fix or remove the record.")
    if not isinstance(value, str):
        example = f" such as {json.dumps(str(value))}" if isinstance(value, (int, float)) else ""
        raise DataError(f"{where}: '{name}' is {_json_type(value)} ({json.dumps(value, default=str)[:60]}), "
                        f"expected text (a JSON string{example}). Convert the field to text or remove the record.")
    if not value.strip():
        raise DataError(f"{where}: empty '{name}'. Fill or remove the record.")


def _check_fields(rec: dict, fields: tuple[str, ...], where: str) -> None:
    for name in fields:
        _check_text(rec.get(name), name, where, rec)


def _check_messages(messages, where: str) -> list[dict]:
    """The turns as plain {role, content} dicts, or a DataError naming the record and the turn. ShareGPT's
    {from, value} turns (from: human, gpt, system) are read as {role, content}."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects.")
    turns = []
    for j, m in enumerate(messages, 1):
        if isinstance(m, dict) and m.get("role") is None and m.get("from") is not None:
            m = {"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m.get("value")}
        role = m.get("role") if isinstance(m, dict) else None
        if role not in CHAT_ROLES:
            raise DataError(f"{where}: message {j} has role {role!r}; allowed roles are {', '.join(CHAT_ROLES)}. "
                            "Rename the role (e.g. 'human' -> 'user', 'gpt' -> 'assistant') or drop the message.")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise DataError(f"{where}: message {j} ({role}): 'content' is {_json_type(content)}, expected text. "
                            "Convert it to text or remove the message.")
        if content is None or (role != "system" and not content.strip()):
            raise DataError(f"{where}: message {j} ({role}) has an empty or non-text 'content'. "
                            "Fill or remove the message.")
        turns.append({"role": role, "content": content})
    if not any(t["role"] == "assistant" for t in turns):
        raise DataError(f"{where}: no assistant message, so nothing to train on. Add one or remove the record.")
    return turns


def split_at_markers(text: str, response_template: str,
                     instruction_template: str = "") -> list[tuple[str, bool]] | None:
    """(piece, trained) pieces of one single-text record, or None when `response_template` is not in it.

    As TRL's completion-only collator: without `instruction_template`, what follows the last response marker
    trains; with it, each span from a response marker to the next instruction marker. The markers themselves
    are masked. Matching the text, not token ids, finds a marker whatever tokens its neighbours make of it."""
    ends = [m.end() for m in re.finditer(re.escape(response_template), text)]
    if not ends:
        return None
    if not instruction_template:
        return [(text[:ends[-1]], False), (text[ends[-1]:], True)]
    starts = [m.start() for m in re.finditer(re.escape(instruction_template), text)]
    pieces, pos = [], 0
    for end in ends:
        if end - len(response_template) < pos:  # a marker inside the span already trained
            continue
        stop = next((s for s in starts if s >= end), len(text))
        pieces += [(text[pos:end], False), (text[end:stop], True)]
        pos = stop
    return pieces + [(text[pos:], False)] if pos < len(text) else pieces  # EOS trains after a trained end


def read_chat_template(spec: str) -> str:
    """`chat_template` as text: a named choice or a Jinja template as it is, a file by its contents."""
    if spec in CHAT_TEMPLATES or "{{" in spec or "{%" in spec:
        return spec
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DataError(f"chat_template {spec!r}: no such file. Use {', '.join(CHAT_TEMPLATES)}, a Jinja "
                        "template file or the template's text.")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"chat_template {spec}: not UTF-8 (byte {e.start}). Re-encode the file as UTF-8.") from None


def resolve_chat_template(spec: str, tokenizer):
    """The Jinja template that renders chats (a string, or the tokenizer's own), or None for the built-in."""
    spec, own = read_chat_template(spec), getattr(tokenizer, "chat_template", None) or None
    if spec == "tokenizer" and not own:
        raise DataError("chat_template 'tokenizer': this tokenizer has no chat template. Use auto or builtin "
                        "(tunekit's <|role|> template), chatml, or a Jinja template file.")
    return {"auto": own, "tokenizer": own, "builtin": None, "chatml": CHATML}.get(spec, spec)


# ---- tokenization ----------------------------------------------------------------------------------


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def encode_chat(messages, tokenizer, where: str = "chat", chat_template: str = "auto") -> tuple[list[int], list[int]]:
    """(input ids, labels) of one conversation; labels keep the assistant turns alone.

    With a Jinja template (`chat_template`, see `resolve_chat_template`; by default the tokenizer's own), the
    template renders the conversation; each assistant turn is found as the text that rendering up to and
    including it adds to the rendering before it (with the generation prompt). Without one, a built-in
    template: `<|role|>\\n` + content + `\\n`, assistant turns ending in EOS."""
    turns = _check_messages(messages, where)
    template = resolve_chat_template(chat_template, tokenizer)
    if template:
        from jinja2 import TemplateError  # the base of the sandbox's SecurityError too

        def render(msgs, generation_prompt=False) -> str:
            try:
                return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt,
                                                     chat_template=template if isinstance(template, str) else None)
            except TemplateError as e:
                raise ChatTemplateError(f"{where}: the chat template failed on this conversation "
                                        f"({type(e).__name__}: {e}). Fix the template, or choose another "
                                        f"--chat-template ({', '.join(CHAT_TEMPLATES)}).") from None

        text, cuts, trained = render(turns), [0], []
        for i, t in enumerate(turns):
            if t["role"] == "assistant":
                start, end = render(turns[:i], True) if i else "", render(turns[: i + 1])
                if not (text.startswith(end) and end.startswith(start) and len(start) >= cuts[-1]):
                    raise DataError(f"{where}: the tokenizer's chat template renders this conversation "
                                    f"differently turn by turn, so message {i + 1} (assistant) cannot be located. "
                                    "Set tokenizer.chat_template to a template that renders prefixes "
                                    "consistently, or to None for the built-in one.")
                cuts += [len(start), len(end)]
                trained += [False, True]
        pieces = [text[a:b] for a, b in zip(cuts, cuts[1:] + [len(text)])]
        trained.append(False)
        ids, labels = [], []
        for is_trained, enc in zip(trained, _encode(tokenizer, pieces)):
            ids += enc
            labels += enc if is_trained else [IGNORE] * len(enc)
        return ids, labels
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    ids, labels = list(bos), [IGNORE] * len(bos)
    for t in turns:
        head, body, newline = _encode(tokenizer, [f"<|{t['role']}|>\n", t["content"], "\n"])
        tail = [tokenizer.eos_token_id] if t["role"] == "assistant" else newline
        ids += head + body + tail
        labels += [IGNORE] * len(head) + (body + tail if t["role"] == "assistant" else [IGNORE] * len(body + tail))
    return ids, labels


def tokenize_batch(batch: dict, tokenizer, max_length: int, prompt_fields, response_field,
                   source: str = "dataset", rows: list[int] | None = None, response_template: str = "",
                   instruction_template: str = "", chat_template: str = "auto") -> dict:
    """Encode a batch of records: BOS + prompt + response + EOS, labels = ids with the prompt masked; chats
    through `encode_chat`; single texts with a `response_template` masked up to it (`split_at_markers`).
    Samples longer than `max_length` are cut to it and flagged `truncated`; `targets` counts the labels the
    loss takes (all but the first position's: nothing predicts it).

    Errors name `source` and the record's 1-based position (`rows`: 0-based positions of the batch's records;
    a record's position is its line in a JSONL file without blank lines)."""
    n = len(batch[response_field])
    records = [{k: batch[k][i] for k in batch} for i in range(n)]
    rows = rows if rows is not None else range(n)
    wheres = [f"{source}: record {r + 1}" for r in rows]
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    eos = [tokenizer.eos_token_id]
    if response_field == "messages":
        pairs = [encode_chat(rec["messages"], tokenizer, where, chat_template) for rec, where in zip(records, wheres)]
    elif response_template:
        splits = []
        for rec, where in zip(records, wheres):
            _check_fields(rec, (response_field,), where)
            pieces = split_at_markers(rec[response_field], response_template, instruction_template)
            if pieces is None:
                raise DataError(f"{where}: no response marker {response_template!r} in its text (it begins "
                                f"{rec[response_field][:60]!r}). Fix or remove the record, or check "
                                "--response-template: the marker must appear exactly, spaces and case included.")
            splits.append(pieces)
        encoded = iter(_encode(tokenizer, [text for pieces in splits for text, _ in pieces]))  # one call per batch
        pairs = []
        for pieces in splits:
            ids, labels = list(bos), [IGNORE] * len(bos)
            for (_, trained), enc in zip(pieces, encoded):
                ids += enc
                labels += enc if trained else [IGNORE] * len(enc)
            pairs.append((ids + eos, labels + (eos if pieces[-1][1] else [IGNORE])))
    else:
        for rec, where in zip(records, wheres):
            _check_fields(rec, (*prompt_fields[:1], response_field), where)
        # One tokenizer call per field for the whole batch: the fast tokenizer encodes a list in parallel.
        prompts = _encode(tokenizer, [format_prompt(r, prompt_fields) for r in records]) if prompt_fields \
            else [[]] * n
        responses = _encode(tokenizer, [r[response_field] for r in records])
        pairs = [(bos + p + r + eos, [IGNORE] * (len(bos) + len(p)) + r + eos) for p, r in zip(prompts, responses)]
    out = {"input_ids": [], "labels": [], "length": [], "truncated": [], "targets": []}
    for ids, labels in pairs:
        out["input_ids"].append(ids[:max_length])
        out["labels"].append(labels[:max_length])
        out["length"].append(min(len(ids), max_length))
        out["truncated"].append(len(ids) > max_length)
        kept = labels[1:max_length]
        out["targets"].append(len(kept) - kept.count(IGNORE))  # list.count: C speed, no loop over tokens here
    return out


def _tokenize_rows(batch: dict, indices: list[int], code_version: str, **kwargs) -> dict:
    return tokenize_batch(batch, rows=indices, **kwargs)  # code_version is there for the fingerprint alone


def tokenize_dataset(ds, tokenizer, max_length: int, num_proc: int | None = None, source: str = "dataset",
                     use_cache: bool = True, *, response_template: str = "", instruction_template: str = "",
                     chat_template: str = "auto"):
    """Offline tokenization with `datasets.map(batched=True, num_proc=N)`. Returns (dataset, stats).

    On a file-backed dataset (what `load_records` returns) the result is cached beside it, named by datasets'
    fingerprint of (data, function, tokenizer, max_length, templates): an unchanged call reads it back
    (`stats["cached"]`), `use_cache=False` recomputes. A bad record raises a DataError and leaves no cache file
    behind. Samples that truncation leaves without a target token are dropped (`stats["no_targets"]`); if
    none keeps one, there is nothing to train on: a DataError. `response_template` (with its optional
    `instruction_template`) applies to single-text records, `chat_template` to chats."""
    prompt_fields, response_field = detect_layout(ds.column_names, source)
    layout = "/".join(prompt_fields[:1] + (response_field,))
    if response_template and response_field != "text":
        raise DataError(f"{source}: --response-template applies to single-text records (a 'text' field), but this "
                        f"data has the {layout} layout, whose prompt is masked already. Drop --response-template.")
    if instruction_template and not response_template:
        raise DataError(f"{source}: --instruction-template needs --response-template (the marker that starts "
                        "each trained span).")
    named = chat_template  # a file's name, for errors
    chat_template = read_chat_template(chat_template)  # a file's contents: they go into the fingerprint
    if chat_template != "auto" and response_field != "messages":
        raise DataError(f"{source}: --chat-template applies to chats (a 'messages' field), but this data has the "
                        f"{layout} layout. Drop --chat-template, or map a list of turns with --fields messages=...")
    if response_field == "messages":
        resolve_chat_template(chat_template, tokenizer)  # fails here, not once per record
    options = {"response_template": response_template, "instruction_template": instruction_template,
               "chat_template": chat_template}
    folders = {Path(f["filename"]).parent for f in ds.cache_files}
    before = {p: p.stat().st_mtime_ns for d in folders for p in d.iterdir()}
    try:
        tok = ds.map(_tokenize_rows, batched=True, with_indices=True, remove_columns=ds.column_names,
                     num_proc=num_proc if num_proc and num_proc > 1 else None, load_from_cache_file=use_cache,
                     desc="tokenize", fn_kwargs={"tokenizer": tokenizer, "max_length": max_length,
                                                 "prompt_fields": prompt_fields, "response_field": response_field,
                                                 "source": source, "code_version": CODE_VERSION, **options})
    except BaseException as e:
        # With num_proc, the shards that finished have written their files: remove them, and any temp file.
        for p in {p for d in folders for p in d.iterdir()} - before.keys():
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        if isinstance(e, ChatTemplateError) and named != chat_template:  # the template came from a file
            raise ChatTemplateError(str(e).replace("the chat template", f"the chat template {named}", 1)) from None
        raise
    # Read back, not written: every file of the result was there before, untouched.
    outputs = [Path(f["filename"]) for f in tok.cache_files]
    cached = bool(outputs) and all(before.get(p) == p.stat().st_mtime_ns for p in outputs)
    columns = tok.with_format("arrow")
    truncated = int(columns["truncated"].to_numpy().sum())
    targets = columns["targets"].to_numpy()
    keep = targets > 0
    if not keep.any():
        raise DataError(_nothing_to_train(ds, tokenizer, max_length, source, prompt_fields, response_field, options))
    if not keep.all():  # truncation cut every target away: a sample that would train nothing, yet cost a slot
        tok = tok.select(np.flatnonzero(keep))
    tok = tok.remove_columns(["truncated", "targets"])
    stats = {"samples": len(tok), "tokens": int(lengths_of(tok).sum()), "target_tokens": int(targets.sum()),
             "truncated": truncated, "no_targets": int((~keep).sum()), "max_length": max_length, "cached": cached}
    return tok, stats


def _nothing_to_train(ds, tokenizer, max_length: int, source: str, prompt_fields, response_field, options) -> str:
    """Why no sample keeps a target: where the responses of the first samples start, untruncated."""
    if not len(ds):
        return f"{source}: no records."
    head = ds.select(range(min(len(ds), 100)))[:]
    out = tokenize_batch(head, tokenizer, 10**9, prompt_fields, response_field, source, **options)
    starts = sorted(next((i for i, t in enumerate(labels) if i and t != IGNORE), len(labels))
                    for labels in out["labels"])
    return (f"{source}: no sample keeps a target token within max_length={max_length}: truncation cut every "
            f"response away, so there is nothing to train on. In the first {len(starts)} samples the response "
            f"starts at token {starts[0]} to {starts[-1]} (median {starts[len(starts) // 2]}); raise --max-length "
            "well above that.")


def iter_jsonl_tokenized(path: str | os.PathLike, tokenizer, max_length: int) -> Iterator[dict]:
    """Re-read and re-tokenize a JSONL file one record at a time: tokenizing inside the training loop, the
    baseline that offline tokenization is measured against. Yields {input_ids, labels} like the dataset rows."""
    path, layout = Path(path), None
    for lineno, rec in iter_jsonl(path):
        layout = layout or detect_layout(list(rec), f"{path}:{lineno}")
        out = tokenize_batch({k: [v] for k, v in rec.items()}, tokenizer, max_length, *layout,
                             source=str(path), rows=[lineno - 1])
        yield {"input_ids": out["input_ids"][0], "labels": out["labels"][0]}


# ---- what the model will see -------------------------------------------------------------------------


def count_target_tokens(ds) -> tuple[int, int]:
    """(target tokens, tokens) of a tokenized or packed dataset, counted as the loss counts them: every
    label that is not ignored, but for each row's first (nothing predicts it)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    labels = ds.with_format("arrow")["labels"]
    labels = labels.combine_chunks() if isinstance(labels, pa.ChunkedArray) else labels
    lengths = pc.list_value_length(labels).to_numpy(zero_copy_only=False)
    trained = labels.flatten().to_numpy(zero_copy_only=False) != IGNORE
    firsts = (np.cumsum(lengths) - lengths)[lengths > 0]
    return int(trained.sum() - trained[firsts].sum()), int(lengths.sum())


def preview(ds, tokenizer, stats: dict | None = None, index: int = 0, marks: tuple[str, str] = ("⟦", "⟧"),
            span_chars: int = 600) -> str:
    """Sample `index` as the model sees it, the text the loss skips (masked) between `marks`; the fraction of
    tokens that are targets; and, from `tokenize_dataset`'s `stats`, the samples dropped for keeping no
    target. What training prints before its first step, so a wrong mask shows before it costs a run.

    In a packed row, its first sample. Spans longer than `span_chars` are shown by their two ends."""
    row = ds[index]
    ids, labels = row["input_ids"], row["labels"]
    if "position_ids" in row:  # a packed row: cut at the next sample's position 0
        ids = ids[:next((i for i, p in enumerate(row["position_ids"]) if i and p == 0), len(ids))]
    trained = [bool(i) and t != IGNORE for i, t in enumerate(labels[:len(ids)])]
    shown, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or trained[i] != trained[start]:
            text = tokenizer.decode(ids[start:i])
            if len(text) > span_chars:
                half = span_chars // 2
                text = f"{text[:half]} [... {len(text) - 2 * half:,} characters ...] {text[-half:]}"
            shown.append(text if trained[start] else f"{marks[0]}{text}{marks[1]}")
            start = i
    stats = stats or {}
    lines = [f"data: sample {index} as the model sees it; the loss skips the text in {marks[0]} {marks[1]}:",
             "".join(shown)]
    if isinstance(ds, InLoopTokenized):  # counting would tokenize everything, which this mode puts off
        lines.append("data: tokenized in the loop, batch by batch: no totals before training")
    else:
        if stats.get("target_tokens") is not None and stats.get("tokens"):
            targets, tokens = stats["target_tokens"], stats["tokens"]
        else:
            targets, tokens = count_target_tokens(ds)
        lines.append(f"data: {targets:,} of {tokens:,} tokens are targets ({targets / max(tokens, 1):.1%}), the "
                     "rest masked")
    if all(trained[1:]):
        lines.append("data: nothing in this sample is masked, so the model trains on all of it; to train on answers "
                     "alone, map a prompt with --fields or set --response-template (see the README, 'Your own data')")
    if stats.get("no_targets"):
        lines.append(f"data: {stats['no_targets']:,} samples kept no target token after truncation to "
                     f"{stats.get('max_length')} tokens: dropped ({stats.get('samples', len(ds)):,} remain)")
    return "\n".join(lines)


class InLoopTokenized:
    """Raw records that tokenize on access: tokenization happens wherever the DataLoader fetches — in the
    training process (num_workers=0) or in its worker processes. The article's "before": lesson 1 measures
    what it costs (claim C1); `tunekit train --tokenize in_loop` trains this way. A map-style dataset, as the
    DataLoader takes it."""

    def __init__(self, records, tokenizer, max_length: int, source: str = "dataset", response_template: str = "",
                 instruction_template: str = "", chat_template: str = "auto"):
        self.records, self.tokenizer, self.max_length = records, tokenizer, max_length
        self.layout = detect_layout(records.column_names, source)
        self.source = source
        self.options = {"response_template": response_template, "instruction_template": instruction_template,
                        "chat_template": chat_template}

    column_names = ("input_ids", "labels")

    def __len__(self) -> int:
        return len(self.records)

    def select(self, indices) -> InLoopTokenized:
        """These records only (as `datasets.Dataset.select`), still tokenized on access."""
        out = InLoopTokenized.__new__(InLoopTokenized)
        out.__dict__.update(self.__dict__, records=self.records.select(indices))
        return out

    def with_format(self, columns=None) -> InLoopTokenized:
        return self  # (already lists of the two columns)

    def __getitem__(self, i: int) -> dict:
        rec = self.records[i]
        batch = {k: [v] for k, v in rec.items()}
        out = tokenize_batch(batch, self.tokenizer, self.max_length, *self.layout, source=self.source, rows=[i],
                             **self.options)
        return {"input_ids": out["input_ids"][0], "labels": out["labels"][0]}


# ---- saving and loading tokenized data ----------------------------------------------------------------


def save_dataset(ds, path: str | os.PathLike) -> Path:
    """`save_to_disk` into a temp folder, then rename: a half-written dataset never looks finished."""
    with atomic_output(path) as tmp:
        ds.save_to_disk(str(tmp))
    return Path(path)


def save_parquet(ds, path: str | os.PathLike) -> Path:
    """One compressed parquet file, written to a temp name and renamed."""
    with atomic_output(path) as tmp:
        ds.to_parquet(str(tmp))
    return Path(path)


def load_tokenized(path: str | os.PathLike, in_memory: bool = False):
    """A tokenized dataset from a `save_to_disk` folder or a parquet file, memory-mapped or (`in_memory`)
    read whole into RAM."""
    import datasets

    path = Path(path)
    if path.suffix == ".parquet":
        return datasets.Dataset.from_parquet(str(path), keep_in_memory=in_memory,  # (keyed by content: see above)
                                             cache_dir=str(cache_root() / "datasets" / "hf" / _file_digest(path)))
    return datasets.load_from_disk(str(path), keep_in_memory=in_memory)
