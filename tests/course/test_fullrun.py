"""Whole runs across GPU commands (tunekit_course/fullrun.py): a segment stopped by SIGTERM when its budget is
spent, resumed by the next until the run is done; the result adds up the segments' wall-clock."""

from __future__ import annotations

import json

import pytest

from tunekit_course import fullrun, runlog

ARGS = ["--preset", "tiny", "--max-steps", "30", "--max-length", "64", "--batch-size", "2", "--save-every", "0",
        "--log-every", "1"]


def test_a_run_stopped_by_its_budget_is_resumed_and_its_segments_added_up(tmp_path, capsys):
    folder = tmp_path / "run"
    first = fullrun.run_segment(folder, ARGS, budget_s=0, poll_s=0.05)  # stopped after its first logged step
    assert first["stopped"] and not first["finished"] and not first["resumed"]
    assert first["first_step"] == 1 and first["last_step"] < 30
    with pytest.raises(ValueError, match="has not finished"):
        fullrun.result("l5_test", folder)
    second = fullrun.run_segment(folder, ARGS, budget_s=3600)
    assert second["resumed"] and second["finished"] and not second["stopped"]
    assert second["first_step"] == first["last_step"] + 1 and second["last_step"] == 30
    assert fullrun.run_segment(folder, ARGS, budget_s=3600) == {}  # done: not run again
    r = fullrun.result("l5_test", folder)
    assert r["steps"] == 30 and len(r["segments"]) == 2
    assert r["wall_s"] == pytest.approx(first["wall_s"] + second["wall_s"], abs=0.11)
    assert r["tokens_per_s"] > 0 and r["config"]["preset"] == "tiny"
    assert json.loads((folder / "segments.json").read_text()) == [first, second]


def test_steady_tokens_per_s_leaves_out_each_segment_s_first_step_and_the_evaluations():
    rows = [{"step": 1, "tokens": 100, "tok_per_s": 5.0, "elapsed_s": 20.0},
            {"step": 2, "tokens": 200, "tok_per_s": 100.0, "elapsed_s": 21.0},
            {"step": 3, "tokens": 300, "tok_per_s": 10.0, "elapsed_s": 40.0},  # a resumed segment's first
            {"step": 4, "tokens": 400, "tok_per_s": 50.0, "elapsed_s": 52.0}]  # 10 s of held-out evaluation in it
    # steps 2 and 4: 200 tokens in 1 s + 2 s of their own; step 4's evaluation is the wall-clock's, not the step's
    assert runlog.steady_tokens_per_s(rows, {1, 3}) == pytest.approx(200 / 3.0)


def test_a_run_brought_back_is_derived_again_under_its_measured_header(tmp_path):
    folder = tmp_path / "run"
    fullrun.run_segment(folder, ARGS, budget_s=3600)
    measured = fullrun.result("l5_test", folder)
    header = {**measured, "gpu": "NVIDIA H200", "tokens_per_s": 1.0, "curve": None}  # as the GPU machine wrote it
    r = fullrun.rederive(folder, header)
    assert r["gpu"] == "NVIDIA H200" and r["date"] == measured["date"] and r["steps"] == 30
    assert r["tokens_per_s"] == measured["tokens_per_s"] and len(r["curve"]) == 30
    lo, hi = r["tok_per_s_p10_p90"]
    assert 0 < lo <= hi and r["derived"]["fields"][0] == "tokens_per_s" and "header_from" not in r["derived"]
    assert r["timings"]["build_s"] > 0 and r["timings"] == measured["timings"]


def test_a_run_that_could_not_be_resumed_says_so(tmp_path):
    folder = tmp_path / "stopped"
    first = fullrun.run_segment(folder, ARGS, budget_s=0, poll_s=0.05)
    header = {"name": "l5_other", "gpu": "NVIDIA H200", "date": "2026-12-02", "preset": "-",
              "versions": {"torch": "2.11.0"}}
    r = fullrun.rederive(folder, header, "l5_test_partial")
    assert r["name"] == "l5_test_partial" and r["whole"] is False and r["steps"] == first["last_step"] < 30
    assert r["derived"]["header_from"] == "l5_other" and r["preset"] == "tiny" and "stopped at step" in r["data"]
    assert r["versions"] == {"torch": "2.11.0"} and r["segments"] == [first]
    assert 0 < r["epochs_seen"] < 1


def test_eval_every_epoch_across_a_resume(tmp_path):
    # --eval-every -1: the held-out loss after each epoch; the resumed segment keeps the same schedule
    folder = tmp_path / "run"
    args = ["--preset", "tiny", "--epochs", "2", "--eval-every", "-1", "--eval-split", "0.5", "--max-length", "64",
            "--batch-size", "8", "--save-every", "0", "--data", "data/arith/test.jsonl"]
    fullrun.run_segment(folder, args, budget_s=0, poll_s=0.05)
    fullrun.run_segment(folder, args, budget_s=3600)
    r = fullrun.result("l5_epochs", folder)
    steps = [step for step, _ in r["eval_losses"]]
    assert steps == [r["steps"] // 2, r["steps"]], r["eval_losses"]
    b = r["baselines"]  # on the run's own held-out targets, beside its losses
    assert b["uniform"] > b["unigram"] > b["bigram"] > 0 and b["heldout_tokens"] > 0


def test_lesson5_runs_go_on_where_the_last_command_stopped(tmp_path, monkeypatch, capsys):
    from tunekit_course import notebook

    monkeypatch.setenv("TUNEKIT_SMOKE", "1")
    monkeypatch.setattr(notebook, "RUNS", tmp_path)
    runs = fullrun.lesson5_runs(False)
    assert fullrun.measure_runs(0, runs) == []  # no time: nothing started
    assert fullrun.main(["3600"]) == 0  # both smoke runs, whole
    assert [json.loads((notebook.results_dir() / f"{n}.json").read_text())["steps"] for n, _, _ in runs] == [6, 6]
    capsys.readouterr()
    assert fullrun.measure_runs(3600, runs) == ["l5_smoke_a", "l5_smoke_b"]  # done: nothing run again
    assert "l5_smoke_a: your measurement of " in capsys.readouterr().out  # read back, and says so
    assert fullrun.main(["l5_smoke"]) == 2  # neither a budget nor a run with its arguments: the usage
    assert fullrun.main(["--rederive", "x"]) == 2  # its arguments missing



def test_lesson5_runs_on_a_gpu_are_the_three_recipes_and_a_24_gb_card():
    runs = {name: (args, env) for name, args, env in fullrun.lesson5_runs(True)}
    assert [args[1] for args, _ in runs.values()] == ["article_before", "article_checklist", "tunekit_recipe",
                                                      "tunekit_recipe"]
    assert runs["l5_tunekit_24gb"][1] == {"TUNEKIT_MEMORY_GB": "24"}


def test_a_run_s_clock_adds_its_segments_end_to_end():
    r = {"segments": [{"wall_s": 120.0, "first_step": 1}, {"wall_s": 60.0, "first_step": 4}],
         "curve": [[1, 9.0, 10.0, 30.0], [3, 8.0, 10.0, 90.0], [4, 7.5, 10.0, 45.0], [5, 7.0, 10.0, 54.0]]}
    assert runlog.elapsed_minutes(r) == pytest.approx([0.5, 1.5, 2.75, 2.9])  # steps 4-5: 120 s before them


def test_the_model_the_lesson_looks_at_is_tunekit_s_run_where_one_kept_its_adapter(tmp_path, monkeypatch):
    from tunekit_course import notebook

    monkeypatch.setattr(notebook, "RUNS", tmp_path)
    runs = [("l5_article_before", [], {}), ("l5_tunekit", [], {}), ("l5_tunekit_24gb", [], {})]
    assert fullrun.model_folder(runs) is None  # nothing ran here (results read back)
    for name in ("l5_article_before", "l5_tunekit_24gb"):
        (fullrun.run_folder(name) / "adapter").mkdir(parents=True)
        (fullrun.run_folder(name) / "summary.json").write_text("{}")
    assert fullrun.model_folder(runs) == fullrun.run_folder("l5_tunekit_24gb")
    assert fullrun.model_folder(runs[:1]) == fullrun.run_folder("l5_article_before")


def test_replay_runs_nothing_and_reads_the_published_runs(monkeypatch):
    monkeypatch.setenv("TUNEKIT_REPLAY", "1")
    runs = fullrun.lesson5_runs(True)
    assert fullrun.measure_runs(3600, runs) == [n for n, _, _ in runs if fullrun.measured(n)]
    assert "l5_article_before" in fullrun.measure_runs(3600, runs)


def _whole(name, wall_s, tps, peak, epochs=1.0, evals=(), baselines=None, first_s=30.0):
    return {"name": name, "wall_s": wall_s, "tokens_per_s": tps, "peak_memory_gb": peak, "epochs_seen": epochs,
            "eval_losses": [[i, loss] for i, loss in enumerate(evals, 1)], "baselines": baselines,
            "curve": [[1, 9.0, 10.0, first_s]]}


def test_the_lesson_s_summary_is_read_from_the_runs_and_says_what_is_missing():
    base = {"uniform": 10.1, "unigram": 6.1, "bigram": 4.5}
    before = _whole("l5_article_before", 480.0, 2_000.0, 8.6, evals=[5.5], baselines=base)
    check = _whole("l5_article_checklist", 240.0, 5_000.0, 17.0, evals=[5.4], baselines=base, first_s=400.0)
    tk = _whole("l5_tunekit", 240.0, 24_000.0, 62.0, epochs=3.0, evals=[4.8, 4.2, 4.0], baselines=base)
    card = _whole("l5_tunekit_24gb", 480.0, 12_000.0, 22.5, epochs=3.0)
    lines = fullrun.summary({"l5_article_before": before, "l5_article_checklist": check, "l5_tunekit": tk,
                             "l5_tunekit_24gb": card})
    assert lines[0].startswith("The article's checklist, as written: 1 epoch in 4.0 min against the before's 8.0 min, "
                               "2.0x by wall-clock, its first step ending 400 s into the run")
    assert "its steady steps ran 2.5x the before's real tokens a second: at those rates a 14-day run of the " \
           "before's steps takes 5.6 days (a projection from the measured rates), where the article claims 3" in lines[0]
    assert "3 epochs in 4.0 min (1.3 min an epoch on average, 6.0x the before's epoch); steady 12.0x" in lines[1]
    assert "takes 1.2 days" in lines[1] and "4.8x the checklist's" in lines[1]
    assert lines[2].startswith("FP8 against bf16: l5_tunekit and l5_tunekit_24gb share 1 logged steps, too few")
    assert "steady 50% of the whole card's rate, peak 22.5 GB" in lines[3]
    assert lines[4] == ("Peak GPU memory: l5_article_before 8.6 GB, l5_article_checklist 17.0 GB, l5_tunekit 62.0 GB, "
                        "l5_tunekit_24gb 22.5 GB.")
    assert lines[5].startswith("Held-out loss of l5_tunekit after 3 epochs: 4.00 nats, below the bigram baseline")
    missing = fullrun.summary({"l5_article_before": before})
    assert missing[0].endswith("l5_article_checklist not measured here.") and len(missing) == 3
    assert "between the unigram and bigram baselines" in missing[2]
    short = fullrun.summary({"l5_smoke": _whole("l5_smoke", 6.0, 5_000.0, 0.5, epochs=0.004, evals=[6.4],
                                                baselines=base)})
    assert "after 0.00 of an epoch: 6.40 nats, above the unigram baseline" in short[-1]


def test_a_run_s_output_on_the_page_is_its_first_step_each_tenth_and_one_banner(monkeypatch):
    monkeypatch.setattr(fullrun, "_SHOWN", set())
    banner = "attention: auto: PyTorch SDPA\n"
    out = [banner, *(f"step {i}/40: loss 1.0\n" for i in range(1, 41)), "done: 40 steps\n"]
    keep = fullrun.for_the_page()
    shown = [line for line in out if keep(line)]
    assert shown == [banner, "step 1/40: loss 1.0\n", *(f"step {i}/40: loss 1.0\n" for i in range(4, 41, 4)),
                     "done: 40 steps\n"]
    again = fullrun.for_the_page()  # the next segment (or run) in this process: its first step, no banner again
    assert [line for line in [banner, "step 17/40: loss 1.0\n", "step 18/40: x\n"] if again(line)] == \
        ["step 17/40: loss 1.0\n"]


def test_a_recipe_s_steady_gain_pairs_steps_where_the_batches_are_the_same():
    """Two recipes that leave the batching alone saw the same batches step by step: the spread of their ratio is
    the 10th-90th percentile of the step-by-step ratios (a segment's first step, the compile's, left out);
    recipes that batch differently fall back on each run's own spread; none known, none told."""
    cfg = {"data": "gsm8k", "seed": 0, "batch_size": 8, "grad_accum": 7, "max_length": 2048, "packing": "pad",
           "epochs": 1.0, "max_steps": 12}
    base = {"tokens_per_s": 1000.0, "tokens_seen": 99, "config": cfg, "segments": [{"first_step": 1}],
            "curve": [[i, 9.0, 1000.0 + 10 * i, 1.0] for i in range(1, 13)], "tok_per_s_p10_p90": [900.0, 1100.0]}
    run = {**base, "tokens_per_s": 3000.0, "segments": [{"first_step": 1}], "tok_per_s_p10_p90": [2500.0, 3300.0],
           "curve": [[1, 9.0, 5.0, 500.0], *([i, 9.0, 3 * (1000.0 + 10 * i) * (1.1 if i % 2 else 0.9), 1.0]
                                              for i in range(2, 13))]}
    ratio, low, high, how = runlog.steady_vs(run, base)
    assert ratio == 3.0 and (low, high) == pytest.approx((2.7, 3.3)) and "same 11 steps" in how
    packed = {**run, "config": {**cfg, "packing": "pack"}}  # other batches: each run's own spread
    assert runlog.steady_vs(packed, base)[1:3] == pytest.approx((2500 / 1100, 3300 / 900))
    assert runlog.steady_vs({"tokens_per_s": 10.0}, {"tokens_per_s": 5.0}) == (2.0, None, None, "no spread recorded")


def test_what_to_run_on_each_card_is_the_estimator_s_nearest_fit():
    rows = {(r["gb"], r["fp8"]): r for r in fullrun.recipes_by_memory()}
    assert rows[(141, True)]["flags"] == [] and rows[(141, True)]["fits"]  # the recipe as it is
    assert rows[(80, False)]["flags"] == [] and rows[(80, True)]["flags"] == []
    assert not rows[(24, True)]["fits"]  # FP8's two weight copies leave no room on 24 GB
    assert rows[(24, False)]["flags"] == ["--grad-ckpt=true"] and rows[(24, False)]["estimate_gb"] < 24
    assert rows[(48, True)]["flags"] == ["--grad-ckpt=true"] and rows[(48, True)]["estimate_gb"] < 48
    assert (141, False) not in rows  # no card of that size without FP8


def test_fp8_against_bf16_compares_the_same_batches_step_by_step():
    """The recipe with FP8 base weights against the same recipe without, on the same batches: the training
    losses as 20-step means, their largest and last gaps, the held-out losses both reached; runs of other
    batches are not compared."""
    cfg = {"data": "gsm8k", "seed": 0, "batch_size": 4, "grad_accum": 1, "max_length": 2048, "packing": "pack"}
    fp8 = {"name": "l5_tunekit", "config": {**cfg, "epochs": 3.0, "max_steps": 60},
           "curve": [[s, 10.0 - s / 10, 1.0, 1.0] for s in range(1, 61)], "eval_losses": [[20, 5.0], [40, 4.5]]}
    bf16 = {"name": "l5_tunekit_24gb_stopped", "config": {**cfg, "epochs": 3.0, "max_steps": 60},
            "curve": [[s, 10.0 - s / 10 + (0.05 if s > 40 else 0.0), 1.0, 1.0] for s in range(1, 51)],
            "eval_losses": [[20, 5.01]]}
    c = runlog.fp8_vs_bf16(fp8, bf16)
    assert c["steps"] == 50 and c["window"] == 20 and c["held_out"] == [(20, 5.0, 5.01)]
    assert runlog.fp8_vs_bf16(fp8, {**bf16, "curve": bf16["curve"][:5]})["largest_gap"] is None  # too few steps
    assert c["largest_gap"] == pytest.approx(-0.025) and c["last_gap"] == pytest.approx(-0.025)  # steps 41-50
    text = runlog.describe_fp8(fp8, bf16)
    assert "differ by at most 0.025 nats (FP8 lower)" in text and "after step 20: FP8 5.000, bf16 5.010" in text
    other = {**bf16, "config": {**bf16["config"], "packing": "pad"}}
    assert runlog.fp8_vs_bf16(fp8, other) is None and "did not train on the same batches" in \
        runlog.describe_fp8(fp8, other)


def test_fp8_is_judged_against_what_the_seed_alone_moves():
    """bf16 at two seeds is the band; each FP8 run is held to the bf16 run of its seed (same batches). Held out:
    inside the band where every FP8 gap is at most the bf16 seeds' spread at that evaluation; training losses as
    20-step means, FP8's side and size against the band's mean; without two seeds nothing is said."""
    cfg = {"data": "gsm8k", "batch_size": 4, "grad_accum": 1, "max_length": 2048, "packing": "pack", "epochs": 3.0,
           "max_steps": 0}

    def run(name: str, seed: int, shift: float, held: tuple[float, float]) -> dict:
        return {"name": name, "config": {**cfg, "seed": seed}, "eval_losses": [[20, held[0]], [40, held[1]]],
                "curve": [[s, 10.0 - s / 10 + shift, 1.0, 1.0] for s in range(1, 41)]}

    bf16 = [run("b0", 0, 0.0, (5.0, 4.0)), run("b1", 1, 0.1, (5.04, 4.02))]
    fp8 = [run("f0", 0, 0.01, (5.01, 4.015)), run("f1", 1, 0.12, (5.05, 4.03))]
    c = runlog.fp8_band(fp8, bf16)
    assert c["seeds"] == [0, 1] and c["fp8_seeds"] == [0, 1] and c["steps"] == 21 and c["within"]
    assert [h["band"] for h in c["held_out"]] == pytest.approx([0.04, 0.02])
    assert c["held_out"][1]["gaps"] == pytest.approx({0: 0.015, 1: 0.01})
    assert c["train_band"]["mean"] == pytest.approx(0.1) and c["train_gaps"][1]["mean"] == pytest.approx(0.02)
    text = runlog.describe_fp8_band(fp8, bf16)
    assert "within 0.015 nats" in text and "differ by 0.020-0.040" in text and "inside bf16's run-to-run band" in text
    assert "FP8 higher than bf16 of its seed by 0.010-0.020 on average" in text
    assert text.startswith("FP8 base weights against bf16") and runlog.describe_fp8_band(fp8, bf16, "fp8fast") \
        .startswith("FP8 base weights with fast accumulation against bf16")
    outside = [run("f0", 0, 0.01, (5.05, 4.0))]  # 0.05 above bf16 at step 20, where the seeds differ by 0.04
    assert not runlog.fp8_band(outside, bf16)["within"]
    assert "outside bf16's run-to-run band" in runlog.describe_fp8_band(outside, bf16)
    assert runlog.fp8_band(fp8, bf16[:1]) is None and "needs bf16 runs at two seeds" in \
        runlog.describe_fp8_band(fp8, bf16[:1])
    other = [{**fp8[0], "config": {**cfg, "seed": 0, "packing": "pad"}}]  # other batches than its bf16 run's
    assert runlog.fp8_band(other, bf16) is None


def test_the_fp8_band_runs_are_the_recipe_at_two_seeds_in_both_dtypes():
    runs = {name: (args, env) for name, args, env in fullrun.band_runs(True)}
    assert set(runs) == {"l5c_bf16_s0", "l5c_fp8_s0", "l5c_bf16_s1", "l5c_fp8_s1", "l5c_fp8fast_s0", "l5c_fp8fast_s1"}
    assert runs["l5c_fp8_s1"] == (["--preset", "tunekit_recipe", "--fp8", "true", "--seed", "1"],
                                  {"TUNEKIT_FP8_FAST_ACCUM": "0"})  # at full precision, as these runs were made
    assert runs["l5c_bf16_s0"] == (["--preset", "tunekit_recipe", "--fp8", "false", "--seed", "0"], {})
    # fast accumulation: the same FP8 run, with the input gradient's matmul accumulating fast
    assert runs["l5c_fp8fast_s1"] == (runs["l5c_fp8_s1"][0], {"TUNEKIT_FP8_FAST_ACCUM": "1"})
    from tunekit import fastlora

    assert fastlora.FAST_ACCUM_BACKWARD  # the library's default since the fast runs stayed inside the band
    assert all(args[:2] == ["--preset", "tiny"] for _, args, _ in fullrun.band_runs(False))
