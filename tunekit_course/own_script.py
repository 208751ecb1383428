"""What the lessons' "In your own script" cells start from: the parts a user's own `transformers` script already
has — a causal LM with a peft LoRA adapter, its tokenizer, tokenized training records — made tiny, so each cell
runs its lesson's lines for real in seconds, on a CPU as on a GPU. In a script of your own they are
`AutoModelForCausalLM.from_pretrained(...)`, `get_peft_model(...)`, `AutoTokenizer.from_pretrained(...)` and your
data; the lines the lessons add to them are the same.
"""

from __future__ import annotations

import json
import logging
import warnings

import torch

from tunekit.data.batching import IGNORE
from tunekit.data.tokenizer import train_tokenizer

DATA = "data/arith/train.jsonl"  # the project's question/answer records (GSM8K-like, generated)


def records(n: int = 256) -> list[dict]:
    """The first `n` question/answer records of the project's arithmetic data."""
    from tunekit.config import REPO_ROOT

    with open(REPO_ROOT / DATA) as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def tokenizer_for(rows: list[dict]):
    """A byte-level BPE trained offline on the records (a hub tokenizer in your script)."""
    return train_tokenizer((f"{r['question']}\n{r['answer']}" for r in rows), 1024)


def tokenize(record: dict, tokenizer, max_length: int = 512) -> dict:
    """A question/answer record as `input_ids` and `labels`, the loss on the answer only (-100 on the question)."""
    prompt = tokenizer(record["question"] + "\n")["input_ids"]
    answer = tokenizer(record["answer"])["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt + answer)[:max_length]
    return {"input_ids": ids, "labels": ([IGNORE] * len(prompt) + answer)[:max_length]}


def quiet() -> None:
    """Leave out what the libraries warn about a tiny demonstration (for the rest of the kernel's life): the
    deprecations transformers raises from its own code and from arguments it still takes, PyTorch's pinned
    memory without a GPU, transformers' and TRL's notices about a tokenizer trained apart from the model. The
    cells' output is then the lesson's, and JupyterLab shows nothing in red that the learner did not cause."""
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    warnings.filterwarnings("ignore", message=".*pin_memory.*no accelerator is found", category=UserWarning)
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("trl").setLevel(logging.ERROR)


def parts(n: int = 256, lora: bool = True):
    """(model, tokenizer, tokenized `datasets.Dataset`): a random-init 2-layer Llama (bf16 on a GPU, fp32 on a
    CPU) with a rank-8 LoRA adapter on every linear layer, as `get_peft_model` attaches it. `quiet()` first."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model

    from tunekit import model as mdl

    quiet()

    rows = records(n)
    tokenizer = tokenizer_for(rows)
    gpu = torch.cuda.is_available()
    model = mdl.build_model(mdl.llama_config(128, 2, 4, 256, len(tokenizer), 4, 1024), "",
                            torch.bfloat16 if gpu else torch.float32, "cuda" if gpu else "cpu", "sdpa", seed=0)
    if lora:
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    data = Dataset.from_list([tokenize(r, tokenizer) for r in rows])
    return model, tokenizer, data


def losses(trainer) -> list[float]:
    """The training losses a `Trainer` logged, rounded for printing."""
    return [round(h["loss"], 3) for h in trainer.state.log_history if "loss" in h]


def data_file() -> str:
    """The records' file (question/answer JSONL, as GSM8K's): what `examples/sft_trl.py --data` reads."""
    from tunekit.config import REPO_ROOT

    return str(REPO_ROOT / DATA)
