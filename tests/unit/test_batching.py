"""Batching: the collator, the samplers, packing (the same loss as unpacked), padding stats, the DataLoader."""

from __future__ import annotations

import itertools
import os
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import ARITH, SMALL_ARCH, gpu

from tunekit import data
from tunekit import model as mdl
from tunekit.data import batching
from tunekit.data.batching import IGNORE
from tunekit.data.records import load_records
from tunekit.data.tokens import tokenize_dataset
from tunekit.step import count_targets, micro_step, to_device


@pytest.fixture(scope="module")
def tokenized(tokenizer, small_data):
    """The 64 small samples (46 to 81 tokens), tokenized at max_length 128."""
    return tokenize_dataset(load_records(str(small_data)), tokenizer, 128)[0]


@pytest.fixture(scope="module")
def arith(tokenizer):
    """All 4000 arithmetic samples, tokenized."""
    return tokenize_dataset(load_records(str(ARITH)), tokenizer, 256)[0]


def segments(batch: dict) -> list[tuple[int, int, int]]:
    """(row, start, end) of every sample in a packed batch: a sample starts where its position id is 0."""
    out = []
    for r in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][r].sum())
        starts = (batch["position_ids"][r, :n] == 0).nonzero().flatten().tolist()
        out += [(r, a, b) for a, b in zip(starts, starts[1:] + [n])]
    return out


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over one sample's targets: position t predicts label t + 1."""
    return F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=IGNORE, reduction="sum")


def small_model(vocab: int, attention: str):
    return mdl.build_model(mdl.llama_config(vocab_size=vocab, **SMALL_ARCH), attention=attention, seed=0).eval()


# ---- collating -----------------------------------------------------------------------------------


def test_collator_pads_right(tokenized, tokenizer):
    samples = [tokenized[i] for i in range(5)]
    pad = tokenizer.pad_token_id
    batch = batching.Collator(pad)(samples)
    assert set(batch) == {"input_ids", "labels", "attention_mask"}  # unpacked: no position ids
    longest = max(len(s["input_ids"]) for s in samples)
    width = batch["input_ids"].shape[1]
    assert width >= longest and width % 8 == 0 and width - longest < 8
    for k in ("input_ids", "labels", "attention_mask"):
        assert batch[k].shape == (5, width) and batch[k].dtype == torch.long
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        assert batch["input_ids"][i, :n].tolist() == s["input_ids"]
        assert batch["labels"][i, :n].tolist() == s["labels"]
        assert (batch["input_ids"][i, n:] == pad).all()
        assert (batch["labels"][i, n:] == IGNORE).all()
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (width - n)
    assert batching.Collator(pad, pad_to_multiple_of=1)(samples)["input_ids"].shape[1] == longest


def test_collator_gives_packed_rows_position_ids_that_transformers_reads(tokenized, tokenizer):
    from transformers.masking_utils import find_packed_sequence_indices

    packed = batching.pack_dataset(tokenized.select(range(10)), 128)
    rows = [packed[i] for i in range(len(packed))]
    batch = batching.Collator(tokenizer.pad_token_id)(rows)
    width = batch["input_ids"].shape[1]
    assert any(len(r["input_ids"]) < width for r in rows)  # some padding to check
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        assert batch["position_ids"][i].tolist() == r["position_ids"] + list(range(width - n))  # pads restart at 0
    # transformers' own reading: one sequence index per sample, the padding one more.
    found = find_packed_sequence_indices(batch["position_ids"])
    for i, r in enumerate(rows):
        n, starts = len(r["input_ids"]), np.flatnonzero(np.array(r["position_ids"]) == 0)
        expected = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, n)))
        expected = np.append(expected, [len(starts)] * (width - n))
        assert found[i].tolist() == expected.tolist()


# ---- sampling ------------------------------------------------------------------------------------


def test_epoch_sampler_is_a_seeded_permutation():
    n = 37
    order = list(batching.EpochSampler(n, seed=3, epoch=0))
    assert sorted(order) == list(range(n)) and len(batching.EpochSampler(n, 3, 0)) == n
    assert list(batching.EpochSampler(n, seed=3, epoch=0)) == order
    assert list(batching.EpochSampler(n, seed=3, epoch=1)) != order
    assert list(batching.EpochSampler(n, seed=4, epoch=0)) != order
    for start in (0, 1, 10, 36, 37):
        resumed = batching.EpochSampler(n, seed=3, epoch=0, start=start)
        assert list(resumed) == order[start:]
        assert len(resumed) == n - start
    sampler = batching.EpochSampler(n, seed=3, epoch=0, start=5)
    sampler.set_epoch(1)
    assert list(sampler) == list(batching.EpochSampler(n, seed=3, epoch=1))


def test_length_grouped_sampler():
    lengths = np.random.default_rng(0).integers(1, 500, size=211)
    bs, mega = 4, 5  # mega-batches of 20 samples; the last has 11: two batches and an incomplete one
    order = list(batching.LengthGroupedSampler(lengths, bs, seed=1, mega_batch=mega))
    assert sorted(order) == list(range(211))
    assert order == list(batching.LengthGroupedSampler(lengths, bs, seed=1, mega_batch=mega))
    assert order != list(batching.LengthGroupedSampler(lengths, bs, seed=1, epoch=1, mega_batch=mega))
    for start in (0, 4, 100, 211):
        assert list(batching.LengthGroupedSampler(lengths, bs, 1, 0, start, mega)) == order[start:]
    # Each mega-batch holds the samples of its share of the epoch's permutation, cut by length into
    # batches (in shuffled order), the incomplete batch (the shortest samples) last.
    def batch_lengths(o: list[int], stop: int) -> list[list[int]]:
        return sorted(sorted(lengths[o[b:b + bs]].tolist()) for b in range(0, stop, bs))

    perm = torch.randperm(211, generator=batching.epoch_generator(1, 0)).tolist()
    for s in range(0, 211, bs * mega):
        mine, by_length = order[s:s + bs * mega], sorted(perm[s:s + bs * mega], key=lambda i: -lengths[i])
        full = len(mine) // bs * bs
        assert batch_lengths(mine, full) == batch_lengths(by_length, full)
        assert sorted(lengths[mine[full:]]) == sorted(lengths[by_length[full:]])
    spread_grouped = np.mean([np.ptp(lengths[order[b:b + bs]]) for b in range(0, 208, bs)])
    spread_random = np.mean([np.ptp(lengths[perm[b:b + bs]]) for b in range(0, 208, bs)])
    assert spread_grouped < spread_random / 3


# ---- packing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["best_fit", "greedy"])
def test_plan_packing_rows_fit_and_hold_each_sample_once(algorithm):
    lengths = np.random.default_rng(0).integers(1, 300, size=1000)
    rows = batching.plan_packing(lengths, 512, algorithm)
    assert sorted(i for r in rows for i in r) == list(range(1000))
    assert all(lengths[r].sum() <= 512 for r in rows)
    fewest = -(-lengths.sum() // 512)
    if algorithm == "best_fit":
        assert len(rows) <= 11 / 9 * fewest + 1
        assert len(rows) <= len(batching.plan_packing(lengths, 512, "greedy"))
    else:
        assert [i for r in rows for i in r] == list(range(1000))  # keeps the order


@pytest.mark.parametrize("algorithm", ["best_fit", "greedy"])
@pytest.mark.parametrize("max_length", [128, 50])
def test_packing_keeps_every_token_once(tokenized, algorithm, max_length):
    packed, stats = batching.pack_dataset(tokenized, max_length, algorithm, return_stats=True)
    samples = [(tuple(s["input_ids"][:max_length]), tuple(s["labels"][:max_length])) for s in tokenized]
    found = []
    for row in packed:
        n = row["length"]
        assert n <= max_length and len(row["input_ids"]) == len(row["labels"]) == len(row["position_ids"]) == n
        pos = row["position_ids"]
        starts = [i for i in range(n) if pos[i] == 0] + [n]
        assert starts[0] == 0
        for a, b in itertools.pairwise(starts):
            assert pos[a:b] == list(range(b - a))  # positions restart at each sample
            assert row["labels"][a] == IGNORE  # nothing predicts across the boundary
            found.append((tuple(row["input_ids"][a:b]), (IGNORE,) + tuple(row["labels"][a + 1:b])))
    # The multiset of samples (tokens, and labels with the first one ignored) is unchanged.
    assert Counter(found) == Counter((ids, (IGNORE,) + labels[1:]) for ids, labels in samples)
    lengths = batching.lengths_of(tokenized)
    assert stats["samples"] == len(tokenized) and stats["rows"] == len(packed)
    assert stats["truncated"] == int((lengths > max_length).sum())
    assert stats["tokens"] == int(np.minimum(lengths, max_length).sum()) == sum(packed["length"][:])
    assert stats["fill"] == pytest.approx(stats["tokens"] / (stats["rows"] * max_length))
    assert (stats["truncated"] > 0) == (max_length == 50)  # truncated, counted, and still packed


@pytest.mark.parametrize("attention", ["sdpa", "eager", pytest.param("flex_attention", marks=pytest.mark.slow)])
def test_packed_batch_gives_each_sample_its_own_loss(attention, tokenized, tokenizer):
    """Packed rows through the model give every sample the loss it has alone: no attention across samples.
    Run without position ids, the same rows give other losses — the test can see cross-attention."""
    packed = batching.pack_dataset(tokenized.select(range(12)), 128)
    batch = batching.Collator(tokenizer.pad_token_id)([packed[i] for i in range(len(packed))])
    assert len(segments(batch)) == 12 and (batch["attention_mask"] == 0).any()
    model = small_model(len(tokenizer), attention)
    with torch.no_grad():
        try:
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        except Exception as e:  # noqa: BLE001  (flex_attention compiles its kernel; some CPU builds cannot)
            pytest.skip(f"{attention} does not run here: {type(e).__name__}: {str(e)[:200]}")
        # One by one (flex would compile once per length, so its reference is sdpa, with the same weights).
        reference = small_model(len(tokenizer), "sdpa") if attention == "flex_attention" else model
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
        crossed = model(input_ids=batch["input_ids"]).logits
        ids, labels = batch["input_ids"], batch["labels"]
        packed_losses, alone_losses, crossed_losses = [], [], []
        for r, a, b in segments(batch):
            alone = reference(input_ids=ids[r:r + 1, a:b]).logits[0]
            packed_losses.append(summed_loss(logits[r, a:b], labels[r, a:b]))
            alone_losses.append(summed_loss(alone, labels[r, a:b]))
            crossed_losses.append(summed_loss(crossed[r, a:b], labels[r, a:b]))
    torch.testing.assert_close(torch.stack(packed_losses), torch.stack(alone_losses), rtol=1e-5, atol=1e-5)
    assert (torch.stack(crossed_losses) - torch.stack(alone_losses)).abs().max() > 1e-2


def test_train_step_on_packed_rows_matches_unpacked(tokenized, tokenizer):
    """`train.micro_step` on packed rows: the same loss and gradients as on the same samples padded."""
    chosen = tokenized.select(range(8))
    collate = batching.Collator(tokenizer.pad_token_id)
    unpacked = collate([chosen[i] for i in range(8)])
    packed_ds = batching.pack_dataset(chosen, 256)
    packed = collate([packed_ds[i] for i in range(len(packed_ds))])
    assert len(packed_ds) < 8
    n_targets = count_targets([unpacked])
    assert count_targets([packed]) == n_targets
    results = []
    for batch in (unpacked, packed):
        model = small_model(len(tokenizer), "sdpa").train()
        loss = micro_step(model, {k: v for k, v in batch.items() if k != "attention_mask"}, n_targets, None)
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


# ---- padding stats -------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["pad", "group", "pack"])
def test_padding_stats_match_the_batches_the_loader_makes(strategy, arith, tokenizer):
    bs, max_length, seed = 16, 256, 3
    stats = batching.padding_stats(arith, bs, strategy, max_length, seed=seed)
    loader_ds = batching.pack_dataset(arith, max_length) if strategy == "pack" else arith
    loader = batching.build_dataloader(loader_ds, bs, tokenizer.pad_token_id, seed=seed,
                                   group_by_length=strategy == "group")
    batches = slots = real = 0
    for batch in loader:
        batches, slots, real = batches + 1, slots + batch["input_ids"].numel(), real + int(batch["attention_mask"].sum())
    assert (stats["batches"], stats["slots"], stats["real_tokens"]) == (batches, slots, real)
    assert stats["padding_fraction"] == pytest.approx(1 - real / slots)
    assert stats["samples"] == len(arith) and stats["rows"] == len(loader_ds)


def test_packing_pads_least_then_grouping(arith):
    """On the arithmetic data (46 to 81 tokens a sample): about 29%, 6% and 4% padding. Rows of 512 hold
    about 9 samples; with rows of 128 (2 samples) packing would waste more than grouping."""
    pad, group, pack = (batching.padding_stats(batching.lengths_of(arith), 16, s, 512)["padding_fraction"]
                        for s in ("pad", "group", "pack"))
    assert pack < group < pad


def test_auto_packing_packs_short_samples_and_groups_long_ones():
    assert batching.choose_packing("auto", [40, 60, 50], 128)[0] == "pack"  # mean 50 <= 64
    assert batching.choose_packing("auto", [100, 120, 90], 128)[0] == "group"  # one to a row at best
    assert batching.choose_packing("auto", [400, 10, 10], 128)[0] == "pack"  # truncated to 128 first: mean 49
    for asked in ("pad", "group", "pack"):
        assert batching.choose_packing(asked, [100, 120], 128) == (asked, f"{asked}: asked for")
    assert "average 50 tokens" in batching.choose_packing("auto", [40, 60, 50], 128)[1]


def test_packed_rows_have_one_width_and_count_their_samples(tokenized, tokenizer):
    packed = batching.pack_dataset(tokenized, 128)
    batches = list(batching.build_dataloader(packed, 1, tokenizer.pad_token_id, pad_to=128))  # batch 1: none dropped
    assert {b["input_ids"].shape[1] for b in batches} == {128}, "one shape: a compiled kernel is built once"
    assert min(int(b["attention_mask"].sum()) for b in batches) < 128, "some rows are padded to the width"
    assert sum(batching.count_samples(b) for b in batches) == len(tokenized)  # the padding is no sample
    unpacked = next(iter(batching.build_dataloader(tokenized, 4, tokenizer.pad_token_id)))
    assert batching.count_samples(unpacked) == 4 and "position_ids" not in unpacked


# ---- the DataLoader ------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["pad", "group", "pack"])
def test_dataloader_starts_mid_epoch_exactly(strategy, tokenized, tokenizer):
    ds = batching.pack_dataset(tokenized, 128) if strategy == "pack" else tokenized
    pad, group = tokenizer.pad_token_id, strategy == "group"
    full = list(batching.build_dataloader(ds, 4, pad, seed=1, epoch=2, group_by_length=group))
    assert len(full) == len(ds) // 4
    resumed = list(batching.build_dataloader(ds, 4, pad, seed=1, epoch=2, start_batch=3, group_by_length=group))
    assert len(resumed) == len(full) - 3
    for a, b in zip(full[3:], resumed):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ("position_ids" in full[0]) == (strategy == "pack")


def test_batching_names_are_importable_from_data():
    """train.py, databench.py and notebooks call `data.build_dataloader`, `data.pack_dataset`, ..."""
    for name in ("IGNORE", "Collator", "EpochSampler", "LengthGroupedSampler", "build_dataloader",
                 "default_num_workers", "lengths_of", "pack_dataset", "padding_stats", "plan_packing"):
        assert getattr(data, name) is getattr(batching, name)


@pytest.mark.parametrize("cores, workers", [(1, 0), (2, 1), (3, 1), (5, 2), (16, 8), (17, 8), (64, 8)])
def test_default_num_workers_is_half_the_cores_at_most_8(cores, workers, monkeypatch):
    """Half the cores this process may run on (its affinity, not the machine's count), rounded down, at most 8."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(100, 100 + cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 128)  # the machine has more; the affinity decides
    assert batching.default_num_workers() == workers
    monkeypatch.delattr(os, "sched_getaffinity")  # no affinity call (macOS): the core count
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert batching.default_num_workers() == workers


def test_dataloader_knobs(tokenized, tokenizer):
    pad = tokenizer.pad_token_id
    plain = batching.build_dataloader(tokenized, 8, pad, prefetch_factor=4, persistent_workers=True)
    assert plain.num_workers == 0 and plain.prefetch_factor is None and not plain.persistent_workers
    assert plain.pin_memory == torch.cuda.is_available()
    assert batching.build_dataloader(tokenized, 8, pad, num_workers=None).num_workers == batching.default_num_workers()
    # With a worker: the knobs reach the DataLoader, and the batches are the same as without.
    loader = batching.build_dataloader(tokenized, 8, pad, num_workers=1, prefetch_factor=4)
    assert loader.prefetch_factor == 4 and loader.persistent_workers
    expected = [list(batching.build_dataloader(tokenized, 8, pad, epoch=e)) for e in (0, 1)]
    for epoch in (0, 1):  # one loader for both epochs: its persistent worker serves the second too
        loader.sampler.set_epoch(epoch)
        for a, b in zip(loader, expected[epoch], strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a)


# ---- on a GPU --------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("attention, dtype", [("sdpa", torch.float32), ("sdpa", torch.bfloat16),
                                              ("flash_attention_2", torch.bfloat16)])
def test_packed_loss_matches_unpacked_on_gpu(attention, dtype, tokenized, tokenizer):
    if attention == "flash_attention_2":
        pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    packed = batching.pack_dataset(tokenized.select(range(12)), 128)
    batch = to_device(batching.Collator(tokenizer.pad_token_id)([packed[i] for i in range(len(packed))]), "cuda")
    model = mdl.build_model(mdl.llama_config(vocab_size=len(tokenizer), **SMALL_ARCH), dtype=dtype, device="cuda",
                            attention=attention).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        ids, labels = batch["input_ids"], batch["labels"]
        pairs = [(summed_loss(logits[r, a:b], labels[r, a:b]),
                  summed_loss(model(input_ids=ids[r:r + 1, a:b]).logits[0], labels[r, a:b]))
                 for r, a, b in segments(batch)]
    got, want = (torch.stack(x) for x in zip(*pairs))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
