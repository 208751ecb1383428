"""The TRL race (tunekit_course/trl_race.py) on the CPU: the three stacks of examples/sft_trl.py run, each in a
fresh process, on a tiny model; plain TRL and TRL with tunekit's two lines train the same samples from the same
weights, so their losses agree (fp32: to 1e-4), and the README's table renders the result."""

from __future__ import annotations

import importlib.util

import pytest

from tunekit.data.records import local_copy
from tunekit_course import trl_race

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl not installed (the trl extra)"),
              pytest.mark.skipif(local_copy("gsm8k") is None, reason="no local GSM8K (TUNEKIT_DATA_DIR)")]


def test_the_race_runs_each_stack_and_the_same_samples_give_the_same_loss():
    result = trl_race.race("trl_tiny", shape="tiny", samples=8, rows=1, steps=2, warmup=2, verbose=False)
    rows = {r["stack"]: r for r in result["stacks"]}
    assert set(rows) == set(trl_race.STACKS) and all(r["tokens_per_s"] > 0 for r in rows.values()), rows
    assert rows["trl_packing"]["padding"] == 0 and rows["trl"]["padding"] > 0  # padded batches
    assert rows["trl"]["tokens_per_step"] == rows["trl_tunekit"]["tokens_per_step"]  # the same samples
    assert result["loss_agreement"] < 1e-4
    assert rows["trl_tunekit"]["losses"] == pytest.approx(rows["trl"]["losses"], rel=1e-4)
    assert set(result["ratios"]) == {"trl_tunekit_vs_trl", "trl_tunekit_vs_trl_packing", "trl_packing_vs_trl"}
    assert rows["trl_tunekit"]["speed_ups"]["fast_lora"].startswith("fused LoRA")
    table = trl_race.trl_table({"trl_tiny": result})
    assert table.count("| `trl_tiny` |") == 3 and "TRL + `tunekit.speed_up`" in table
