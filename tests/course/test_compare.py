"""`tunekit bench --compare`: the stacks run in their own processes on the same weights and tokens, agree on the
loss, and a stack that cannot run is recorded with the reason, not dropped."""

from __future__ import annotations

import json

import pytest
from helpers import SMALL_ARCH_ARGS

from tunekit_course import compare


@pytest.fixture(scope="module")
def fields(small_data):
    return ["--data", str(small_data), "--batch-size", "2", "--max-length", "32", "--bench-warmup", "1",
            "--bench-steps", "2", "--bench-max-steps", "2", *SMALL_ARCH_ARGS]


@pytest.fixture(scope="module")
def result(fields, tmp_path_factory):
    missing = tmp_path_factory.mktemp("nosite") / "absent"
    return compare.run_compare("tiny", fields, "cmp", unsloth_site=str(missing), verbose=False)


def test_the_plain_stack_and_tunekit_compute_the_same_loss(result):
    rows = {r["stack"]: r for r in result["stacks"]}
    assert list(rows) == list(compare.STACKS)
    for stack in ("hf_peft", "tunekit"):
        assert rows[stack]["tokens_per_s"] > 0 and len(rows[stack]["step_times_s"]) == 2
    # same random init and adapters (same seeds), same tokens: the first losses agree to fp32 rounding
    assert result["loss_agreement"] < 1e-5
    assert rows["hf_peft"]["first_loss"] == pytest.approx(rows["tunekit"]["first_loss"], rel=1e-5)
    assert result["ratios"] == {"tunekit_vs_hf_peft": pytest.approx(
        rows["tunekit"]["tokens_per_s"] / rows["hf_peft"]["tokens_per_s"], rel=1e-3)}
    assert result["tokens_per_s"] == rows["tunekit"]["tokens_per_s"] and result["code_hash"]


def test_a_missing_unsloth_site_is_a_skipped_row_that_says_why(result):
    row = result["stacks"][-1]
    assert row["stack"] == "unsloth" and "python -m tunekit_course.unsloth_site" in row["skipped"] and "tokens_per_s" not in row


def test_a_stack_that_fails_is_recorded_with_its_error(fields, tmp_path):
    site = tmp_path / "site"  # a folder without Unsloth in it: the child fails to import it
    site.mkdir()
    r = compare.run_compare("tiny", fields, "cmp", stacks=("unsloth",), unsloth_site=str(site), verbose=False)
    assert r["stacks"][0]["stack"] == "unsloth" and "unsloth" in r["stacks"][0]["error"]
    assert r["tokens_per_s"] is None and r["ratios"] == {} and r["loss_agreement"] is None


def test_chart_and_cli(fields, tmp_path, result, capsys):
    png = compare.save_chart(result, tmp_path / "c.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    fig = compare.plot_compare({**result, "commit": "0123456789abcdef"})
    title = fig.get_suptitle()
    assert "0123456" not in title and result["name"] not in title and result["gpu"] in title  # provenance: the file's
    rows = [r for r in result["stacks"] if "tokens_per_s" in r]
    speed, memory = ([t.get_text().strip() for t in ax.texts] for ax in fig.axes)  # each bar says its value
    assert speed == [f"{r['tokens_per_s']:,.0f}" for r in rows] and memory == [f"{r['peak_memory_gb']:.1f}" for r in rows]
    from tunekit.cli import main

    assert main(["bench", "--compare", "--preset", "tiny", "--stacks", "tunekit", "--out", str(tmp_path), *fields]) == 0
    saved = json.loads((tmp_path / "compare_tiny.json").read_text())
    assert [r["stack"] for r in saved["stacks"]] == ["tunekit"] and (tmp_path / "compare_tiny.png").exists()
    capsys.readouterr()
    compare.run_compare("tiny", fields, stacks=("unsloth",), unsloth_site=str(tmp_path / "absent"))
    assert "unsloth  skipped: no Unsloth site folder" in capsys.readouterr().out  # said, not only recorded


def test_bad_requests_are_clear_errors(fields):
    with pytest.raises(ValueError, match="choose from"):
        compare.run_compare("tiny", fields, stacks=("deepspeed",))
    with pytest.raises(ValueError, match="LoRA/QLoRA"):
        compare.run_compare("tiny", [*fields, "--method", "full"])


def test_every_stack_runs_all_the_micro_batches_of_a_step(fields):
    """With gradient accumulation the plain stack runs the same micro-batches as tunekit's step (tok/s counts
    them all): the first losses still agree."""
    r = compare.run_compare("tiny", [*fields, "--grad-accum", "2"], stacks=("hf_peft", "tunekit"), verbose=False)
    assert r["loss_agreement"] < 1e-5
