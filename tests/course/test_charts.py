"""Every chart of tunekit_course/charts.py drawn on CPU from small hand-made results (the fields the measuring code
saves, none of the published values): it must draw without a layout warning, with no text on another text, inside
the figure, and with its axes labelled."""

from __future__ import annotations

import inspect
import warnings

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
from matplotlib.axes._secondary_axes import SecondaryAxis
from matplotlib.collections import LineCollection
from matplotlib.colors import to_hex
from matplotlib.text import Text

from tunekit_course import charts, claims, notebook

HERE, PUB = "here, NVIDIA RTX 4090", "published, NVIDIA H200"


def result(name: str, method: str = "lora", batch: int = 4, ckpt: bool = False, tps: float = 10_000.0,
           gb: float = 20.0, world_size: int = 1, **fields) -> dict:
    """A step result as `tunekit bench` saves it, with the config fields the charts read."""
    extra = {k: fields.pop(k) for k in list(fields) if k not in ("tok_per_s_p10_p90", "rows", "curve", "segments",
                                                                    "eval_losses", "stacks", "breakdown", "call")}
    config = {"preset": "llama7b_lora", "method": method, "batch_size": batch, "grad_ckpt": ckpt, "max_length": 2048,
              "num_heads": 32, "num_kv_heads": 32, "lora_r": 16, "lora_targets": "all-linear", "attention": "auto",
              "sdpa_backend": "auto", "packing": "pad", "optimizer": "adamw", "compile": "none", **extra}
    return {"name": name, "gpu": "NVIDIA H200", "world_size": world_size, "tokens_per_s": tps, "peak_memory_gb": gb,
            "step_time_s": 8192 / tps, "config": config, **fields}


def two_sides(results: list[dict], slower: float = 0.8) -> dict[str, dict[str, dict]]:
    """Yours (each `slower` times the published speed) beside the published ones, as `notebook.sides` gives them."""
    pub = {r["name"]: r for r in results}
    return {HERE: {n: {**r, "tokens_per_s": r.get("tokens_per_s") and r["tokens_per_s"] * slower}
                   for n, r in pub.items()}, PUB: pub}


STEPS = [result("a_lora_b4", tps=13_000, gb=59.5), result("a_lora_ckpt_b8", batch=8, ckpt=True, tps=9_400, gb=22.1),
         result("a_qlora_ckpt_b8", "qlora", 8, True, tps=9_100, gb=12.5),
         result("a_full_b4", "full", tps=11_000, gb=91.2), result("a_full_ckpt_b1", "full", 1, True, tps=7_100, gb=54.0),
         result("a_qlora_ckpt_b1", "qlora", 1, True, tps=3_900, gb=5.5),
         result("a_qlora_b1_offload", "qlora", 1, True, tps=3_650, gb=5.1, grad_ckpt_offload=True),
         result("a_lora_r64", batch=4, ckpt=True, tps=9_100, gb=22.9, lora_r=64)]


def nccl(name: str, peak: float) -> dict:
    rows = [{"mb": mb, "seconds": mb / 1e3 / (peak * f), "algbw_gbps": peak * f, "busbw_gbps": peak * f}
            for mb, f in ((1, 0.06), (16, 0.4), (64, 0.8), (256, 1.0))]
    return {"name": name, "world_size": 2, "busbw_gbps": peak, "rows": rows, "config": None}


def profile(order: list[str], ms: dict[str, float]) -> dict:
    return {"name": "p", "kernel_s_per_step": sum(ms.values()) / 1e3, "config": {"fp8": False},
            "breakdown": [{"category": c, "seconds": ms[c] / 1e3, "share": ms[c] / sum(ms.values())} for c in order]}


def comparison(name: str, method: str, batch: int, stacks: dict[str, tuple[float, float]], **fields) -> dict:
    r = result(name, method, batch, tps=stacks["tunekit"][0], gb=stacks["tunekit"][1], call="compare.run_compare()",
               **fields)
    r["stacks"] = [{"stack": s, "tokens_per_s": t, "peak_memory_gb": g} for s, (t, g) in stacks.items()]
    return r


def whole(name: str, tps: float, minutes: float, first_loss: float = 11.0) -> dict:
    steps = 40
    curve = [[i + 1, first_loss - 6 * i / steps, tps, 30 + 60 * minutes * i / steps] for i in range(steps)]
    return result(name, "qlora", 8, True, tps=tps, gb=12.0, curve=curve, eval_losses=[[steps, first_loss - 5.5]],
                  segments=[{"first_step": 1, "wall_s": 60 * minutes + 30}], tok_per_s_p10_p90=[0.9 * tps, 1.05 * tps])


def convergence_result(name: str, opts: dict[str, float]) -> dict:
    runs = [{"optimizer": o, "lr": lr, "eval": [[s, 4 - s / 300 + k / 10] for s in (50, 100, 150, 200)]}
            for k, (o, lr) in enumerate(opts.items())]
    return {"name": name, "runs": runs, "best": {o: {"lr": lr, "best_eval_loss": 3.3} for o, lr in opts.items()}}


WHOLE = {"w_before": whole("w_before", 2_300, 9.0), "w_checklist": whole("w_checklist", 6_800, 11.0),
         "w_tunekit": whole("w_tunekit", 25_000, 3.0)}
BARS = [(f"b{i:02d}", label, result(f"b{i:02d}", tps=2_000 * 1.2 ** i, tok_per_s_p10_p90=[1_800 * 1.2 ** i,
                                                                                         2_100 * 1.2 ** i]))
        for i, label in enumerate(("the article's before", "+ offline tokenization", "+ TF32",
                                   "+ torch.compile: the article's checklist", "+ packed rows",
                                   "bf16 LoRA instead of QLoRA, a long label to wrap no bar"))]

# one call a chart function, each on hand-made data with the fields the measuring code saves
def band_run(kind: str, seed: int, shift: float) -> dict:
    """A whole run of 60 steps for `charts.fp8_band`: its loss falling, `shift` nats above the others'."""
    return {"name": f"{kind}_{seed}", "config": {"seed": seed},
            "curve": [[s, 10.0 - s / 10 + shift + 0.05 * (s % 3), 1.0, 1.0] for s in range(1, 61)],
            "eval_losses": [[30, 7.0 + shift], [60, 4.0 + shift]]}


CASES = {
    "bars": lambda: charts.bars(two_sides(STEPS[:3]), ["a_lora_b4", "a_lora_ckpt_b8", "a_qlora_ckpt_b8", "missing"],
                                keys=("tokens_per_s", "peak_memory_gb"), title="the step, yours and published",
                                marks={"plain HF + peft (cited)": {"a_lora_b4": 11_700, "a_qlora_ckpt_b8": 6_900}},
                                article=[("C4", "GB")]),
    "loss_curve": lambda: charts.loss_curve(list(range(1, 151)), [6.5 - i / 100 for i in range(150)], title="tiny"),
    "convergence": lambda: charts.convergence([convergence_result("c1", {"adamw": 3e-3, "adamw8bit": 3e-3}),
                                               convergence_result("c2", {"lion": 3e-4})]),
    "frontier": lambda: charts.frontier(two_sides(STEPS), title="every configuration"),
    "estimate_vs_measured": lambda: charts.estimate_vs_measured(two_sides(STEPS),
                                                                lambda r: r["peak_memory_gb"] * (1.13 if r["config"]
                                                                ["method"] == "full" else 0.97), title="the estimator"),
    "bandwidth": lambda: charts.bandwidth(two_sides([nccl("n_default", 280), nccl("n_ib", 281), nccl("n_p2p", 29),
                                                     nccl("n_shm", 3)]),
                                          {"n_default": "as set up", "n_ib": "NCCL_IB_DISABLE=1",
                                           "n_p2p": "NCCL_P2P_DISABLE=1", "n_shm": "P2P and SHM disabled"}),
    "speedups": lambda: charts.speedups(two_sides([result("eager", tps=12_900), result("tf32_off", tps=12_850),
                                                   result("regional", tps=17_400), result("fp8", tps=5_700),
                                                   result("adamw", "full", tps=49_000),
                                                   result("lion", "full", tps=47_000)]),
                                        [("TF32", "eager", "tf32_off", ("C13", "speed-up")),
                                         ("regional compile", "regional", "eager", ("C14", "speed-up")),
                                         ("Lion, against AdamW", "lion", "adamw", ("C15", "Lion")),
                                         ("FP8 matmuls", "fp8", "eager", None),
                                         ("not measured", "nothing", "eager", None)], title="each switch"),
    "kernel_time": lambda: charts.kernel_time(
        {"bf16": profile(["matmul", "attention", "copy, cast", "optimizer"],
                         {"matmul": 355, "attention": 38, "copy, cast": 21, "optimizer": 2}),
         "FP8": profile(["matmul", "attention", "optimizer", "copy, cast", "new kind"],
                        {"matmul": 258, "attention": 38, "copy, cast": 12, "optimizer": 1.5, "new kind": 5})},
        title="kernel time"),
    "stacks": lambda: charts.stacks([
        comparison("s_lora", "lora", 4, {"hf_peft": (11_800, 70), "tunekit": (17_800, 50), "unsloth": (17_600, 46)},
                   compile="regional"),
        comparison("s_qlora_b1", "qlora", 1, {"tunekit": (4_200, 4.3), "unsloth": (7_300, 5.1)}, grad_ckpt=True,
                   grad_ckpt_offload=True, embed_offload=True, optimizer="adamw8bit"),
        comparison("s_qwen", "lora", 4, {"hf_peft": (12_300, 86), "tunekit": (16_400, 54), "unsloth": (17_300, 47)},
                   preset="qwen25_7b_lora")], labels={"s_qlora_b1": "QLoRA, batch 1, the least memory"}),
    "fp8_band": lambda: charts.fp8_band([band_run("FP8", 0, 0.01), band_run("FP8", 1, 0.012)],
                                        [band_run("bf16", 0, 0.0), band_run("bf16", 1, 0.04)]),
    "whole_runs": lambda: charts.whole_runs({HERE: WHOLE, PUB: WHOLE},
                                            {"w_before": "the article's before", "w_checklist": "its checklist",
                                             "w_tunekit": "tunekit's recipe"}, title="GSM8K, one epoch",
                                            article=("w_checklist", "w_before")),
    "waterfall": lambda: charts.waterfall([(n, label, r, {**r, "tokens_per_s": 1.1 * r["tokens_per_s"]} if i % 2
                                            else None, "") for i, (n, label, r) in enumerate(BARS)],
                                          [HERE, PUB]),
}


def _drawn_texts(fig) -> list[tuple[str, object]]:
    """(text, its box on the canvas) of every visible text drawn, a legend as one box; tick labels only where their
    tick is inside the axis' view (the ones drawn)."""
    renderer = fig.canvas.get_renderer()
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    out = [("legend", lg.get_window_extent(renderer)) for lg in legends]
    texts = [*fig.texts, *([fig._suptitle] if fig._suptitle else [])]
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks(len(axis.get_majorticklocs())):
                if lo - 1e-9 <= tick.get_loc() <= hi + 1e-9:
                    texts += [tick.label1, tick.label2]
    for t in dict.fromkeys(texts):  # the suptitle is among the figure's texts too
        if t.get_visible() and t.get_text().strip():
            out.append((t.get_text(), Text.get_window_extent(t, renderer)))  # the text alone, not an arrow
    return out


def overlaps_and_outside(fig) -> tuple[list, list]:
    boxes = _drawn_texts(fig)
    pairs = [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1:]
             if min(ba.x1, bb.x1) - max(ba.x0, bb.x0) > 1 and min(ba.y1, bb.y1) - max(ba.y0, bb.y0) > 1]
    page = fig.bbox
    outside = [a for a, b in boxes if b.x0 < page.x0 - 1 or b.y0 < page.y0 - 1 or b.x1 > page.x1 + 1
               or b.y1 > page.y1 + 1]
    return pairs, outside


def unlabelled(fig) -> list[str]:
    """Axes without an x label, or without a y label where their y ticks are not labelled categories under a title."""
    title = bool(fig._suptitle and fig._suptitle.get_text())
    problems = []
    for i, ax in enumerate(a for a in fig.axes if not isinstance(a, SecondaryAxis)):
        shared = ax.get_shared_y_axes().get_siblings(ax)
        categories = any(all(t.get_text() for t in a.get_yticklabels()) and a.get_yticklabels() for a in shared)
        titled = title or any(a.get_title() for a in shared)
        if not ax.get_xlabel():
            problems.append(f"axes {i}: no x label")
        if not ax.get_ylabel() and not (categories and titled):
            problems.append(f"axes {i}: no y label, nor a title over labelled categories")
    return problems


def test_every_chart_function_is_drawn_here():
    functions = {name for name, f in inspect.getmembers(charts, inspect.isfunction)
                 if f.__module__ == charts.__name__ and not name.startswith("_") and name not in ("setup", "claimed")}
    assert functions == set(CASES), f"a chart function without a test case: {functions ^ set(CASES)}"


@pytest.mark.parametrize("name", list(CASES))
def test_a_chart_draws_without_layout_warnings_or_overlapping_text(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "Tight layout not applied", "constrained_layout not applied"
        fig = CASES[name]()
        fig.canvas.draw()
    try:
        assert isinstance(fig, matplotlib.figure.Figure)
        pairs, outside = overlaps_and_outside(fig)
        assert not pairs, f"{name}: texts drawn over each other: {pairs}"
        assert not outside, f"{name}: texts outside the figure: {outside}"
        assert not unlabelled(fig), f"{name}: {unlabelled(fig)}"
    finally:
        plt.close(fig)


def test_the_overlap_check_sees_a_title_on_a_bar_label():
    """What lesson 5's old waterfall did: a bar's label drawn up into the title."""
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.bar([0, 1], [1, 5])
    ax.set_ylim(0, 5)
    ax.annotate("5.0\n+4.0", (1, 5), ha="center", va="bottom")
    ax.set(title="one change a bar", xlabel="bar", ylabel="minutes")
    fig.canvas.draw()
    assert overlaps_and_outside(fig)[0]
    plt.close(fig)


def test_the_article_figures_are_the_claims_own_words():
    for (claim, what), (value, words) in charts.ARTICLE.items():
        assert words in claims.CLAIMS[claim][0], f"{claim}: {words!r} is not in {claims.CLAIMS[claim][0]!r}"
    assert charts.claimed("C16", "speed-up")[1] == pytest.approx(claims.ARTICLE_SPEEDUP)
    assert charts.claimed("C4", "GB") == ("the article (C4): ~12 GB", 12)


def test_a_cited_mark_sits_on_its_own_row_only():
    """Lesson 0's cited figures were lines across every bar; each is now a mark on its configuration's row."""
    fig = CASES["bars"]()
    marks = [c for c in fig.axes[0].collections if isinstance(c, LineCollection) and c.get_label().startswith("plain")]
    rows = [seg[:, 1] for seg in marks[0].get_segments()]
    assert len(rows) == 2 and all(abs(y1 - y0) < 1 for y0, y1 in rows)
    assert [line.get_label() for line in fig.axes[1].lines] == ["the article (C4): ~12 GB"]  # on the GB panel
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[:3] == ["LoRA, batch 4", "LoRA, batch 8, checkpointing", "QLoRA, batch 8, checkpointing"]
    plt.close(fig)


def test_each_kernel_category_keeps_its_colour_in_every_bar():
    """Lesson 6's FP8 bar listed its categories in another order, and took other colours than the legend's."""
    fig = CASES["kernel_time"]()
    ax = fig.axes[0]
    by_bar: dict[float, list] = {}
    for patch in ax.patches:
        if patch.get_width() > 0:
            by_bar.setdefault(round(patch.get_y() + patch.get_height() / 2), []).append(patch)
    legend = {t.get_text(): to_hex(h.get_facecolor()) for t, h in
              zip(fig.legends[0].get_texts(), fig.legends[0].legend_handles)}
    widths = {"matmul": 355, "attention": 38, "copy, cast": 21, "optimizer": 2}
    for patch in by_bar[0]:
        category = next(c for c, w in widths.items() if abs(patch.get_width() - w) < 1e-6)
        assert to_hex(patch.get_facecolor()) == legend[category]
    fp8 = {round(p.get_width(), 3): to_hex(p.get_facecolor()) for p in by_bar[1]}
    assert fp8[258] == legend["matmul"] and fp8[12] == legend["copy, cast"] and fp8[5] == legend["new kind"]
    plt.close(fig)


def test_setup_says_what_a_result_measured():
    assert charts.setup(result("x", "qlora", 8, True)) == "QLoRA, batch 8, checkpointing"
    assert charts.setup(result("x", world_size=2)) == "LoRA, batch 4, DDP on 2 GPUs"
    assert charts.setup(result("x", "full", 2, world_size=2)) == "full fine-tune, batch 2, FSDP2 on 2 GPUs"
    assert charts.setup(result("x", "qlora", 1, True, grad_ckpt_offload=True, embed_offload=True,
                               optimizer="adamw8bit", compile="regional")) == \
        "QLoRA, batch 1, checkpoints and embeddings in CPU memory, 8-bit AdamW, compiled"
    assert charts.setup(result("x", preset="qwen25_7b_lora", num_kv_heads=4)) == "Qwen2.5-7B: LoRA, batch 4"
    assert charts.setup(result("x", lora_r=64, num_kv_heads=8, lora_targets="q_proj,v_proj")) == \
        "LoRA r64, batch 4, q/v only, 8 KV heads"


def test_sides_puts_yours_beside_the_published(monkeypatch):
    mine = {"l4_lora_eager": result("l4_lora_eager")}
    monkeypatch.setenv("TUNEKIT_SMOKE", "1")
    monkeypatch.delenv("TUNEKIT_REPLAY", raising=False)
    both = notebook.sides(mine, names=["l4_lora_eager"])
    assert list(both) == ["here (smoke: tiny model, CPU)", PUB] and both[PUB]["l4_lora_eager"]["gpu"] == "NVIDIA H200"
    assert list(notebook.sides(mine, names=["l4_lora_eager"], smoke=False)) == [PUB]
    monkeypatch.setenv("TUNEKIT_REPLAY", "1")
    assert list(notebook.sides(mine, names=["l4_lora_eager"])) == [f"{PUB} (replayed)"]


def test_a_series_with_nothing_to_draw_takes_no_room_nor_a_legend_entry():
    """A smoke run's own results carry none of the GPU lessons' names: only the published bars are drawn."""
    fig = charts.bars({HERE: {"tiny": result("tiny")}, PUB: {r["name"]: r for r in STEPS[:2]}},
                      ["a_lora_b4", "a_lora_ckpt_b8"], title="t")
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [PUB]
    assert {round(p.get_height(), 2) for p in fig.axes[0].patches} == {0.72}  # the whole row's height, 0.8 x 0.9
    plt.close(fig)


def test_the_waterfall_marks_the_article_s_speed_up_on_the_checklist_s_bar():
    fig = CASES["waterfall"]()
    marks = [c for c in fig.axes[0].collections if isinstance(c, LineCollection)
             and c.get_label().startswith("the article (C16)")]
    assert len(marks) == 1
    (x0, y0), (_, y1) = marks[0].get_segments()[0]
    assert x0 == pytest.approx(14 / 3 * BARS[0][2]["tokens_per_s"] * 1)  # against the before, in the first series
    assert 2.5 < (y0 + y1) / 2 < 3.5  # the fourth bar: "+ torch.compile: the article's checklist"
    plt.close(fig)
