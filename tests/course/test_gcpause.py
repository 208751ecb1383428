"""The frozen heap's A/B (tunekit_course/gcpause.py): two runs of the same batches, read step for step."""

import json

import pytest

from tunekit_course import gcpause


def _rows(step_s, losses=None):
    """Logged rows of a run whose step i took step_s[i] seconds over 1,000 tokens."""
    rows, t = [], 0.0
    for i, s in enumerate(step_s):
        t += s
        rows.append({"step": i + 1, "elapsed_s": t, "tokens": 1000 * (i + 1),
                     "loss": (losses or [1.0] * len(step_s))[i], "peak_mem_gb": 1.0})
    return rows


def test_steady_reads_the_two_runs_stretch_by_stretch():
    on = _rows([5.0] + [0.5] * 20)  # the first step (compile) is not a steady one
    off = _rows([4.0] + [1.0] * 20)
    s = gcpause.steady(on, off)
    assert s["steps"] == 21 and s["stretches"] == 20
    assert s["tok_per_s"] == {"gc_freeze=true": pytest.approx(2000.0), "gc_freeze=false": pytest.approx(1000.0)}
    assert s["time_ratio_p10_p50_p90"] == pytest.approx([0.5, 0.5, 0.5]) and not s["no_effect_shown"]
    assert s["losses_equal"]
    # a ratio whose spread holds 1 is no effect shown; a loss that differs is said
    noisy = gcpause.steady(_rows([1.0] + [0.9, 1.1] * 10), _rows([1.0] * 21, losses=[1.0] * 20 + [2.0]))
    assert noisy["no_effect_shown"] and not noisy["losses_equal"]
    with pytest.raises(ValueError, match="different steps"):
        gcpause.steady(on, off[:-1])


def test_the_ab_runs_both_and_saves_a_result(tmp_path, capsys):
    out = tmp_path / "gc.json"
    assert gcpause.main(["--out", str(out), "--preset", "tiny", "--max-steps", "5", "--save-every", "0",
                         "--log-every", "1"]) == 0  # the losses are equal, frozen or not
    printed = capsys.readouterr().out
    assert "gc_freeze=true:" in printed and "gc_freeze=false:" in printed and "losses equal" in printed
    r = json.loads(out.read_text())
    assert r["name"] == "gc_freeze_ab" and r["config"]["preset"] == "tiny" and r["steady"]["steps"] == 5
    assert r["steady"]["losses_equal"] and set(r["pauses_s"]) == {"gc_freeze=true", "gc_freeze=false"}
    assert r["tokens_per_s"] == r["steady"]["tok_per_s"]["gc_freeze=true"] > 0
