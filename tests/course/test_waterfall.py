"""Lesson 5's waterfall (tunekit_course/waterfall.py): each bar a `tunekit train` of the config its label says,
stopped after its steady seconds, measured once."""

from __future__ import annotations

import json

import pytest

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
    assert len(r["row_tokens"]) == r["steps"] and all(t > 0 for t in r["row_tokens"]) and r["gpu_uuid"] is None
    assert waterfall.measure_waterfall(3600, bars, steps_s=1.0, least_s=0) == ["l5w_t0", "l5w_t1"]  # not again


def test_the_command_line_takes_a_budget():
    assert waterfall.main([]) == 2 and waterfall.main(["soon"]) == 2


def _bar(tps: list[float], tokens: list[int], uuid: str | None = "GPU-1") -> dict:
    """A bar's result as `waterfall_bar` writes it: its logged rows' tokens/s and real tokens, its steady rate
    over the rows after the first."""
    rate = sum(tokens[1:]) / sum(t / r for t, r in zip(tokens[1:], tps[1:]))
    return {"tokens_per_s": rate, "gpu_uuid": uuid, "row_tokens": tokens,
            "curve": [[i + 1, 5.0, r, float(i)] for i, r in enumerate(tps)]}


def test_a_change_on_the_same_batches_is_read_step_by_step():
    """The same batches (row tokens equal): each step against the same step of the bar before, so a change of 3%
    shows though the steps' own speeds vary by 2x with the batches' lengths; a change of 0 is inside its spread."""
    tokens = [1000 + 500 * (i % 4) for i in range(30)]
    base = [2000.0 + 2000.0 * (i % 4) / 3 for i in range(30)]  # longer batches, faster steps: 2,000-4,000
    before = _bar(base, tokens)
    faster = waterfall.bar_change(before, _bar([t * 1.03 for t in base], tokens))
    assert faster["ratio"] == pytest.approx(1.03) and faster["within"] is False and "step by step" in faster["how"]
    assert faster["low"] == pytest.approx(1.03) and faster["high"] == pytest.approx(1.03)
    jitter = [t * (1.01 if i % 2 else 0.99) for i, t in enumerate(base)]
    same = waterfall.bar_change(before, _bar(jitter, tokens))
    assert same["within"] is True and same["low"] < 1 < same["high"]
    assert waterfall.describe_change(before, _bar(jitter, tokens)).endswith("inside its spread, no effect shown")


def test_a_change_of_batching_is_read_over_stretches_and_two_gpus_are_not_compared():
    before = _bar([2000.0 + 100 * (i % 3) for i in range(30)], [1000] * 30)
    packed = _bar([8000.0 + 400 * (i % 3) for i in range(20)], [4000] * 20)  # other batches: no pairing
    c = waterfall.bar_change(before, packed)
    assert c["within"] is False and "stretches" in c["how"] and c["low"] > 3.5 and c["high"] < 4.5
    other = waterfall.bar_change(before, _bar([2000.0] * 30, [1000] * 30, uuid="GPU-2"))
    assert other["within"] is None and "different GPUs" in other["how"]
    assert "not compared" in waterfall.describe_change(before, _bar([2000.0] * 30, [1000] * 30, uuid="GPU-2"))


def test_a_change_that_trades_one_time_cost_for_speed_says_when_it_pays_back():
    """Whole-model compile against eager: 3x the steps' speed for 600 s more of start; regional against
    whole-model: a quicker start, slower steps. Both come out even at the same run length, from each side."""
    tokens = [1000] * 30
    eager = {**_bar([2000.0] * 30, tokens), "one_time_s": 30.0}
    whole = {**_bar([5000.0] * 30, tokens), "one_time_s": 630.0}
    even = waterfall.pays_back(eager, whole)
    # 600 s = T (1/2000 - 1/5000): T = 2.0M tokens, reached 630 + 400 = 1,030 s into the run, by both
    assert even["tokens"] == pytest.approx(2.0e6) and even["seconds"] == pytest.approx(1030.0)
    assert even["faster"] == "bar" and 30.0 + even["tokens"] / 2000.0 == pytest.approx(even["seconds"])
    assert waterfall.describe_change(eager, whole).endswith(
        "; its 600 s more of one-time cost pays back after 2.0M real tokens (17 min into a run)")
    back = waterfall.pays_back(whole, eager)
    assert back["faster"] == "before" and back["tokens"] == pytest.approx(2.0e6)
    assert back["seconds"] == pytest.approx(1030.0)
    assert waterfall.describe_change(whole, eager).endswith(
        "; 600 s less of one-time cost: ahead until 2.0M real tokens (17 min into a run), behind after")
    # no trade: faster and quicker to start; one-time costs inside their own noise; none recorded
    assert waterfall.pays_back(whole, {**whole, "tokens_per_s": 7000.0, "one_time_s": 100.0}) is None
    assert waterfall.pays_back(eager, {**whole, "one_time_s": 33.0}) is None
    assert waterfall.pays_back(_bar([2000.0] * 30, tokens), whole) is None
    assert "pays back" not in waterfall.describe_change(eager, {**whole, "one_time_s": 33.0})


def test_the_summary_adds_up_the_article_s_items_and_the_course_s_changes():
    """Each part's bars multiplied, each change read on its own GPU (the second part's first bar against the bar
    before it measured again there), the changes that showed an effect from the largest; a part with a bar
    missing is not added up."""
    tokens = [1000] * 30
    names = [name for name, _, _ in waterfall.waterfall_runs()]
    labels = {name: label for name, label, _ in waterfall.waterfall_runs()}
    rates = [1000.0, 1000.0, 1000.0, 1000.0, 1000.0, 3000.0]  # the article's: compile alone moves it
    def wobbling(i: int, rate: float) -> list[float]:  # a bar's steps, each within 5% of its rate
        return [rate * (1.0 + 0.05 * ((i + k) % 3 - 1)) for k in range(30)]

    first = {name: _bar(wobbling(i, r), tokens, "GPU-1") for i, (name, r) in enumerate(zip(names, rates))}
    lines = waterfall.summary(first)
    whole = first["l5w_05"]["tokens_per_s"] / first["l5w_00"]["tokens_per_s"]  # one GPU: the ends' own ratio
    assert lines[0].startswith(f"The article's 5 items, one bar each: {whole:.2f}x the steady rate")
    assert f"outside their spread: {labels['l5w_05']} 3.00x; inside their spread (no effect shown): " \
           f"{labels['l5w_01']}, {labels['l5w_02']}" in lines[0]
    assert lines[1] == "The course's 10 changes after them: 0 of 10 bars measured and compared, so not added up"
    # the rest on another GPU, its reference bar measured again there (at another speed: another machine)
    second = {"l5w_05_again": _bar([3300.0] * 30, tokens, "GPU-2")}
    course = [3300.0 * 0.5, *[3300.0 * 0.5 * 4] * 3, *[3300.0 * 0.5 * 4 * 1.5] * 6]  # 0.5x, then 4x, then 1.5x
    second.update((name, _bar([r] * 30, tokens, "GPU-2")) for name, r in zip(names[6:], course))
    lines = waterfall.summary({**first, **second})
    assert lines[1].startswith(f"The course's 10 changes after them: {0.5 * 4 * 1.5:.2f}x the steady rate")
    assert f"outside their spread: {labels['l5w_07']} 4.00x, {labels['l5w_06']} 0.50x, {labels['l5w_10']} 1.50x" \
           in lines[1]


def test_bars_are_chosen_by_their_numbers():
    runs = waterfall.waterfall_runs()
    assert [name for name, _, _ in waterfall.bar_range("0-5")] == [f"l5w_{i:02d}" for i in range(6)]
    assert waterfall.bar_range("7") == runs[7:8] and waterfall.bar_range(f"6-{len(runs) - 1}") == runs[6:]
    for bad in ("a-b", "5-3", f"0-{len(runs)}"):
        with pytest.raises(ValueError, match=repr(bad)):
            waterfall.bar_range(bad)
    assert waterfall.main(["60", "9-2"]) == 2


def test_a_part_on_another_gpu_measures_its_reference_bar_again(tmp_path, monkeypatch):
    """A range that starts after the first bar, on a GPU with no result of the bar before it, measures that bar
    again first (NAME_again); the lesson then reads the part's first bar against it, not against the other
    GPU's, and a range whose reference was measured on this GPU gets nothing added."""
    from tunekit_course import notebook

    monkeypatch.setenv("TUNEKIT_SMOKE", "1")
    monkeypatch.setattr(notebook, "RUNS", tmp_path)
    runs = waterfall.waterfall_runs()
    assert waterfall.with_reference(waterfall.bar_range("0-5")) == runs[:6]  # the first bar has no reference
    part = waterfall.with_reference(waterfall.bar_range("6-8"))
    assert [name for name, _, _ in part] == ["l5w_05_again", "l5w_06", "l5w_07", "l5w_08"]
    assert part[0][2] == runs[5][2] and part[0][1].startswith(runs[5][1])  # the same bar, measured again
    notebook.results_dir().mkdir(parents=True)
    (notebook.results_dir() / "l5w_05.json").write_text(json.dumps({"gpu_uuid": waterfall.gpu_uuid()}))
    assert waterfall.with_reference(waterfall.bar_range("6-8")) == runs[6:9]  # measured here already

    tokens = [1000] * 30
    first = {"l5w_04": _bar([2000.0] * 30, tokens, "GPU-1"), "l5w_05": _bar([3000.0] * 30, tokens, "GPU-1")}
    second = {"l5w_05_again": _bar([3300.0] * 30, tokens, "GPU-2"), "l5w_06": _bar([6600.0] * 30, tokens, "GPU-2")}
    results = {**first, **second}
    assert waterfall.reference(results, "l5w_06") is second["l5w_05_again"]  # its own GPU's
    assert waterfall.reference(results, "l5w_05") is first["l5w_04"] and waterfall.reference(results, "l5w_00") is None
    order = [name for name, *_ in waterfall.shown({}, results)]
    assert order[5:8] == ["l5w_05", "l5w_05_again", "l5w_06"]  # the reference drawn right above what reads it
    rows = {name: row for name, *row in waterfall.shown({}, results)}
    assert rows["l5w_05_again"] == [f"{runs[5][1]} (again, on the next bars' GPU)", None,
                                    second["l5w_05_again"], ""]
    assert rows["l5w_06"][3].startswith("2.00x the bar before") and rows["l5w_05"][3].startswith("1.50x")
    assert rows["l5w_00"][3] == "" and rows["l5w_07"] == [runs[7][1], None, None, ""]
    mine = {"l5w_06": _bar([6000.0] * 30, tokens, "GPU-3")}  # measured here, the bar before it only published
    assert "not compared" in {n: row for n, *row in waterfall.shown(mine, results)}["l5w_06"][3]


def test_the_summary_reads_your_bars_and_the_published_ones_for_the_rest(monkeypatch):
    """A learner who measured part of the waterfall: the summary reads that part from their GPU and the part
    they did not measure from the published bars, never a change across the two."""
    from tunekit_course import notebook

    tokens = [1000] * 30
    names = [name for name, _, _ in waterfall.waterfall_runs()]
    rates = [1000.0, 1000.0, 1000.0, 1000.0, 1000.0, 3000.0]
    published = {name: _bar([r] * 30, tokens, "GPU-1") for name, r in zip(names, rates)}
    monkeypatch.setattr(notebook, "published", lambda name: published.get(name))
    mine = {"l5w_05_again": _bar([3300.0] * 30, tokens, "GPU-2"), "l5w_06": _bar([6600.0] * 30, tokens, "GPU-2")}
    both = waterfall.yours_or_published(mine)
    assert both["l5w_00"] is published["l5w_00"] and both["l5w_06"] is mine["l5w_06"]
    lines = waterfall.summary(both)
    assert lines[0].startswith("The article's 5 items, one bar each: 3.00x the steady rate")  # published, GPU-1
    assert lines[1] == "The course's 10 changes after them: 1 of 10 bars measured and compared, so not added up"
    assert waterfall.changes(both)[5][2]["ratio"] == pytest.approx(2.0)  # l5w_06: yours, on GPU-2 alone


def test_the_readme_table_has_a_row_a_bar_and_reads_each_change_on_its_own_gpu():
    """`waterfall.table` (the README's block): a row per bar in the waterfall's order, a bar measured again on
    another GPU in a row of its own with no change of its own, the bar after it read against it, a bar not
    measured said to be, each change with its spread; the two summary sentences under it."""
    tokens = [1000] * 30
    names = [name for name, _, _ in waterfall.waterfall_runs()]
    labels = [label for _, label, _ in waterfall.waterfall_runs()]
    bars = {name: {**_bar([1000.0 * (1 + 0.05 * (k % 3 - 1)) for k in range(30)], tokens), "one_time_s": 20.0,
                   "commit": "abcdef123", "tok_per_s_p10_p90": [950.0, 1050.0]} for name in names[:3]}
    bars["l5w_02_again"] = {**_bar([2000.0] * 30, tokens, "GPU-2"), "one_time_s": 21.0, "commit": "1234567"}
    bars["l5w_03"] = {**_bar([3000.0] * 30, tokens, "GPU-2"), "one_time_s": 22.0, "commit": "1234567"}
    lines = waterfall.table({**bars, "not_a_bar": {"tokens_per_s": 1.0}}).splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| bar ")]
    assert len(rows) == len(names) + 1  # every bar, and the one measured again
    assert rows[0] == f"| {labels[0]} | 1,000 (950–1,050) |  | 20 | abcdef1 |"
    assert rows[1].startswith(f"| {labels[1]} | 1,000 (950–1,050) | 1.00x (") and rows[1].endswith(
        ": inside its spread | 20 | abcdef1 |")
    assert rows[3].startswith(f"| {labels[2]} (again, on the next bars' GPU) | 2,000 |  | 21 |")
    assert rows[4].startswith(f"| {labels[3]} | 3,000 | 1.50x (1.50–1.50x) | 22 |")  # against the again row
    assert rows[5] == f"| {labels[4]} | unmeasured | | | |"
    assert lines[-2].startswith("- The article's 5 items") and lines[-1].startswith("- The course's 10 changes")
