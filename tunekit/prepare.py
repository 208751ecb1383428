"""A config's data, prepared for a run: read, tokenized offline (or in the loop), packed or not, and checked
against what the run recorded. `tunekit prepare` and the start of `tunekit train` call `prepare`; the cache and
the record it writes are `tunekit/data/prepared.py`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from tunekit import stopping
from tunekit.config import TuneConfig
from tunekit.data import batching, prepared
from tunekit.data.batching import lengths_of, pack_dataset
from tunekit.data.layouts import DataError, detect_layout, read_chat_template, record_text
from tunekit.data.records import load_records, progress_bars_off, resolve_source, source_digest
from tunekit.data.tokenizer import load_tokenizer, train_tokenizer
from tunekit.data.tokens import InLoopTokenized, tokenize_dataset


def training_texts(ds, source: str = "dataset") -> list[str]:
    """The text of every record, as the tokenizer will see it (chats included)."""
    layout = detect_layout(ds.column_names, source)
    return [record_text(r, *layout) for r in ds]


def build_tokenizer(cfg: TuneConfig, records=None):
    if cfg.tokenizer or cfg.model:
        return load_tokenizer(cfg.tokenizer or cfg.model, cfg.trust_remote_code)
    records = records if records is not None else load_records(cfg.data, fields=cfg.fields)
    return train_tokenizer(training_texts(records, cfg.data), cfg.tokenizer_vocab)


def prepare(cfg: TuneConfig, num_proc: int | None = None, verbose: bool = True, *, commit: bool = True,
            check_run: bool = False):
    """Tokenize the training data offline into `<run_dir>/prepared/`, or reuse it if it is up to date and
    every file of it verifies (tunekit/prepared.py: a key that follows the data's content, checksums).

    Returns (tokenizer, tokenized dataset, stats); `stats["packing"]` is the strategy the config's `packing`
    resolved to (`auto` decides from the sample lengths, `batching.choose_packing`), and the dataset is then
    packed rows if it is `pack`. What is made goes to the cache first; `commit=False` (a run's start) leaves
    it there (`stats["staged"]`) for `prepared.commit` to copy in once the run has started, so a start that
    fails changes nothing. `check_run` (a resume): the data, the tokenizer and the samples must be those of
    the run's record (`data.json`), else a DataError says what changed."""

    if cfg.tokenize == "in_loop":
        return _in_loop(cfg, verbose, check_run)
    say = print if verbose else (lambda *a, **k: None)
    run_dir = cfg.run_dir()
    out = run_dir / "prepared"
    digest = source_digest(cfg.data)
    record = _run_record(run_dir, check_run, say)
    prepared.check_data(record, digest, cfg.data, run_dir)  # before any work
    key = prepare_key(cfg, digest)
    where, remote = out, getattr(cfg, "trust_remote_code", False)
    found, problem = prepared.load(out, key, remote)
    if found is None:
        if problem:
            say(f"data: {problem}; preparing the data again")
        where = prepared.cache_folder(key)
        found, problem = prepared.load(where, key, remote)
        if found is None and where.exists():  # damaged: made again below
            shutil.rmtree(where, ignore_errors=True)
    if found is not None:
        tokenizer, ds, stats = found
        stats["cached"] = True  # this run reused the prepared data
        say(f"data: reusing {where} ({stats['samples']} samples, {stats['tokens']} tokens)")
    else:  # progress bars are carriage returns in a log file
        with progress_bars_off(not verbose or not stopping.on_terminal()):
            tokenizer, ds, stats = _make(cfg, where, key, digest, remote, num_proc)
        say(f"data: {stats['samples']} samples, {stats['tokens']} tokens, {stats['truncated']} truncated "
            f"to {cfg.max_length} -> {out}")
    say(f"batches: {stats['packing_reason']}")
    prepared.check_run(record, stats, run_dir, cfg.tokenizer or cfg.model or f"trained on {cfg.data}")
    if where != out:
        if commit:
            prepared.copy_in(where, out)
        else:
            stats["staged"] = str(where)
    return tokenizer, ds, stats


def _make(cfg: TuneConfig, where: Path, key: str, digest: str, remote: bool, num_proc: int | None):
    """Read, tokenize and (if the packing says so) pack the config's data into the cache folder `where`, then
    read it back memory-mapped, as later starts read it. Returns (tokenizer, dataset, stats)."""
    records = load_records(cfg.data, fields=cfg.fields)
    tokenizer = build_tokenizer(cfg, records)
    # datasets' own cache beside a save_to_disk folder is named by the fingerprint in its state.json, which an
    # edit of its arrow files keeps: tokenized afresh (the key follows the files).
    ds, stats = tokenize_dataset(records, tokenizer, cfg.max_length, num_proc=num_proc, source=cfg.data,
                                 use_cache=not Path(resolve_source(cfg.data)).is_dir(), **text_options(cfg))
    stats["packing"], stats["packing_reason"] = batching.choose_packing(cfg.packing, lengths_of(ds), cfg.max_length)
    if stats["packing"] == "pack":
        ds = pack_dataset(ds, cfg.max_length)
        stats["packed_rows"] = len(ds)
    stats.update(key=key, data=cfg.data, data_sha256=digest, vocab_size=len(tokenizer))
    cached = stats.pop("cached")
    prepared.save(where, tokenizer, ds, stats)
    found, problem = prepared.load(where, key, remote, verify=False)
    if found is None:
        raise DataError(f"{where}: the data just prepared cannot be read back: {problem}")
    tokenizer, ds, stats = found
    stats["cached"] = cached
    return tokenizer, ds, stats


def prepare_key(cfg: TuneConfig, digest: str | None = None) -> str:
    """What names a config's prepared data: the content of its data (`digest`, computed if not given) and of
    a local tokenizer, not their size and mtime (tunekit/prepared.py), and every option that changes a sample."""
    digest = digest or source_digest(cfg.data)
    return hashlib.sha256(json.dumps([cfg.data, digest, prepared.tokenizer_source(cfg.tokenizer or cfg.model),
                                      cfg.tokenizer_vocab, cfg.max_length, cfg.packing, cfg.fields,
                                      cfg.response_template, cfg.instruction_template,
                                      read_chat_template(cfg.chat_template)]).encode()).hexdigest()[:16]


def _run_record(run_dir: Path, check_run: bool, say) -> dict | None:
    """On a resume, what the run recorded it trained on (None, saying so, for a run from before the record)."""
    record = prepared.read_record(run_dir) if check_run else None
    if check_run and record is None:
        say(f"resume: {run_dir} has no {prepared.RECORD} (started before tunekit recorded its data): its data and "
            "tokenizer cannot be checked this time; they are recorded from now on")
    return record


def text_options(cfg: TuneConfig) -> dict:
    """How a record's text becomes a sample (masking markers, chat template): what every tokenization of the
    run's data, training or held-out, offline or in the loop, is given."""
    return {"response_template": cfg.response_template, "instruction_template": cfg.instruction_template,
            "chat_template": cfg.chat_template}


def _in_loop(cfg: TuneConfig, verbose: bool, check_run: bool = False):
    """`tokenize=in_loop`: the records as they are, tokenized sample by sample as the DataLoader reads them
    (`data.InLoopTokenized`); only the tokenizer is made (or read) before training. A resume checks the data
    and the tokenizer against the run's record, as `prepare` does."""
    run_dir = cfg.run_dir()
    digest = source_digest(cfg.data)
    record = _run_record(run_dir, check_run, print if verbose else (lambda *a, **k: None))
    prepared.check_data(record, digest, cfg.data, run_dir)
    records = load_records(cfg.data, fields=cfg.fields)
    tokenizer = build_tokenizer(cfg, records)
    ds = InLoopTokenized(records, tokenizer, cfg.max_length, cfg.data, **text_options(cfg))
    reason = "pad: tokenize=in_loop (each batch tokenized as it is read, padded to its longest sample)"
    stats = {"samples": len(ds), "tokens": None, "target_tokens": None, "truncated": None, "packing": "pad",
             "packing_reason": reason, "tokenize": "in_loop", "data": cfg.data, "data_sha256": digest,
             "tokenizer_sha256": prepared.tokenizer_digest(tokenizer), "vocab_size": len(tokenizer)}
    prepared.check_run(record, stats, run_dir, cfg.tokenizer or cfg.model or f"trained on {cfg.data}")
    if verbose:
        print(f"data: {len(ds)} records of {cfg.data}, tokenized in the loop")
        print(f"batches: {reason}")
    return tokenizer, ds, stats


def split_eval(ds, cfg: TuneConfig, tokenizer=None, stats: dict | None = None):
    """(training rows, held-out rows or None): `eval_data` tokenized as the training data was (packed if it
    is), or `eval_split` of the rows, picked by a permutation of `seed`, so a resumed run holds out the same
    ones."""
    if cfg.eval_data:
        records = load_records(cfg.eval_data, fields=cfg.fields)
        if cfg.tokenize == "in_loop":
            return ds, InLoopTokenized(records, tokenizer, cfg.max_length, cfg.eval_data, **text_options(cfg))
        held, _ = tokenize_dataset(records, tokenizer, cfg.max_length, source=cfg.eval_data, **text_options(cfg))
        return ds, pack_dataset(held, cfg.max_length) if (stats or {}).get("packing") == "pack" else held
    if not cfg.eval_split:
        return ds, None
    n = max(1, round(cfg.eval_split * len(ds)))
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(cfg.seed + 7)).tolist()
    return ds.select(sorted(order[n:])), ds.select(sorted(order[:n]))
