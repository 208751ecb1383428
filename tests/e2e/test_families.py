"""Model families other than Llama through `tunekit train --model DIR` and on to `export` and `generate`: local
random-init folders laid out as a hub download (config classes + `save_pretrained`), with the offline tokenizer.
Qwen2 (a bias on q/k/v) with the fused LoRA and regional compile; Gemma 2 (soft-capped logits, no SDPA path in
transformers) with the defaults, whose chunked loss and attention must both take what the family has."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from tunekit import cli, export, train
from tunekit.presets import tiny

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 512}
FAMILIES = {"qwen2": (transformers.Qwen2Config, {}),
            "gemma2": (transformers.Gemma2Config, {"head_dim": 16, "final_logit_softcapping": 30.0})}


def family_folder(path, family: str, tokenizer):
    config_cls, extra = FAMILIES[family]
    config = config_cls(**SHAPE, **extra, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("family, switches", [("qwen2", {"fast_lora": True, "compile": "regional"}),
                                              ("gemma2", {})])
def test_a_family_trains_exports_and_generates(family, switches, tokenizer, small_data, tmp_path, capsys):
    model_dir = family_folder(tmp_path / family, family, tokenizer)
    cfg = tiny(model=str(model_dir), out_dir=str(tmp_path / "run"), data=str(small_data), max_steps=3,
               batch_size=4, max_length=128, warmup_steps=1, vocab_size=0, **switches)
    summary = train.train(cfg)  # progress on: it says what it built
    out = capsys.readouterr().out
    assert summary["steps"] == 3 and all(math.isfinite(x) for x in summary["losses"])
    if family == "gemma2":
        assert "eager, as Gemma2ForCausalLM has no sdpa path" in out and "loss chunked" in out
    else:
        assert "fused LoRA in 14 linear layers" in out
    assert cli.main(["export", str(cfg.run_dir()), "--out", str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    merged = transformers.AutoConfig.from_pretrained(tmp_path / "merged")
    assert merged.model_type == family
    outs = export.generate(cfg.run_dir(), ["Question: 2 + 2?\nAnswer: "], max_new_tokens=4, dtype=torch.float32)
    assert len(outs) == 1 and isinstance(outs[0], str)
