"""Data: loaders, the offline tokenizer, prompt masking, truncation, batching and bad input."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import SMALL_ARCH, write_jsonl

from tunekit import data, train
from tunekit import model as mdl
from tunekit.data import IGNORE, DataError

GSM8K = data.SHARED_DATA / "gsm8k" / "train.jsonl"
needs_gsm8k = pytest.mark.skipif(not GSM8K.exists(), reason=f"real GSM8K not present at {GSM8K}")
needs_shakespeare = pytest.mark.skipif(not (data.SHARED_DATA / "tinyshakespeare" / "input.txt").exists(),
                                       reason="tinyshakespeare not present under shared/data")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_one(tokenizer, rec: dict, max_length: int = 512) -> dict:
    prompt_fields, response = data.detect_layout(list(rec))
    out = data.tokenize_batch({k: [v] for k, v in rec.items()}, tokenizer, max_length, prompt_fields, response)
    return {k: v[0] for k, v in out.items()}


# ---- tokenizer -----------------------------------------------------------------------------------


def test_train_tokenizer_is_cached(tmp_path, small_records, monkeypatch):
    texts = [r["question"] + " " + r["answer"] for r in small_records]
    cache = tmp_path / "tok"
    first = mdl.train_tokenizer(texts, 300, cache=cache)
    folders = list(cache.iterdir())
    assert len(folders) == 1 and (folders[0] / "tokenizer.json").exists()
    mtime = (folders[0] / "tokenizer.json").stat().st_mtime_ns

    import tokenizers.trainers

    def no_training(*a, **k):
        raise AssertionError("train_tokenizer retrained instead of using its cache")

    monkeypatch.setattr(tokenizers.trainers, "BpeTrainer", no_training)
    second = mdl.train_tokenizer(texts, 300, cache=cache)
    assert second.get_vocab() == first.get_vocab()
    assert list(cache.iterdir()) == folders
    assert (folders[0] / "tokenizer.json").stat().st_mtime_ns == mtime
    monkeypatch.undo()
    # Other texts or another size are another tokenizer, in another folder.
    mdl.train_tokenizer(texts[:10], 300, cache=cache)
    mdl.train_tokenizer(texts, 280, cache=cache)
    assert len(list(cache.iterdir())) == 3


def test_train_tokenizer_uses_tunekit_cache_env(tmp_path, monkeypatch, small_records):
    monkeypatch.setenv("TUNEKIT_CACHE", str(tmp_path / "envcache"))
    mdl.train_tokenizer([r["answer"] for r in small_records], 300)
    assert list((tmp_path / "envcache" / "tokenizers").glob("*/tokenizer.json"))


def test_tokenizer_special_tokens_and_round_trip(tokenizer, small_records):
    assert len(tokenizer) <= 1024
    ids = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}
    assert len(ids) == 3 and None not in ids
    texts = [r["question"] + "\n" + r["answer"] for r in small_records[:16]]
    texts += ["Zoë paid €5 — 日本語 too!", "  two  spaces , then tabs\t and a newline\n"]
    for text in texts:
        assert tokenizer.decode(encode(tokenizer, text)) == text
    # Byte-level BPE: characters never seen in training still encode, with no unknown token.
    assert all(i is not None for i in encode(tokenizer, "ж∑🙂"))


# ---- prompt masking ------------------------------------------------------------------------------


def test_labels_mask_bos_and_prompt_exactly(tokenizer, small_records):
    rec = small_records[0]
    sample = tokenize_one(tokenizer, rec)
    prompt = data.format_prompt(rec, ("question",))
    assert rec["question"].strip() in prompt
    n_prompt = 1 + len(encode(tokenizer, prompt))
    r_ids = encode(tokenizer, rec["answer"])
    ids, labels = sample["input_ids"], sample["labels"]
    assert len(ids) == len(labels) == sample["length"] == n_prompt + len(r_ids) + 1
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert ids[n_prompt:-1] == r_ids
    assert labels[:n_prompt] == [IGNORE] * n_prompt
    assert labels[n_prompt:] == ids[n_prompt:]
    assert not sample["truncated"]


def test_masked_prompt_contributes_nothing_to_loss(tokenizer, small_records):
    """The step loss equals the mean cross-entropy over response (+EOS) predictions alone."""
    sample = tokenize_one(tokenizer, small_records[3])
    n_prompt = sum(1 for t in sample["labels"] if t == IGNORE)
    n = len(sample["input_ids"])
    batch = data.Collator(tokenizer.pad_token_id)([sample])
    arch = mdl.llama_config(vocab_size=len(tokenizer), **SMALL_ARCH)
    model = mdl.build_model(arch, seed=0)
    n_targets = train.count_targets([batch])
    assert n_targets == n - n_prompt
    loss = train.micro_step(model, batch, n_targets, None)

    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[0].float()
    ids = batch["input_ids"][0]
    positions = torch.arange(n_prompt - 1, n - 1)  # each predicts the next token, a response token
    expected = F.cross_entropy(logits[positions], ids[positions + 1])
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    # The whole-sequence loss differs: the prompt would have counted without the mask.
    everything = F.cross_entropy(logits[: n - 1], ids[1:n])
    assert not torch.isclose(everything, expected)


def test_text_layout_trains_on_everything_after_bos(tokenizer):
    sample = tokenize_one(tokenizer, {"text": "Once upon a time there was a tokenizer."})
    assert sample["labels"][0] == IGNORE
    assert sample["labels"][1:] == sample["input_ids"][1:]


def test_instruction_layout(tokenizer):
    rec = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
    sample = tokenize_one(tokenizer, rec)
    prompt = data.format_prompt(rec, ("instruction", "input"))
    assert "Add the numbers." in prompt and "2 and 3" in prompt
    n_prompt = 1 + len(encode(tokenizer, prompt))
    assert sample["labels"][:n_prompt] == [IGNORE] * n_prompt
    assert sample["labels"][n_prompt:] == encode(tokenizer, "5") + [tokenizer.eos_token_id]


@pytest.mark.parametrize("columns, expected", [
    (["question", "answer"], (("question",), "answer")),
    (["prompt", "response"], (("prompt",), "response")),
    (["instruction", "output"], (("instruction", "input"), "output")),
    (["prompt", "completion", "id"], (("prompt",), "completion")),
    (["text", "meta"], ((), "text")),
])
def test_detect_layout(columns, expected):
    assert data.detect_layout(columns) == expected


# ---- whole-dataset tokenization ------------------------------------------------------------------


def test_truncation_is_counted(tokenizer, small_data):
    ds = data.load_records(str(small_data))
    full, full_stats = data.tokenize_dataset(ds, tokenizer, max_length=10_000)
    assert full_stats["truncated"] == 0
    lengths = full["length"]
    cut = sorted(lengths)[len(lengths) // 2]  # about half the samples are longer than this
    expected = sum(n > cut for n in lengths)
    assert 0 < expected < len(lengths)
    short, stats = data.tokenize_dataset(ds, tokenizer, max_length=cut)
    assert stats["truncated"] == expected
    assert stats["samples"] == len(ds) and stats["max_length"] == cut
    assert stats["tokens"] == sum(min(n, cut) for n in lengths)
    assert max(short["length"]) == cut
    for a, b in zip(full, short):
        assert b["input_ids"] == a["input_ids"][:cut] and b["labels"] == a["labels"][:cut]


def test_tokenize_dataset_in_parallel_matches(tokenizer, small_data):
    ds = data.load_records(str(small_data))
    one, _ = data.tokenize_dataset(ds, tokenizer, 128)
    two, _ = data.tokenize_dataset(ds, tokenizer, 128, num_proc=2)
    assert one["input_ids"] == two["input_ids"] and one["labels"] == two["labels"]


def test_save_dataset_replaces_atomically(tmp_path, tokenizer, small_data):
    ds, _ = data.tokenize_dataset(data.load_records(str(small_data)), tokenizer, 128)
    target = tmp_path / "dataset"
    data.save_dataset(ds.select(range(10)), target)
    data.save_dataset(ds, target)  # over an existing one
    assert len(data.load_records(str(target))) == len(ds)
    assert [p.name for p in tmp_path.iterdir()] == ["dataset"]


# ---- batching ------------------------------------------------------------------------------------


def test_collator_pads_right(tokenizer, small_records):
    samples = [tokenize_one(tokenizer, r) for r in small_records[:5]]
    pad = tokenizer.pad_token_id
    batch = data.Collator(pad)(samples)
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
    assert data.Collator(pad, pad_to_multiple_of=1)(samples)["input_ids"].shape[1] == longest


def test_epoch_sampler_is_a_seeded_permutation():
    n = 37
    order = list(data.EpochSampler(n, seed=3, epoch=0))
    assert sorted(order) == list(range(n)) and len(data.EpochSampler(n, 3, 0)) == n
    assert list(data.EpochSampler(n, seed=3, epoch=0)) == order
    assert list(data.EpochSampler(n, seed=3, epoch=1)) != order
    assert list(data.EpochSampler(n, seed=4, epoch=0)) != order
    for start in (0, 1, 10, 36, 37):
        resumed = data.EpochSampler(n, seed=3, epoch=0, start=start)
        assert list(resumed) == order[start:]
        assert len(resumed) == n - start


def test_dataloader_starts_mid_epoch_exactly(tokenizer, small_data):
    ds, _ = data.tokenize_dataset(data.load_records(str(small_data)), tokenizer, 128)
    pad = tokenizer.pad_token_id
    full = list(data.build_dataloader(ds, 8, pad, seed=1, epoch=2))
    assert len(full) == len(ds) // 8
    resumed = list(data.build_dataloader(ds, 8, pad, seed=1, epoch=2, start_batch=3))
    assert len(resumed) == len(full) - 3
    for a, b in zip(full[3:], resumed):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


# ---- loaders -------------------------------------------------------------------------------------


def _write_format(fmt: str, tmp_path, records: list[dict]):
    import datasets

    if fmt == "jsonl":
        return write_jsonl(tmp_path / "d.jsonl", records)
    if fmt == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(records))
        return path
    if fmt == "parquet":
        path = tmp_path / "d.parquet"
        datasets.Dataset.from_list(records).to_parquet(str(path))
        return path
    if fmt == "save_to_disk":
        path = tmp_path / "saved"
        datasets.Dataset.from_list(records).save_to_disk(str(path))
        return path
    raise ValueError(fmt)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "save_to_disk"])
def test_load_records_formats(fmt, tmp_path, small_records):
    records = small_records[:12]
    path = _write_format(fmt, tmp_path, records)
    ds = data.load_records(str(path))
    assert len(ds) == len(records)
    assert [dict(r) for r in ds] == records


def test_load_records_text(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("First paragraph,\nstill first.\n\nSecond one.\n\n\n\nThird.\n")
    ds = data.load_records(str(path))
    assert ds["text"] == ["First paragraph,\nstill first.", "Second one.", "Third."]


def test_relative_path_falls_back_to_repo_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ds = data.load_records("data/arith/train.jsonl")
    assert len(ds) == 4000 and set(ds.column_names) == {"question", "answer"}


@needs_gsm8k
def test_named_gsm8k_uses_local_copy(tokenizer):
    assert data.resolve_source("gsm8k") == str(GSM8K)
    ds = data.load_records("gsm8k")
    assert len(ds) == sum(1 for line in GSM8K.open() if line.strip())
    assert set(ds.column_names) == {"question", "answer"}
    sample = tokenize_one(tokenizer, ds[0])
    n_prompt = 1 + len(encode(tokenizer, data.format_prompt(ds[0], ("question",))))
    assert sample["labels"][:n_prompt] == [IGNORE] * n_prompt
    assert sample["labels"][n_prompt:] == sample["input_ids"][n_prompt:]
    assert tokenizer.decode(sample["input_ids"][n_prompt:-1]) == ds[0]["answer"]


@needs_shakespeare
def test_named_tinyshakespeare_is_text():
    ds = data.load_records("tinyshakespeare")
    assert ds.column_names == ["text"] and len(ds) > 1000
    assert all(t.strip() == t and t for t in ds["text"][:100])


def test_hub_name_goes_to_the_hub(monkeypatch):
    import datasets

    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or "hub")
    assert data.load_records("someorg/some-dataset") == "hub"
    assert calls == [(("someorg/some-dataset",), {"split": "train"})]


# ---- bad input -----------------------------------------------------------------------------------


def test_malformed_jsonl_names_file_and_line(tmp_path, small_records):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in small_records[:4]]
    lines[2] = lines[2][:-5]  # cut the closing of the third record
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as e:
        data.load_records(str(path))
    assert f"{path}:3:" in str(e.value)


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"text": "ok"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r":2: expected a JSON object"):
        data.load_records(str(path))


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".txt"])
def test_non_utf8_names_file(tmp_path, suffix):
    path = tmp_path / f"latin1{suffix}"
    text = '{"text": "caf\u00e9"}\n' if suffix == ".jsonl" else ('[{"text": "caf\u00e9"}]' if suffix == ".json"
                                                                  else "caf\u00e9\n")
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(DataError) as e:
        data.load_records(str(path))
    assert str(path) in str(e.value)
    assert "UTF-8" in str(e.value)


def test_unknown_fields_listed(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"q": "1+1?", "a": "2"}, {"q": "2+2?", "a": "4"}])
    ds = data.load_records(str(path))
    with pytest.raises(DataError) as e:
        data.tokenize_dataset(ds, tokenizer, 64)
    assert "['a', 'q']" in str(e.value)
    assert "question/answer" in str(e.value)  # and the layouts it knows


def test_unknown_fields_error_names_the_file(tmp_path):
    from tunekit.config import tiny

    path = write_jsonl(tmp_path / "odd.jsonl", [{"q": "1+1?", "a": "2"}] * 8)
    with pytest.raises(DataError) as e:
        train.prepare(tiny(out_dir=str(tmp_path / "run"), data=str(path)), verbose=False)
    assert str(path) in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found") as e:
        data.load_records(str(tmp_path / "nope.jsonl"))
    assert "nope.jsonl" in str(e.value)


@pytest.mark.parametrize("content, match", [
    ("", "no records"),
    ("\n\n", "no records"),
])
def test_empty_file(tmp_path, content, match):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=match):
        data.load_records(str(path))


def test_json_that_is_not_a_list(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text('{"question": "q", "answer": "a"}')
    with pytest.raises(DataError, match="list"):
        data.load_records(str(path))


def test_unknown_suffix(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("question,answer\n1,2\n")
    with pytest.raises(DataError, match=r"\.csv"):
        data.load_records(str(path))


@pytest.mark.parametrize("rec, field", [
    ({"question": "What is 2+2?", "answer": "   "}, "answer"),
    ({"question": "What is 2+2?", "answer": ""}, "answer"),
    ({"question": "  ", "answer": "4"}, "question"),
])
def test_empty_response_or_prompt(tmp_path, tokenizer, small_records, rec, field):
    records = small_records[:3] + [rec]
    ds = data.load_records(str(write_jsonl(tmp_path / "d.jsonl", records)))
    with pytest.raises(DataError) as e:
        data.tokenize_dataset(ds, tokenizer, 64)
    assert f"'{field}'" in str(e.value)
    assert "record 4" in str(e.value)  # 1-based: the bad record's line in the file
