"""Tokenizers: from the hub or a local folder, or a byte-level BPE trained offline on the training text and
cached (https://huggingface.co/docs/tokenizers), so everything runs with no hub at all.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from tunekit.hub import load_pretrained
from tunekit.io import atomic_output, cache_dir

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """A tokenizer from the hub or a local folder; gets a pad token if it has none (Llama has none)."""
    from transformers import AutoTokenizer

    tok = load_pretrained(AutoTokenizer, name_or_path, "model or tokenizer", trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int, cache: Path | None = None):
    """Train a byte-level BPE on `texts`, or load it from the cache when the same texts and size were seen.

    Byte-level means every string encodes (no unknown token), as with GPT-2 and Llama-3 tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(texts)
    digest = hashlib.sha256(f"bpe-v1|{vocab_size}|".encode())
    for t in texts:
        digest.update(t.encode())
        digest.update(b"\0")
    folder = (cache or cache_dir() / "tokenizers") / digest.hexdigest()[:16]
    if (folder / "tokenizer.json").exists():
        return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                       bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(texts, trainer=trainer)
    with atomic_output(folder, keep_existing=True) as tmp:  # another process may cache it first
        tmp.mkdir()
        tk.save(str(tmp / "tokenizer.json"))
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                   bos_token=BOS, eos_token=EOS, pad_token=PAD)
