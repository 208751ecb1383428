"""tunekit from a script: `finetune` on records in memory, and what it hands back (the model and tokenizer)."""

from __future__ import annotations

import datasets
import pytest
import torch

import tunekit
from tunekit.config import ConfigError
from tunekit.data.layouts import DataError
from tunekit.data.records import save_records


def test_finetune_trains_on_records_in_memory_and_hands_back_the_model(make_cfg, small_records, small_data):
    cfg = make_cfg("in-memory", data="a file that is not there")  # `data=` replaces the config's source
    summary = tunekit.finetune(cfg, data=small_records)
    assert summary["steps"] == cfg.max_steps and summary["final_loss"] is not None
    trained_on = summary["data"]["data"]
    assert trained_on == str(save_records(small_records)) and trained_on.endswith(".jsonl")
    # the same records are the same file: a resume of the run finds its config unchanged, and nothing to do
    assert tunekit.finetune(cfg, data=list(small_records), resume=True)["steps"] == cfg.max_steps
    model, tokenizer = summary.load()
    assert not model.training and hasattr(model, "peft_config")
    ids = torch.tensor([tokenizer("Question: 1+1?\nAnswer: ")["input_ids"]])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
    # what was loaded is what was trained: the adapter's weights, as the run saved them
    saved = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert saved and any(float(p.abs().sum()) > 0 for n, p in saved.items() if "lora_B" in n)


def test_finetune_takes_a_datasets_dataset(make_cfg, small_records):
    ds = datasets.Dataset.from_list(small_records)
    summary = tunekit.finetune(make_cfg("dataset", max_steps=2), data=ds)
    assert summary["steps"] == 2 and summary["data"]["data"] == str(save_records(small_records))


@pytest.mark.parametrize("data, words", [
    ([{"question": "q", "answer": "a"}, 7], "record 2 is a number, expected an object"),
    ([{"question": "q", "answer": float("nan")}], "record 1"),
    ("data/arith/train.jsonl", "goes in the config's `data` field"),
    ([], "no records"),
])
def test_records_that_cannot_be_written_are_named(make_cfg, data, words):
    with pytest.raises(DataError, match=words):
        tunekit.finetune(make_cfg("bad"), data=data)


@pytest.mark.parametrize("field, value, words", [
    ("lr", "1e-3", "config field 'lr' = '1e-3': expected float"),
    ("batch_size", 8.0, "config field 'batch_size' = 8.0: expected int"),
    ("batch_size", True, "config field 'batch_size' = True: expected int"),
    ("grad_ckpt", 1, "config field 'grad_ckpt' = 1: expected bool"),
    ("data", [{"question": "q"}], "expected str .* finetune\\(cfg, data=...\\)"),
])
def test_a_field_of_the_wrong_type_is_named_with_the_type_it_needs(field, value, words):
    with pytest.raises(ConfigError, match=words):
        tunekit.get_preset("tiny", **{field: value})
    cfg = tunekit.get_preset("tiny")
    setattr(cfg, field, value)  # set after construction: the entry points validate again
    with pytest.raises(ConfigError, match=words):
        cfg.validate()


def test_a_whole_number_for_a_float_field_is_taken_as_that_float():
    assert tunekit.get_preset("tiny", lr=1).lr == 1.0 and isinstance(tunekit.get_preset("tiny", lr=1).lr, float)
