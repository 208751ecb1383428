"""Data: read records, format prompt -> response, tokenize offline, batch.

Tokenize once, before training, with `datasets.map(batched=True, num_proc=N)` and keep the result (arrow on
disk via `save_to_disk`): the training loop then only indexes integers. Labels copy the input ids with the
prompt masked to -100, so the loss is taken on the response alone.

Batches are padded to the longest sample in the batch (not to `max_length`), and the sampler is a seeded
permutation per epoch that can start mid-epoch — that is what makes `--resume` exact.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from tunekit.config import REPO_ROOT

IGNORE = -100
# Where local copies of public datasets live: ../shared/data beside the repo, or $TUNEKIT_DATA_DIR.
SHARED_DATA = Path(os.environ.get("TUNEKIT_DATA_DIR", REPO_ROOT.parent / "shared" / "data"))
# Named datasets: a local copy when one is there (tests, GPU runs), else the hub (a user's machine).
NAMED = {
    "gsm8k": (SHARED_DATA / "gsm8k" / "train.jsonl", ("openai/gsm8k", "main", "train")),
    "gsm8k-test": (SHARED_DATA / "gsm8k" / "test.jsonl", ("openai/gsm8k", "main", "test")),
    "tinyshakespeare": (SHARED_DATA / "tinyshakespeare" / "input.txt", ("karpathy/tiny_shakespeare", None, "train")),
}
# Field layouts we recognise, tried in order: (prompt fields, response field).
LAYOUTS = [(("question",), "answer"), (("prompt",), "response"), (("instruction", "input"), "output"),
           (("prompt",), "completion"), ((), "text")]


class DataError(ValueError):
    """Bad input data; the message names the file, line or field, and what to do."""


# ---- reading ---------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    records = []
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
            records.append(rec)
    return records


def read_text(path: Path) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 (byte {e.start}). Re-encode the file as UTF-8.") from None
    return [{"text": p.strip()} for p in text.split("\n\n") if p.strip()]


def resolve_source(source: str) -> str:
    """A named dataset -> its local copy if present; a relative path -> cwd first, then the repo root."""
    if source in NAMED:
        local, _ = NAMED[source]
        return str(local) if local.exists() else source
    p = Path(source)
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        return str(REPO_ROOT / p)
    return source


def load_records(source: str):
    """Read a dataset into a `datasets.Dataset`: JSONL, JSON, parquet, plain text, a `save_to_disk`
    folder, a named dataset (`gsm8k`, `tinyshakespeare`) or a hub dataset name."""
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
    if suffix == ".jsonl":
        records = read_jsonl(path)
    elif suffix == ".json":
        try:
            records = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: not a valid UTF-8 JSON file ({e}).") from None
        if not isinstance(records, list):
            raise DataError(f"{path}: expected a JSON list of objects.")
    elif suffix == ".parquet":
        return datasets.Dataset.from_parquet(str(path))
    elif suffix in (".txt", ".md", ""):
        records = read_text(path)
    else:
        raise DataError(f"{path}: unknown file type {suffix!r}; use .jsonl, .json, .parquet or .txt.")
    if not records:
        raise DataError(f"{path}: no records.")
    return datasets.Dataset.from_list(records)


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


# ---- tokenization ----------------------------------------------------------------------------------


def tokenize_batch(batch: dict, tokenizer, max_length: int, prompt_fields, response_field,
                   source: str = "dataset") -> dict:
    """Encode a batch of records: BOS + prompt + response + EOS, labels = ids with the prompt masked.

    Errors name `source` and the record's 1-based position (its line in a JSONL file without blank lines)."""
    n = len(batch[response_field])
    out = {"input_ids": [], "labels": [], "length": [], "truncated": []}
    for i in range(n):
        rec = {k: batch[k][i] for k in batch}
        where = f"{source}: record {rec.get('_row', 0) + 1}"
        for name in (*prompt_fields[:1], response_field):
            value = rec.get(name)
            if value is None:
                have = sorted(k for k, v in rec.items() if v is not None and k != "_row")
                raise DataError(f"{where}: missing field '{name}' (it has {have}). Fix or remove the record.")
            if not isinstance(value, str) or not value.strip():
                raise DataError(f"{where}: empty '{name}'. Fill or remove the record.")
        prompt, response = format_prompt(rec, prompt_fields), rec[response_field]
        p_ids = [tokenizer.bos_token_id] + tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else \
            [tokenizer.bos_token_id]
        r_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = (p_ids + r_ids)[:max_length]
        labels = ([IGNORE] * len(p_ids) + r_ids)[:max_length]
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["length"].append(len(ids))
        out["truncated"].append(len(p_ids) + len(r_ids) > max_length)
    return out


def tokenize_dataset(ds, tokenizer, max_length: int, num_proc: int | None = None, source: str = "dataset"):
    """Offline tokenization with `datasets.map(batched=True)`. Returns (dataset, stats)."""
    prompt_fields, response_field = detect_layout(ds.column_names, source)
    ds = ds.add_column("_row", list(range(len(ds))))
    tok = ds.map(tokenize_batch, batched=True, num_proc=num_proc if num_proc and num_proc > 1 else None,
                 remove_columns=ds.column_names, desc="tokenize",
                 fn_kwargs=dict(tokenizer=tokenizer, max_length=max_length, prompt_fields=prompt_fields,
                                response_field=response_field, source=source))
    truncated = sum(tok["truncated"])
    tok = tok.remove_columns("truncated")
    stats = {"samples": len(tok), "tokens": sum(tok["length"]), "truncated": truncated, "max_length": max_length}
    return tok, stats


def save_dataset(ds, path: str | os.PathLike) -> Path:
    """`save_to_disk` into a temp folder, then rename: a half-written dataset never looks finished."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


# ---- batching --------------------------------------------------------------------------------------


class Collator:
    """Pad a list of tokenized samples to the longest one; padded label positions are ignored."""

    def __init__(self, pad_id: int, pad_to_multiple_of: int = 8):
        self.pad_id, self.multiple = pad_id, pad_to_multiple_of

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(s["input_ids"]) for s in samples)
        width = -(-longest // self.multiple) * self.multiple
        ids = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        for i, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[i, :n] = torch.as_tensor(s["input_ids"])
            labels[i, :n] = torch.as_tensor(s["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class EpochSampler(torch.utils.data.Sampler):
    """A seeded permutation per epoch that can start at any sample: the data position of a checkpoint."""

    def __init__(self, n: int, seed: int, epoch: int = 0, start: int = 0):
        self.n, self.seed, self.epoch, self.start = n, seed, epoch, start

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g)[self.start:].tolist())

    def __len__(self) -> int:
        return self.n - self.start


def build_dataloader(ds, batch_size: int, pad_id: int, seed: int = 0, epoch: int = 0, start_batch: int = 0,
                     num_workers: int = 0, pin_memory: bool | None = None):
    """A DataLoader over a tokenized dataset, starting at batch `start_batch` of epoch `epoch`.

    Pinned memory only when CUDA is present (it lets host-to-device copies overlap compute)."""
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    sampler = EpochSampler(len(ds), seed, epoch, start_batch * batch_size)
    extra = dict(persistent_workers=False, prefetch_factor=4) if num_workers > 0 else {}
    # Its own generator: otherwise each new iterator draws a seed from the global RNG, and a resumed run
    # (which makes one more iterator than an uninterrupted one) would see different dropout masks.
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.utils.data.DataLoader(ds.with_format(columns=["input_ids", "labels"]), batch_size=batch_size,
                                       sampler=sampler, collate_fn=Collator(pad_id), drop_last=True,
                                       num_workers=num_workers, pin_memory=pin_memory, generator=generator,
                                       **extra)
