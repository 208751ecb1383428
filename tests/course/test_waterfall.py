"""Lesson 5's waterfall (tunekit_course/waterfall.py): each bar a `tunekit train` of the config its label says,
stopped after its steady seconds, measured once."""

from __future__ import annotations

import json

from tunekit_course import waterfall


def test_the_waterfall_commands_are_the_waterfall_s_configs():
    from tunekit import config
    from tunekit.cli import resolve

    bars = zip(waterfall.waterfall_runs(), waterfall.waterfall_configs())
    for (name, label, args), (bar, bar_label, fields) in bars:
        assert (name, label) == (bar, bar_label)
        cfg = config.config_dict(resolve(args[1], args[2:]))
        assert cfg == {**fields, "eval_data": "", "save_every": 0}, name  # no evaluation, no periodic checkpoint


def test_waterfall_bars_are_time_boxed_and_measured_once(tmp_path, monkeypatch):
    from tunekit_course import notebook

    monkeypatch.setenv("TUNEKIT_SMOKE", "1")
    monkeypatch.setattr(notebook, "RUNS", tmp_path)
    long = ["--preset", "tiny", "--max-steps", "100000", "--max-length", "64", "--batch-size", "2",
            "--save-every=0", "--log-every", "1"]
    bars = [("l5w_t0", "the before", long), ("l5w_t1", "+ a change", [*long, "--lr", "1e-3"])]
    assert waterfall.measure_waterfall(3600, bars, steps_s=1.0, least_s=0) == ["l5w_t0", "l5w_t1"]
    r = json.loads((notebook.results_dir() / "l5w_t0.json").read_text())
    assert r["label"] == "the before" and r["steady_s"] >= 1.0 and 2 <= r["steps"] < 100000
    assert r["tokens_per_s"] > 0 and r["one_time_s"] > 0 and len(r["curve"]) == r["steps"]
    assert r["tok_per_s_p10_p90"][0] <= r["tok_per_s_p10_p90"][1]
    assert waterfall.measure_waterfall(3600, bars, steps_s=1.0, least_s=0) == ["l5w_t0", "l5w_t1"]  # not again


def test_the_command_line_takes_a_budget():
    assert waterfall.main([]) == 2 and waterfall.main(["soon"]) == 2
