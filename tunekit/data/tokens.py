"""Tokenization: records into input ids and labels, offline with `datasets.map` or one sample at a time.

- **Offline tokenization** with `datasets.map(batched=True, num_proc=N)`
  (https://huggingface.co/docs/datasets/process#map): tokenize once before training, so the loop only
  indexes integers. Saves the tokenizer's time on every step of every epoch; costs one pass up front and the
  disk for the result. Labels copy the input ids with the prompt masked to -100, so the loss is taken on
  the response alone (for chats: on the assistant turns alone).
- **The `datasets` cache** (https://huggingface.co/docs/datasets/about_cache): `map` names its output file
  after a fingerprint of its input dataset, the function and its arguments (tokenizer, `max_length`), so the
  same call on the same data is a file lookup and any change recomputes.
- **Parquet or `save_to_disk`** for the tokenized result: parquet is compressed and portable; `save_to_disk`
  is arrow, memory-mapped when loaded, so opening it is instant.
- **Memory-mapped vs in RAM** (`load_tokenized(path, in_memory)`): memory-mapped costs no load time and no
  RAM of its own (pages come from the OS page cache on first touch, from disk if they are not there);
  `in_memory=True` reads it all into the process first: load time and RAM, for reads that never touch disk.
- **In the loop** (`InLoopTokenized`): the article's "before", tokenizing each sample as the DataLoader reads
  it, kept to measure it.

Single-text records train only after a `response_template` marker (TRL's completion-only collator, matched on
the text rather than on token ids); chats render through a chosen `chat_template`. Samples that truncation
leaves without a target token are dropped and counted, and a dataset left with none is an error. `preview`
shows one sample with its masked part.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tunekit.data.batching import IGNORE, lengths_of
from tunekit.data.layouts import (
    CHAT_TEMPLATES,
    ChatTemplateError,
    DataError,
    _check_fields,
    _check_messages,
    detect_layout,
    format_prompt,
    read_chat_template,
    resolve_chat_template,
    split_at_markers,
)
from tunekit.data.records import CODE_VERSION, _file_digest, iter_jsonl
from tunekit.io import atomic_output, cache_dir


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
                                             cache_dir=str(cache_dir() / "datasets" / "hf" / _file_digest(path)))
    return datasets.load_from_disk(str(path), keep_in_memory=in_memory)
