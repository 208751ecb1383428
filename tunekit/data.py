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
- **Parquet or `save_to_disk`** for the tokenized result: parquet is compressed and portable; `save_to_disk`
  is arrow, memory-mapped when loaded, so opening it is instant.
- **Memory-mapped vs in RAM** (`load_tokenized(path, in_memory)`): memory-mapped costs no load time and no
  RAM of its own (pages come from the OS page cache on first touch, from disk if they are not there);
  `in_memory=True` reads it all into the process first: load time and RAM, for reads that never touch disk.

Batches (padding, length grouping, packing, the DataLoader and its knobs) are `tunekit/batching.py`; its
public names are importable from here too (`data.Collator`, `data.build_dataloader`, `data.pack_dataset`, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

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
from tunekit.checkpoint import atomic_output
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
CHAT_ROLES = ("system", "user", "assistant")
# The hash of this file goes into every cache key: datasets fingerprints a module-level function by its
# name, not its code, so without it an edited reader or tokenizer would reuse results of the old one.
CODE_VERSION = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


class DataError(ValueError):
    """Bad input data; the message names the file, line or field, and what to do."""


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


def load_records(source: str, cache_dir: str | os.PathLike | None = None):
    """Read a dataset into a file-backed `datasets.Dataset`: JSONL, JSON, parquet, plain text, a
    `save_to_disk` folder, a named dataset (`gsm8k`, `tinyshakespeare`) or a hub dataset name.

    JSONL/JSON/text files are checked (errors name the line) and converted once to arrow under
    `cache_dir` (default `$TUNEKIT_CACHE/datasets`), keyed by the file's bytes; later calls memory-map it."""
    import datasets

    resolved = resolve_source(source)
    path = Path(resolved)
    if source in NAMED and resolved == source:  # no local copy: fetch from the hub
        repo, subset, split = NAMED[source][1]
        return datasets.load_dataset(repo, subset, split=split)
    if path.is_dir():
        return datasets.load_from_disk(str(path))
    suffix = path.suffix.lower()
    if not path.exists():
        if suffix or source.startswith((".", "/", "~")) or source.count("/") != 1:
            raise DataError(f"data file not found: {source} (looked in {Path.cwd()} and {REPO_ROOT}). "
                            "Pass --data with a JSONL/JSON/parquet/text file or a dataset name.")
        return datasets.load_dataset(source, split="train")  # a hub name like "org/name"
    root = Path(cache_dir) if cache_dir else cache_root() / "datasets"
    if suffix == ".parquet":  # datasets' own parquet builder caches its arrow copy by path and mtime
        return datasets.Dataset.from_parquet(str(path), cache_dir=str(root / "hf"))
    if suffix not in READERS:
        raise DataError(f"{path}: unknown file type {suffix!r}; use .jsonl, .json, .parquet or .txt.")
    folder = root / f"{path.stem}-{_file_digest(path)}"
    if not (folder / "state.json").exists():
        records = READERS[suffix](path)
        if not records:
            raise DataError(f"{path}: no records.")
        keys = dict.fromkeys(k for rec in records for k in rec)  # every record's fields (from_list: the first's)
        try:
            ds = datasets.Dataset.from_dict({k: [rec.get(k) for rec in records] for k in keys})
        except (TypeError, ValueError) as e:  # pyarrow's ArrowInvalid / ArrowTypeError derive from these
            raise DataError(f"{path}: records disagree on the type of a field ({e}). "
                            "Give each field one type (e.g. always a string) in every record.") from None
        _save_new(ds, folder)
    return datasets.load_from_disk(str(folder))


def _file_digest(path: Path) -> str:
    h = hashlib.sha256(f"{CODE_VERSION}|{path.suffix.lower()}|".encode())
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _save_new(ds, folder: Path) -> None:
    """save_to_disk atomically; if another process got there first, keep theirs."""
    with atomic_output(folder, keep_existing=True) as tmp:
        ds.save_to_disk(str(tmp))


# ---- formatting ------------------------------------------------------------------------------------


def detect_layout(columns: list[str], where: str = "dataset") -> tuple[tuple[str, ...], str]:
    for prompt_fields, response in LAYOUTS:
        if response in columns and all(f in columns for f in prompt_fields[:1]):
            return prompt_fields, response
    known = "; ".join("/".join(p + (r,)) for p, r in LAYOUTS)
    raise DataError(f"{where}: has fields {sorted(columns)}, none of the known layouts ({known}). "
                    "Rename the fields, or convert the file to one of these layouts.")


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


def _check_fields(rec: dict, fields: tuple[str, ...], where: str) -> None:
    for name in fields:
        value = rec.get(name)
        if value is None:
            have = sorted(k for k, v in rec.items() if v is not None)
            raise DataError(f"{where}: missing field '{name}' (it has {have}). Fix or remove the record.")
        if not isinstance(value, str) or not value.strip():
            raise DataError(f"{where}: empty '{name}'. Fill or remove the record.")


def _check_messages(messages, where: str) -> list[dict]:
    """The turns as plain {role, content} dicts, or a DataError naming the record and the turn."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects.")
    turns = []
    for j, m in enumerate(messages, 1):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in CHAT_ROLES:
            raise DataError(f"{where}: message {j} has role {role!r}; allowed roles are {', '.join(CHAT_ROLES)}. "
                            "Rename the role (e.g. 'human' -> 'user', 'gpt' -> 'assistant') or drop the message.")
        content = m.get("content")
        if not isinstance(content, str) or (role != "system" and not content.strip()):
            raise DataError(f"{where}: message {j} ({role}) has an empty or non-text 'content'. "
                            "Fill or remove the message.")
        turns.append({"role": role, "content": content})
    if not any(t["role"] == "assistant" for t in turns):
        raise DataError(f"{where}: no assistant message, so nothing to train on. Add one or remove the record.")
    return turns


# ---- tokenization ----------------------------------------------------------------------------------


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def encode_chat(messages, tokenizer, where: str = "chat") -> tuple[list[int], list[int]]:
    """(input ids, labels) of one conversation; labels keep the assistant turns alone.

    With a `tokenizer.chat_template`, the template renders the conversation; each assistant turn is found as
    the text that rendering up to and including it adds to the rendering before it (with the generation
    prompt). Without one, a built-in template: `<|role|>\\n` + content + `\\n`, assistant turns ending in EOS."""
    turns = _check_messages(messages, where)
    if getattr(tokenizer, "chat_template", None):
        def render(msgs, generation_prompt=False) -> str:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

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
                   source: str = "dataset", rows: list[int] | None = None) -> dict:
    """Encode a batch of records: BOS + prompt + response + EOS, labels = ids with the prompt masked; chats
    through `encode_chat`. Samples longer than `max_length` are cut to it and flagged `truncated`.

    Errors name `source` and the record's 1-based position (`rows`: 0-based positions of the batch's records;
    a record's position is its line in a JSONL file without blank lines)."""
    n = len(batch[response_field])
    records = [{k: batch[k][i] for k in batch} for i in range(n)]
    rows = rows if rows is not None else range(n)
    wheres = [f"{source}: record {r + 1}" for r in rows]
    if response_field == "messages":
        pairs = [encode_chat(rec["messages"], tokenizer, where) for rec, where in zip(records, wheres)]
    else:
        for rec, where in zip(records, wheres):
            _check_fields(rec, (*prompt_fields[:1], response_field), where)
        bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        eos = [tokenizer.eos_token_id]
        # One tokenizer call per field for the whole batch: the fast tokenizer encodes a list in parallel.
        prompts = _encode(tokenizer, [format_prompt(r, prompt_fields) for r in records]) if prompt_fields \
            else [[]] * n
        responses = _encode(tokenizer, [r[response_field] for r in records])
        pairs = [(bos + p + r + eos, [IGNORE] * (len(bos) + len(p)) + r + eos) for p, r in zip(prompts, responses)]
    out = {"input_ids": [], "labels": [], "length": [], "truncated": []}
    for ids, labels in pairs:
        out["input_ids"].append(ids[:max_length])
        out["labels"].append(labels[:max_length])
        out["length"].append(min(len(ids), max_length))
        out["truncated"].append(len(ids) > max_length)
    return out


def _tokenize_rows(batch: dict, indices: list[int], code_version: str, **kwargs) -> dict:
    return tokenize_batch(batch, rows=indices, **kwargs)  # code_version is there for the fingerprint alone


def tokenize_dataset(ds, tokenizer, max_length: int, num_proc: int | None = None, source: str = "dataset",
                     use_cache: bool = True):
    """Offline tokenization with `datasets.map(batched=True, num_proc=N)`. Returns (dataset, stats).

    On a file-backed dataset (what `load_records` returns) the result is cached beside it, named by datasets'
    fingerprint of (data, function, tokenizer, max_length): an unchanged call reads it back (`stats["cached"]`),
    `use_cache=False` recomputes. A bad record raises a DataError and leaves no cache file behind."""
    prompt_fields, response_field = detect_layout(ds.column_names, source)
    folders = {Path(f["filename"]).parent for f in ds.cache_files}
    before = {p: p.stat().st_mtime_ns for d in folders for p in d.iterdir()}
    try:
        tok = ds.map(_tokenize_rows, batched=True, with_indices=True, remove_columns=ds.column_names,
                     num_proc=num_proc if num_proc and num_proc > 1 else None, load_from_cache_file=use_cache,
                     desc="tokenize", fn_kwargs=dict(tokenizer=tokenizer, max_length=max_length,
                                                     prompt_fields=prompt_fields, response_field=response_field,
                                                     source=source, code_version=CODE_VERSION))
    except BaseException:
        # With num_proc, the shards that finished have written their files: remove them, and any temp file.
        for p in {p for d in folders for p in d.iterdir()} - before.keys():
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        raise
    # Read back, not written: every file of the result was there before, untouched.
    outputs = [Path(f["filename"]) for f in tok.cache_files]
    cached = bool(outputs) and all(before.get(p) == p.stat().st_mtime_ns for p in outputs)
    truncated = int(tok.with_format("arrow")["truncated"].to_numpy().sum())
    tok = tok.remove_columns("truncated")
    stats = {"samples": len(tok), "tokens": int(lengths_of(tok).sum()), "truncated": truncated,
             "max_length": max_length, "cached": cached}
    return tok, stats


def iter_jsonl_tokenized(path: str | os.PathLike, tokenizer, max_length: int) -> Iterator[dict]:
    """Re-read and re-tokenize a JSONL file one record at a time: tokenizing inside the training loop, the
    baseline that offline tokenization is measured against. Yields {input_ids, labels} like the dataset rows."""
    path, layout = Path(path), None
    for lineno, rec in iter_jsonl(path):
        layout = layout or detect_layout(list(rec), f"{path}:{lineno}")
        out = tokenize_batch({k: [v] for k, v in rec.items()}, tokenizer, max_length, *layout,
                             source=str(path), rows=[lineno - 1])
        yield {"input_ids": out["input_ids"][0], "labels": out["labels"][0]}


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
        return datasets.Dataset.from_parquet(str(path), keep_in_memory=in_memory,
                                             cache_dir=str(cache_root() / "datasets" / "hf"))
    return datasets.load_from_disk(str(path), keep_in_memory=in_memory)
