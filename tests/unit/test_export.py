"""A finished run made usable: its adapter loads onto the rebuilt base and gives the trained model's numbers,
merges into a plain model that `from_pretrained` reads back, and generates."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL_ARCH

from tunekit import export, train
from tunekit.build import collator
from tunekit.prepare import prepare, split_eval
from tunekit.presets import tiny
from tunekit.step import StepModule, evaluate


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, small_data):
    cfg = tiny(out_dir=str(tmp_path_factory.mktemp("runs") / "run"), data=str(small_data), max_steps=6,
                      batch_size=4, max_length=128, warmup_steps=1, eval_split=0.2, packing="pad", **SMALL_ARCH)
    return cfg, train.train(cfg, progress=False)


def test_the_loaded_run_is_the_trained_model(finished_run):
    """The base drawn again from the seed plus the saved adapter give the held-out loss the run reported."""
    cfg, summary = finished_run
    model, tokenizer, saved = export.load_run(cfg.run_dir(), dtype=torch.float32)
    assert saved.method == "lora" and not model.training and next(model.parameters()).dtype == torch.float32
    _, ds, stats = prepare(cfg, verbose=False)
    _, held = split_eval(ds, cfg, tokenizer, stats)
    step = StepModule(model, "plain")
    got = evaluate(step, model, held, cfg.batch_size, collator(cfg, tokenizer.pad_token_id), "cpu")
    assert got == pytest.approx(summary["eval_loss"], rel=1e-5)


def test_merge_run_gives_the_same_logits_and_reloads(finished_run, tmp_path):
    cfg, _ = finished_run
    r = export.merge_run(cfg.run_dir(), tmp_path / "merged", dtype=torch.float32)
    assert r["merged_vs_adapter"] < 1e-5 and r["reloaded_vs_merged"] < 1e-6
    assert (tmp_path / "merged" / "config.json").exists() and (tmp_path / "merged" / "tokenizer.json").exists()


def test_generate_and_prompts(finished_run, small_data):
    cfg, _ = finished_run
    pairs = export.prompts_from(str(small_data), n=2)
    assert len(pairs) == 2 and pairs[0][0].startswith("Question: ") and pairs[0][0].endswith("Answer: ")
    outs = export.generate(cfg.run_dir(), [p for p, _ in pairs], max_new_tokens=8, dtype=torch.float32)
    assert len(outs) == 2 and all(isinstance(o, str) for o in outs)


def test_an_unfinished_run_says_so(tmp_path, small_data):
    cfg = tiny(out_dir=str(tmp_path / "run"), data=str(small_data), max_steps=4, save_every=2, batch_size=4,
                      max_length=128, **SMALL_ARCH)
    train.train(cfg, stop_after=2, progress=False)
    with pytest.raises(FileNotFoundError, match="no saved adapter"):
        export.load_run(cfg.run_dir())


def test_the_cli_exports_and_generates(finished_run, tmp_path, capsys):
    from tunekit import cli

    cfg, _ = finished_run
    assert cli.main(["export", str(cfg.run_dir()), "--out", str(tmp_path / "m"), "--dtype", "fp32"]) == 0
    assert "merged -> " in capsys.readouterr().out and (tmp_path / "m" / "config.json").exists()
    assert cli.main(["generate", str(cfg.run_dir()), "Question: 2 + 2?\nAnswer: ", "--max-new-tokens", "4"]) == 0
    assert "Question: 2 + 2?" in capsys.readouterr().out
    assert cli.main(["export", str(tmp_path / "nowhere")]) == 2
    assert "no config file there" in capsys.readouterr().err


def test_a_bf16_merge_keeps_the_buffers_and_reloads_exactly(finished_run, tmp_path):
    """The weights go to bf16, RoPE's frequencies stay fp32 (cast, they would shift every position), so the
    model reloaded from disk is the merged one to the last bit."""
    cfg, _ = finished_run
    r = export.merge_run(cfg.run_dir(), tmp_path / "m16", dtype=torch.bfloat16)
    assert r["reloaded_vs_merged"] == 0.0 and r["merged_vs_adapter"] < 2e-2
    # both bf16 models approximate the fp32 computation of the same weights and adapter to bf16's precision
    assert 0 < r["adapter_vs_fp32"] < 2e-2 and 0 < r["merged_vs_fp32"] < 2e-2


def test_a_run_loads_from_another_folder(tmp_path, small_data, monkeypatch):
    """A run started with a relative --out-dir is found by the path given, wherever the command runs."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    cfg = tiny(out_dir="runs/x", data=str(small_data), max_steps=2, batch_size=4, max_length=128,
                      **SMALL_ARCH)
    train.train(cfg, progress=False)
    monkeypatch.chdir(tmp_path / "b")
    _, tokenizer, saved = export.load_run(tmp_path / "a" / "runs" / "x", dtype=torch.float32)
    assert saved.out_dir == "runs/x" and len(tokenizer) > 0
