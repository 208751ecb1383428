"""The `tunekit` command: help texts, one real run of each subcommand, and exit code 2 on bad input."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import SMALL_ARCH_ARGS

from tunekit import arguments, cli
from tunekit.config import REPO_ROOT, RESUME_SAFE_FIELDS, TuneConfig

SUBCOMMANDS = ["train", "bench", "prepare", "doctor"]


def run_main(argv: list[str]) -> int:
    """`cli.main(argv)`'s exit code, whether it returns it or raises SystemExit (argparse does for --help)."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


def small_args(tmp_path, data, *extra: str) -> list[str]:
    return ["--preset", "tiny", "--out-dir", str(tmp_path / "run"), "--data", str(data), "--batch-size", "8",
            "--max-length", "64", *SMALL_ARCH_ARGS, *extra]


# ---- help ----------------------------------------------------------------------------------------


def test_top_level_help(capsys):
    assert run_main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_subcommand_help(command, capsys):
    assert run_main([command, "--help"]) == 0
    assert f"tunekit {command}" in capsys.readouterr().out


def test_train_help_lists_fields_with_docs(capsys):
    assert run_main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    flat = "".join(out.split())  # help wraps lines (also at hyphens): compare with whitespace removed
    docs = arguments.field_docs()
    for f in dataclasses.fields(TuneConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in out, flag
        assert docs.get(f.name), f"TuneConfig.{f.name} has no docstring"
        assert "".join(docs[f.name].split()) in flat, f.name
    assert "Optimizer steps to run (the cosine schedule spans them)." in out and f"--max-steps INT (default {TuneConfig().max_steps})" in out


def test_help_via_subprocess():
    proc = subprocess.run([sys.executable, "-m", "tunekit.cli", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "train" in proc.stdout and "doctor" in proc.stdout


@pytest.mark.skipif(shutil.which("tunekit") is None, reason="the tunekit console script is not on PATH")
def test_console_script():
    proc = subprocess.run(["tunekit", "train", "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "--max-steps" in proc.stdout


# ---- real runs -----------------------------------------------------------------------------------


def test_train(tmp_path, small_data, capsys):
    assert run_main(["train", *small_args(tmp_path, small_data, "--max-steps", "3", "--lr=1e-3")]) == 0
    run = tmp_path / "run"
    for name in ("config.json", "metrics.jsonl", "summary.json", "adapter/adapter_config.json",
                 "adapter/adapter_model.safetensors"):
        assert (run / name).exists(), name
    saved = json.loads((run / "config.json").read_text())
    assert (saved["max_steps"], saved["lr"], saved["hidden_size"]) == (3, 1e-3, 64)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
    out = capsys.readouterr().out
    assert "done: 3 steps" in out and str(run) in out
    # --resume after a finished run: nothing left to do, and it says so.
    assert run_main(["train", "--resume", *small_args(tmp_path, small_data, "--max-steps", "3", "--lr=1e-3")]) == 0
    assert "nothing to do" in capsys.readouterr().out


# ---- runs that never lose work -------------------------------------------------------------------


def test_a_second_run_into_the_same_folder_is_refused(tmp_path, small_data, capsys):
    assert run_main(["train", *small_args(tmp_path, small_data, "--max-steps", "2")]) == 0
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert run_main(["train", *small_args(tmp_path, small_data, "--max-steps", "2", "--seed", "1")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tunekit train: error: {tmp_path / 'run'} holds another run")
    assert "--overwrite" in err and "--resume" in err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics
    assert run_main(["train", "--overwrite", *small_args(tmp_path, small_data, "--max-steps", "2", "--seed", "1")]) == 0
    assert "overwrite: removed the earlier run's" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "config.json").read_text())["seed"] == 1


def test_divergence_exits_1_with_one_line_and_keeps_the_metrics(tmp_path, small_data, capsys):
    argv = small_args(tmp_path, small_data, "--max-steps", "6", "--lr", "1e20", "--max-grad-norm", "0",
                      "--warmup-steps", "0")  # the first update throws the weights past fp32's range
    assert run_main(["train", *argv]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("tunekit train: diverged at step 2: loss nan")
    assert "last finite loss" in err and "last good checkpoint: none" in err

    def refuse(token):
        raise ValueError(f"{token} written to metrics.jsonl")

    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=refuse) for line in lines]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] is None and rows[0]["loss"] > 0


def test_resume_with_a_changed_config(tmp_path, small_data, capsys):
    assert run_main(["train", *small_args(tmp_path, small_data, "--max-steps", "4", "--save-every", "2")]) == 0
    capsys.readouterr()
    assert run_main(["train", "--resume", *small_args(tmp_path, small_data, "--max-steps", "4", "--lr", "1e-3")]) == 2
    err = capsys.readouterr().err
    assert "lr: 0.003 -> 0.001" in err and "save_every: 2 -> 0" in err and "cannot change" in err
    longer = small_args(tmp_path, small_data, "--max-steps", "6", "--save-every", "2")
    assert run_main(["train", "--resume", *longer]) == 2
    err = capsys.readouterr().err
    assert "max_steps: 4 -> 6" in err and "--allow-config-change" in err
    assert run_main(["train", "--resume", "--allow-config-change", *longer]) == 0
    out = capsys.readouterr().out
    assert "resume: max_steps: 4 -> 6 (--allow-config-change)" in out and "done: 6 steps" in out


@pytest.mark.parametrize("argv, expected", [
    (["train", "--resum"], "did you mean --resume?"),
    (["train", "--overwr"], "did you mean --overwrite?"),
    (["train", "--allow-config"], "did you mean --allow-config-change?"),
    (["bench", "--rep", "2"], "did you mean --repeat?"),
    (["results", "--update"], "--update"),
])
def test_options_are_never_abbreviated(argv, expected, tmp_path, capsys):
    assert run_main([*argv, "--out-dir", str(tmp_path / "run")] if argv[0] != "results" else argv) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_train_help_says_what_may_change_on_resume(capsys):
    assert run_main(["train", "--help"]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert "--overwrite" in flat and "--allow-config-change" in flat
    for name in RESUME_SAFE_FIELDS:
        assert name in flat, name


def test_bench(tmp_path, small_data, capsys):
    out = tmp_path / "results" / "mine.json"
    argv = ["bench", *small_args(tmp_path, small_data, "--bench-warmup", "1", "--bench-steps", "2",
                                 "--bench-max-steps", "2"), "--name", "cli-tiny", "--out", str(out)]
    assert run_main(argv) == 0
    result = json.loads(out.read_text())
    assert result["name"] == "cli-tiny" and result["tokens_per_s"] > 0 and len(result["step_times_s"]) == 2
    assert str(out) in capsys.readouterr().out
    # ...and `results` reads it back into a table.
    if "results" in arguments.make_parser()._subparsers._group_actions[0].choices:
        assert run_main(["results", str(out.parent)]) == 0
        assert "cli-tiny" in capsys.readouterr().out


def test_bench_repeat_measures_run_to_run_noise(tmp_path, small_data, capsys):
    out = tmp_path / "noise.json"
    argv = ["bench", *small_args(tmp_path, small_data, "--bench-warmup", "1", "--bench-steps", "2",
                                 "--bench-max-steps", "2"), "--repeat", "2", "--name", "noise_tiny", "--out", str(out)]
    assert run_main(argv) == 0
    r = json.loads(out.read_text())
    medians = [run["step_time_s"] for run in r["runs"]]
    assert len(medians) == 2 and r["name"] == "noise_tiny" and r["config"]["batch_size"] > 0
    assert r["between_run_spread"] == pytest.approx((max(medians) - min(medians)) / (sum(medians) / 2), abs=1e-3)
    assert r["call"].startswith("bench.measure_noise(")


def test_prepare(tmp_path, small_data, capsys):
    assert run_main(["prepare", *small_args(tmp_path, small_data)]) == 0
    prepared = tmp_path / "run" / "prepared"
    stats = json.loads((prepared / "stats.json").read_text())
    assert stats["samples"] == 64 and stats["max_length"] == 64
    assert (prepared / "dataset").is_dir() and (prepared / "tokenizer").is_dir()
    assert "64 samples" in capsys.readouterr().out


def test_doctor(capsys):
    assert run_main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "transformers" in out and "python" in out


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, expected", [
    (["train", "--preset", "nope"], "unknown preset 'nope'"),
    (["train", "--bogus", "1"], "--bogus"),
    (["train", "--batch-size", "abc"], "--batch-size"),
    (["bench", "--lr", "0"], "'lr'"),
    (["prepare", "--method", "bogus"], "'method'"),
    (["train", "--data", "/nonexistent.jsonl"], "/nonexistent.jsonl"),
    (["train", "--lora-alpha", "0"], "'lora_alpha'"),  # a LoRA scale of 0 would train nothing
    (["train", "--lr", "inf"], "'lr'"),
    (["train", "--keep-checkpoints", "0"], "'keep_checkpoints'"),
    (["train", "--resume", "--overwrite"], "--overwrite"),
])
def test_bad_input_exits_2_with_message(argv, expected, tmp_path, capsys):
    argv = [*argv, "--out-dir", str(tmp_path / "run"), *SMALL_ARCH_ARGS]
    assert run_main(argv) == 2
    err = capsys.readouterr().err
    assert f"tunekit {argv[0]}: error:" in err
    assert expected in err


def test_unwritable_out_dir_exits_2(tmp_path, small_data, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert run_main(["train", "--out-dir", str(blocker / "run"), "--data", str(small_data)]) == 2
    assert str(blocker / "run") in capsys.readouterr().err


def test_bad_data_file_exits_2_naming_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "2"}\n{"question": \n')
    assert run_main(["prepare", "--out-dir", str(tmp_path / "run"), "--data", str(bad)]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err


def test_unknown_subcommand_is_a_usage_error(capsys):
    assert run_main(["fly"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_results_missing_path_exits_2(tmp_path, capsys):
    assert run_main(["results", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_estimate_prints_the_parts_and_matches_the_library(capsys):
    from tunekit import estimate
    from tunekit.presets import llama7b_qlora

    assert cli.main(["estimate", "--preset", "llama7b_qlora", "--batch-size", "1"]) == 0
    out = capsys.readouterr().out
    expected = estimate.estimate_memory_for(estimate.Setup.of(llama7b_qlora(batch_size=1)))
    assert estimate.format_estimate(expected) in out and "weights" in out


def test_estimate_without_vocab_size_exits_2(capsys):
    assert cli.main(["estimate", "--preset", "tiny"]) == 2
    assert "--vocab-size" in capsys.readouterr().err


def test_estimate_with_memory_says_what_fits(capsys):
    assert cli.main(["estimate", "--preset", "llama7b_qlora", "--memory-gb", "24"]) == 0
    out = capsys.readouterr().out
    assert "fits 24 GB up to micro-batch 16 x 2048 counting reserved memory" in out and "--batch-size 8" in out
    assert "20 counting allocated memory alone" in out  # the estimate without the allocator's fragmentation


def test_estimate_that_cannot_fit_names_what_would(capsys):
    # bf16 7B LoRA does not fit 10 GB even at batch 1: the message lists the changes and their estimates.
    assert cli.main(["estimate", "--preset", "llama7b_lora", "--memory-gb", "10"]) == 1
    out = capsys.readouterr().out
    assert "even micro-batch 1 does not fit" in out
    assert "--method qlora" in out and "--grad-ckpt" in out and "--embed-offload" in out


def test_fit_needs_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine fit runs for real (tests/gpu/test_gpu.py)")
    assert cli.main(["fit", "--preset", "tiny", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
