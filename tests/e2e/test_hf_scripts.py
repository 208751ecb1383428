"""tunekit's speed-ups in a user's own script: a few steps of transformers' `Trainer` and of TRL's `SFTTrainer`
(examples/sft_trl.py, run as a user runs it) with `tunekit.speed_up` and `tunekit.PackingCollator` give the losses
of the same script without them. fp32 on the CPU, where packing and the fused paths compute the same numbers:
the losses agree to 1e-4 (relative) over the steps, the updates included."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch
from helpers import SMALL_ARCH, read_arith

import tunekit
from tunekit import model as mdl
from tunekit.config import REPO_ROOT
from tunekit.data.batching import IGNORE
from tunekit.data.records import shared_data

GSM8K = shared_data() / "gsm8k" / "train.jsonl"
needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl not installed (the trl extra)")


def tiny_lora(vocab: int):
    model = mdl.build_model(mdl.llama_config(vocab_size=vocab, **SMALL_ARCH), seed=0)
    torch.manual_seed(1)
    return mdl.apply_lora(model, r=4, alpha=8)


def trainer_losses(model, dataset, collator, tmp_path, steps: int = 4) -> list[float]:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=steps,
                             learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none",
                             use_cpu=True, seed=0, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_with_speed_up_and_packing_gives_the_plain_losses(tokenizer, tmp_path):
    from datasets import Dataset
    from transformers import DataCollatorForSeq2Seq

    rows = []
    for r in read_arith(48):
        prompt = tokenizer(r["question"] + "\n")["input_ids"]
        answer = tokenizer(r["answer"])["input_ids"] + [tokenizer.eos_token_id]
        rows.append({"input_ids": prompt + answer, "labels": [IGNORE] * len(prompt) + answer})
    dataset = Dataset.from_list(rows)
    plain = tiny_lora(len(tokenizer))
    fast = tunekit.speed_up(copy.deepcopy(plain), verbose=False)
    want = trainer_losses(plain, dataset, DataCollatorForSeq2Seq(tokenizer, padding=True), tmp_path / "plain")
    got = trainer_losses(fast, dataset, tunekit.PackingCollator(tokenizer.pad_token_id, max_length=256),
                         tmp_path / "fast")
    assert len(got) == len(want) == 4 and want[-1] < want[0]  # it trains
    assert got == pytest.approx(want, rel=1e-4)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, tokenizer):
    """A tiny random-init Llama and the offline tokenizer, saved as a hub download lays them out."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    mdl.build_model(mdl.llama_config(vocab_size=len(tokenizer), **SMALL_ARCH), seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_example(*args: str) -> dict:
    spec = importlib.util.spec_from_file_location("sft_trl", REPO_ROOT / "examples" / "sft_trl.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.main(list(args))


@needs_trl
@pytest.mark.skipif(not GSM8K.exists(), reason=f"real GSM8K not present at {GSM8K}")
@pytest.mark.slow
def test_the_sft_trainer_example_with_tunekit_gives_the_plain_trl_losses(model_folder, tmp_path):
    common = ["--model", str(model_folder), "--data", str(GSM8K), "--limit", "64", "--batch-size", "8",
              "--max-steps", "4", "--logging-steps", "1", "--max-length", "512", "--lr", "1e-2"]
    plain = run_example(*common, "--no-tunekit", "--out", str(tmp_path / "plain"))
    fast = run_example(*common, "--compile", "none", "--out", str(tmp_path / "fast"))
    assert plain["steps"] == fast["steps"] == 4 and plain["losses"][-1] < plain["losses"][0]
    assert fast["losses"] == pytest.approx(plain["losses"], rel=1e-4)
    saved = json.loads((tmp_path / "fast" / "adapter_config.json").read_text())  # the adapter, as peft saves it
    assert saved["peft_type"] == "LORA" and (tmp_path / "fast" / "adapter_model.safetensors").exists()
