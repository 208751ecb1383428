"""Fine-tune a causal LM on GSM8K with TRL's SFTTrainer and a LoRA adapter, plus tunekit's speed-ups.

A plain TRL script, and the two lines (marked `# tunekit`) that give it tunekit's fast path: the fused LoRA
linear, regional compile and the attention kernel for packed rows (`tunekit.speed_up`), and packing with each
sample attending only to itself (`tunekit.PackingCollator`). Everything else is TRL's and transformers' own.

    pip install -e ".[trl]"
    python examples/sft_trl.py --model Qwen/Qwen2.5-7B                # hub model and dataset, tunekit's speed-ups on
    python examples/sft_trl.py --model Qwen/Qwen2.5-7B --no-tunekit   # the same script, plain TRL
    python examples/sft_trl.py --model DIR --data train.jsonl         # a local model folder and GSM8K file

Without a GPU it runs in fp32 on the CPU (slowly: use a tiny model, as tests/e2e/test_examples.py does).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
from trl import SFTConfig, SFTTrainer

import tunekit


def gsm8k(source: str = "openai/gsm8k", limit: int = 0):
    """GSM8K as TRL's prompt-completion records (the loss on the answer only): a local JSONL file of its
    `question`/`answer` records, or the hub dataset of that name."""
    if Path(source).exists():
        ds = load_dataset("json", data_files=str(source), split="train")
    else:
        ds = load_dataset(source, "main", split="train")
    if limit:
        ds = ds.select(range(min(limit, len(ds))))
    return ds.map(lambda r: {"prompt": f"Question: {r['question']}\nAnswer: ", "completion": r["answer"]},
                  remove_columns=ds.column_names)


def with_lora(model, r: int = 16):
    """A LoRA adapter on every linear layer, as peft's docs write it (no dropout: the fused LoRA needs none)."""
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear",
                                            task_type="CAUSAL_LM"))


def trainer_for(model, tokenizer, dataset, out_dir: str, *, fast: bool = True, packing: bool = False,
                batch_size: int = 32, max_length: int = 2048, max_steps: int = -1, lr: float = 2e-4,
                compile: str = "regional", **config) -> SFTTrainer:
    """The SFTTrainer of this script: plain TRL (`fast=False`, `packing` its own), or with tunekit's speed-ups.
    `batch_size` is samples per step, packed or not; with TRL's own packing it counts packed rows.
    `config`: any other `SFTConfig` field."""
    collator = None
    if fast:
        model = tunekit.speed_up(model, compile=compile, attention="auto", packed=True)  # tunekit
        collator = tunekit.PackingCollator(tokenizer.pad_token_id, max_length=max_length)  # tunekit
    args = SFTConfig(output_dir=out_dir, per_device_train_batch_size=batch_size, max_length=max_length,
                     max_steps=max_steps, learning_rate=lr, packing=packing, bf16=torch.cuda.is_available(),
                     gradient_checkpointing=False, save_strategy="no", report_to="none",
                     **{"logging_steps": 10, **config})
    return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                      data_collator=collator)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a hub name or a local model folder")
    p.add_argument("--tokenizer", default="", help="default: the model's")
    p.add_argument("--data", default="openai/gsm8k", help="a GSM8K JSONL file or the hub dataset name")
    p.add_argument("--limit", type=int, default=0, help="train on the first N records (0: all)")
    p.add_argument("--tunekit", action=argparse.BooleanOptionalAction, default=True, help="tunekit's speed-ups")
    p.add_argument("--compile", default="regional", choices=("none", "regional"))
    p.add_argument("--batch-size", type=int, default=32, help="samples per step")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--max-steps", type=int, default=-1, help="-1: one epoch")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0, help="the adapter's initialisation")
    p.add_argument("--out", default="runs/sft-trl")
    a = p.parse_args(argv)

    gpu = torch.cuda.is_available()
    set_seed(a.seed)
    tokenizer = AutoTokenizer.from_pretrained(a.tokenizer or a.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16 if gpu else torch.float32,
                                                 device_map="cuda" if gpu else None)
    model = with_lora(model)
    trainer = trainer_for(model, tokenizer, gsm8k(a.data, a.limit), a.out, fast=a.tunekit, batch_size=a.batch_size,
                          max_length=a.max_length, max_steps=a.max_steps, lr=a.lr, compile=a.compile,
                          logging_steps=a.logging_steps)
    out = trainer.train()
    trainer.save_model(a.out)
    print(f"trained {out.global_step} steps, loss {out.training_loss:.4f}; adapter saved in {a.out}")
    return {"steps": out.global_step, "loss": out.training_loss,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}


if __name__ == "__main__":
    main()
