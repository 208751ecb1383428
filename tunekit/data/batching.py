"""Batching: from a tokenized dataset to batches — collate, shuffle, group or pack, and the DataLoader.

A batch is a rectangle, batch size x its longest sample; every slot a shorter sample leaves empty is padding,
compute spent on tokens that train nothing. Three ways to fill it, compared by `padding_stats` from the
lengths alone:

- **pad** (the default): shuffle (`EpochSampler`), pad each batch to its longest sample, rounded up to a
  multiple of 8 for tensor cores — not to `max_length`. The padding grows with the spread of lengths.
- **group** (`LengthGroupedSampler`, `build_dataloader(group_by_length=True)`): shuffle, then sort by length
  inside mega-batches of 64 batches, so a batch holds similar lengths. Saves most of the padding at no
  compute cost; costs some randomness (long samples come together).
- **pack** (`pack_dataset`): concatenate samples into rows of at most `max_length` tokens, with
  `position_ids` that restart at 0 at each sample. Given position ids and no attention mask, transformers
  finds the samples (`masking_utils.find_packed_sequence_indices`) and for sdpa/eager/flex builds a
  block-diagonal causal mask; flash_attention_2 runs its variable-length kernel on them. So each sample sees
  only itself, at the positions it would have alone: the same loss as unpacked (tested). The first token
  of each sample gets label -100, so the last token of one sample is not trained to predict the next.
  Saves nearly all the padding. Costs: with sdpa the explicit mask rules out the flash kernel (the
  memory-efficient one runs instead); rows keep the same samples every epoch; samples per step vary
  (harmless: the loss is normalised by target tokens, see `train.py`).

Packing is best-fit decreasing (https://en.wikipedia.org/wiki/Bin_packing_problem): longest sample first,
each into the open row with the least room that still fits it. Like first-fit decreasing it never needs
more than about 11/9 of the fewest possible rows, where greedy in-order packing can waste up to half of
each row; best fit is the simpler to make fast, since rows with equal room are interchangeable: a sorted list
of the distinct rooms (at most `max_length` + 1) finds the row by bisection — about a second for a million
samples. `algorithm="greedy"` keeps the dataset order instead (a new row whenever the next sample does not fit).

The DataLoader (`build_dataloader`): `num_workers` processes collate batches while the GPU computes (each
costs a process and its memory); `pin_memory` makes host-to-device copies faster and lets them overlap
compute (`non_blocking=True`), for page-locked host memory; `prefetch_factor` batches wait ready per
worker; `persistent_workers` keeps workers alive between epochs of one DataLoader (see `set_epoch`).
The samplers are seeded permutations per epoch that can start mid-epoch — that is what makes `--resume` exact.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator

import numpy as np
import torch

IGNORE = -100  # the label the loss skips: masked prompts, padding, the first token of a packed sample
STRATEGIES = ("pad", "group", "pack")  # what `auto` (choose_packing) resolves to


def lengths_of(ds) -> np.ndarray:
    """Tokens per sample (or per packed row), read from the arrow column without building Python lists."""
    import pyarrow.compute as pc

    table = ds.with_format("arrow")
    if "length" in ds.column_names:
        return table["length"].to_numpy()
    return pc.list_value_length(table["input_ids"]).to_numpy()


# ---- collating ---------------------------------------------------------------------------------------


class Collator:
    """Pad a list of tokenized samples to the longest one; padded label positions are ignored.

    Packed rows (samples with `position_ids`) also get `position_ids`, the padding's restarting at 0 so the
    padding is a document of its own. Unpacked batches get none: without them SDPA keeps its causal fast path.
    `pad_to` pads every batch to at least that width: packed rows all get the one shape `max_length`, so a
    compiled kernel (FlexAttention's, `torch.compile`'s) is built once, not once per width."""

    def __init__(self, pad_id: int, pad_to_multiple_of: int = 8, pad_to: int = 0):
        self.pad_id, self.multiple, self.pad_to = pad_id, pad_to_multiple_of, pad_to

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(max(len(s["input_ids"]) for s in samples), self.pad_to)
        width = -(-longest // self.multiple) * self.multiple
        ids = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        packed = "position_ids" in samples[0]
        positions = torch.arange(width).repeat(len(samples), 1) if packed else None
        for i, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[i, :n] = torch.as_tensor(s["input_ids"])
            labels[i, :n] = torch.as_tensor(s["labels"])
            mask[i, :n] = 1
            if packed:
                positions[i, :n] = torch.as_tensor(s["position_ids"])
                positions[i, n:] -= n
        batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
        return {**batch, "position_ids": positions} if packed else batch


def count_samples(batch: dict) -> int:
    """Samples in a collated batch: its rows, or, for packed rows, the samples that start in them (position 0
    on a real token; the padding's restart does not count)."""
    if "position_ids" not in batch:
        return len(batch["input_ids"])
    return int(((batch["position_ids"] == 0) & batch["attention_mask"].bool()).sum())


def choose_packing(requested: str, lengths, max_length: int) -> tuple[str, str]:
    """(strategy, one-line reason) for the config's `packing`: `auto` packs when the samples' mean length is
    at most half of `max_length` (two or more to a row), else groups by length — a row that fits one sample
    gains nothing from packing and would still pay for the document mask."""
    if requested != "auto":
        return requested, f"{requested}: asked for"
    lengths = np.minimum(np.asarray(lengths, dtype=np.int64), max_length)
    mean = float(lengths.mean()) if len(lengths) else 0.0
    if mean <= max_length / 2:
        return "pack", (f"auto: samples average {mean:.0f} tokens, at most half of max_length {max_length}: "
                        f"packed into rows of {max_length}, each sample attending only to itself")
    return "group", (f"auto: samples average {mean:.0f} tokens, over half of max_length {max_length}: batches "
                     "of similar length")


# ---- sampling ----------------------------------------------------------------------------------------


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 100_003 + epoch)


class EpochSampler(torch.utils.data.Sampler):
    """A seeded permutation per epoch that can start at any sample: the data position of a checkpoint.

    With `world` > 1 (distributed training) rank `rank` takes every `world`-th index of the epoch's order,
    starting at its own: consecutive runs of `world` indices are split one to a rank, so batch i of every rank
    together holds the same samples as batch i of one process with `world` times the batch, and `start` (in
    this rank's samples) is the same position on every rank. The last `n % world` indices are dropped, so
    every rank has as many."""

    def __init__(self, n: int, seed: int, epoch: int = 0, start: int = 0, rank: int = 0, world: int = 1):
        self.n, self.seed, self.epoch, self.start, self.rank, self.world = n, seed, epoch, start, rank, world

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Move to another epoch: one DataLoader (and its persistent workers) can then serve them all."""
        self.epoch, self.start = epoch, start

    def order(self) -> list[int]:
        return torch.randperm(self.n, generator=epoch_generator(self.seed, self.epoch)).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        return iter(order[: len(order) - len(order) % self.world][self.rank::self.world][self.start:])

    def __len__(self) -> int:
        return self.n // self.world - self.start


class LengthGroupedSampler(EpochSampler):
    """EpochSampler whose batches hold similar lengths: the epoch's permutation is cut into mega-batches of
    `mega_batch` batches, each sorted by length (longest first) and cut into batches, which are then
    shuffled within the mega-batch. A last incomplete batch stays last, where `drop_last` drops it."""

    def __init__(self, lengths, batch_size: int, seed: int, epoch: int = 0, start: int = 0, mega_batch: int = 64,
                 rank: int = 0, world: int = 1):
        super().__init__(len(lengths), seed, epoch, start, rank, world)
        self.lengths, self.batch_size, self.mega_batch = np.asarray(lengths), batch_size, mega_batch

    def order(self) -> list[int]:
        # Batches of the global batch size (every rank's share of one step), similar in length throughout.
        g, bs = epoch_generator(self.seed, self.epoch), self.batch_size * self.world
        order, out = torch.randperm(self.n, generator=g).numpy(), []
        for s in range(0, self.n, bs * self.mega_batch):
            chunk = order[s:s + bs * self.mega_batch]
            chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
            full = len(chunk) // bs
            for b in torch.randperm(full, generator=g).tolist():
                out += chunk[b * bs:(b + 1) * bs].tolist()
            out += chunk[full * bs:].tolist()
        return out


# ---- packing -----------------------------------------------------------------------------------------


def plan_packing(lengths, max_length: int, algorithm: str = "best_fit") -> list[list[int]]:
    """Rows of sample indices, each row's lengths summing to at most `max_length` (a longer sample counts as
    `max_length`: it is truncated when packed)."""
    lengths = np.minimum(np.asarray(lengths, dtype=np.int64), max_length)
    rows: list[list[int]] = []
    if algorithm == "greedy":
        used = max_length
        for i, n in enumerate(lengths.tolist()):
            if used + n > max_length:
                rows.append([])
                used = 0
            rows[-1].append(i)
            used += n
        return rows
    if algorithm != "best_fit":
        raise ValueError(f"unknown packing algorithm {algorithm!r}; choose 'best_fit' or 'greedy'")
    by_room: list[list[int]] = [[] for _ in range(max_length + 1)]  # room left -> rows with exactly that room
    rooms: list[int] = []  # the distinct rooms some row has, sorted
    order = np.argsort(-lengths, kind="stable")
    for i, n in zip(order.tolist(), lengths[order].tolist()):
        k = bisect.bisect_left(rooms, n)  # the least room that fits
        if k == len(rooms):
            row, room = len(rows), max_length
            rows.append([])
        else:
            room = rooms[k]
            row = by_room[room].pop()
            if not by_room[room]:
                del rooms[k]
        rows[row].append(i)
        if not by_room[room - n]:
            bisect.insort(rooms, room - n)
        by_room[room - n].append(row)
    return rows


def _row_lengths(lengths: np.ndarray, rows: list[list[int]]) -> np.ndarray:
    starts = np.cumsum([0] + [len(r) for r in rows[:-1]])
    flat = np.fromiter((i for r in rows for i in r), dtype=np.int64, count=sum(map(len, rows)))
    return np.add.reduceat(lengths[flat], starts) if rows else np.zeros(0, dtype=np.int64)


def pack_dataset(ds, max_length: int, algorithm: str = "best_fit", return_stats: bool = False):
    """Pack a tokenized dataset into rows of at most `max_length` tokens: columns `input_ids`, `labels`,
    `position_ids` (restarting at 0 at each sample) and `length`. Samples longer than `max_length` are
    truncated first (counted in the stats). With `return_stats`, returns (dataset, stats).

    Vectorised with numpy over the arrow columns: no Python loop over tokens. The result is in memory;
    `data.save_dataset` keeps it."""
    import datasets
    import pyarrow as pa

    table = ds.with_format("arrow")[:]
    ids, labels = table.column("input_ids").combine_chunks(), table.column("labels").combine_chunks()
    id_offsets, label_offsets = np.asarray(ids.offsets), np.asarray(labels.offsets)
    full = np.diff(id_offsets)
    if not np.array_equal(full, np.diff(label_offsets)):
        raise ValueError("input_ids and labels differ in length in some sample; tokenize the data again")
    lengths = np.minimum(full, max_length)
    rows = plan_packing(lengths, max_length, algorithm)

    # Samples in row order; for each, where its tokens start in the old flat arrays and in the new one.
    order = np.fromiter((i for row in rows for i in row), dtype=np.int64, count=len(lengths))
    seg_len = lengths[order]
    seg_start = np.cumsum(seg_len) - seg_len
    within = np.arange(int(seg_len.sum())) - np.repeat(seg_start, seg_len)  # position inside its sample
    new_ids = ids.values.to_numpy()[np.repeat(id_offsets[order], seg_len) + within]
    new_labels = labels.values.to_numpy()[np.repeat(label_offsets[order], seg_len) + within]
    new_labels[seg_start] = IGNORE  # no target across a sample boundary
    row_len = _row_lengths(lengths, rows)
    row_offsets = pa.array(np.concatenate([[0], np.cumsum(row_len)]), pa.int32())

    def column(values):
        return pa.ListArray.from_arrays(row_offsets, pa.array(values))

    packed = datasets.Dataset(pa.table({"input_ids": column(new_ids), "labels": column(new_labels),
                                        "position_ids": column(within.astype(new_ids.dtype)),
                                        "length": pa.array(row_len)}))
    if not return_stats:
        return packed
    stats = {"samples": len(lengths), "rows": len(rows), "tokens": int(row_len.sum()),
             "truncated": int((full > max_length).sum()), "max_length": max_length,
             "fill": float(row_len.sum() / max(1, len(rows) * max_length))}
    return packed, stats


def padding_stats(ds_or_lengths, batch_size: int, strategy: str = "pad", max_length: int | None = None,
                  seed: int = 0, epoch: int = 0, mega_batch: int = 64, pad_to_multiple_of: int = 8,
                  algorithm: str = "best_fit") -> dict:
    """Token slots, real tokens and the padding fraction of one epoch of batches under `strategy` (pad, group
    or pack), from the sample lengths alone: the samplers, packing and rounding of `build_dataloader`, no
    tensors. Counts full batches only (the loader drops an incomplete last one). `max_length` caps the
    lengths and, for pack, is the row length."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    lengths = ds_or_lengths if isinstance(ds_or_lengths, (list, tuple, np.ndarray)) else lengths_of(ds_or_lengths)
    lengths = np.asarray(lengths, dtype=np.int64)
    samples = len(lengths)
    if max_length is not None:
        lengths = np.minimum(lengths, max_length)
    if strategy == "pack":
        if max_length is None:
            raise ValueError("strategy 'pack' needs max_length: the length of a packed row")
        lengths = _row_lengths(lengths, plan_packing(lengths, max_length, algorithm))
    if strategy == "group":
        sampler = LengthGroupedSampler(lengths, batch_size, seed, epoch, mega_batch=mega_batch)
    else:
        sampler = EpochSampler(len(lengths), seed, epoch)
    order = np.fromiter(iter(sampler), dtype=np.int64, count=len(lengths))
    batches = len(order) // batch_size
    per_batch = lengths[order[: batches * batch_size]].reshape(batches, batch_size)
    width = -(-per_batch.max(axis=1, initial=0) // pad_to_multiple_of) * pad_to_multiple_of
    slots, real = int(width.sum()) * batch_size, int(per_batch.sum())
    return {"strategy": strategy, "samples": samples, "rows": len(lengths), "batches": batches, "slots": slots,
            "real_tokens": real, "padding_fraction": 1 - real / slots if slots else 0.0}


# ---- the DataLoader ----------------------------------------------------------------------------------


def default_num_workers() -> int:
    """Half the CPU cores this process may use, at most 8: collating is light, and the other cores serve the
    training process, its kernel launches and the tokenizer."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(8, cores // 2)


def model_columns(ds):
    """The dataset as the collator takes it: only the columns the model reads, as lists."""
    return ds.with_format(columns=[c for c in ("input_ids", "labels", "position_ids") if c in ds.column_names])


def build_dataloader(ds, batch_size: int, pad_id: int, seed: int = 0, epoch: int = 0, start_batch: int = 0,
                     num_workers: int | None = 0, pin_memory: bool | None = None, *,
                     prefetch_factor: int | None = None, persistent_workers: bool | None = None,
                     group_by_length: bool = False, mega_batch: int = 64, pad_to_multiple_of: int = 8,
                     pad_to: int = 0, rank: int = 0, world: int = 1):
    """A DataLoader over a tokenized (or packed) dataset, starting at batch `start_batch` of epoch `epoch`.

    `num_workers=None` means `default_num_workers()`; `pin_memory=None` means "when CUDA is present".
    `prefetch_factor` (default 2, torch's) and `persistent_workers` (default on) apply only with workers and
    are ignored without, so one sweep can pass them everywhere. `group_by_length` uses LengthGroupedSampler;
    `pad_to` is the least batch width (see `Collator`); `rank` and `world` give this rank its share of every
    global batch (see `EpochSampler`), `start_batch` counting this rank's batches."""
    num_workers = default_num_workers() if num_workers is None else num_workers
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    start = start_batch * batch_size
    if group_by_length:
        sampler = LengthGroupedSampler(lengths_of(ds), batch_size, seed, epoch, start, mega_batch, rank, world)
    else:
        sampler = EpochSampler(len(ds), seed, epoch, start, rank, world)
    extra = {}
    if num_workers > 0:
        extra = dict(prefetch_factor=prefetch_factor or 2,
                     persistent_workers=True if persistent_workers is None else persistent_workers)
    # Its own generator: otherwise each new iterator draws a seed from the global RNG, and a resumed run
    # (which makes one more iterator than an uninterrupted one) would see different dropout masks.
    generator = epoch_generator(seed, epoch)
    return torch.utils.data.DataLoader(model_columns(ds), batch_size=batch_size, sampler=sampler,
                                       collate_fn=Collator(pad_id, pad_to_multiple_of, pad_to), drop_last=True,
                                       num_workers=num_workers, pin_memory=pin_memory, generator=generator,
                                       **extra)
