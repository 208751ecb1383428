"""The lessons' charts: one function a chart, each taking result dicts or plain numbers and returning the matplotlib
Figure, so that a notebook cell only gathers the data and calls it, and tests/course/test_charts.py draws every
chart on CPU from small hand-made results.

The conventions every chart keeps:

- `sides` is {series label: {result name: result}}, in the order drawn: your own results first (labelled with your
  GPU), then the published ones (labelled "published, ..."), as `notebook.sides` gathers them. Published series
  are grey, yours blue; a name a series lacks has no bar there.
- Rows and points are labelled with what they measure (`setup`, or the label a cell gives), never with the name
  of a result file.
- Where a chart tests one of the article's claims it draws the claimed figure (`ARTICLE`) beside the measured one.
- Legends sit outside the axes and the layout is matplotlib's constrained one, so no label, title or legend
  lands on another.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

from tunekit.results import value as _value  # a result's number by (dotted) key

# The article's figures the charts draw, each with the words of claims.CLAIMS it is read from:
# (claim, what) -> (value, words). tests/course/test_charts.py holds every entry to its claim's text, so the two
# cannot drift apart.
ARTICLE = {
    ("C4", "GB"): (12, "~12 GB"),
    ("C4", "x full"): (0.6, "0.6x"),
    ("C5", "GB"): (40, "~40 GB"),
    ("C5", "x full"): (0.8, "0.8x"),
    ("C6", "GB"): (120, "~120 GB"),
    ("C13", "speed-up"): (1.3, "+30% speed"),
    ("C14", "speed-up"): ((1.2, 1.5), "+20-50%"),
    ("C15", "8-bit AdamW"): (0.9, "8-bit AdamW 0.9x"),
    ("C15", "Lion"): (1.2, "Lion 1.2x"),
    ("C16", "speed-up"): (14 / 3, "14 days to 3"),
}


def claimed(claim: str, what: str) -> tuple[str, float | tuple[float, float]]:
    """(legend label, value) of an article figure of `ARTICLE`: ("the article (C4): ~12 GB", 12)."""
    value, words = ARTICLE[(claim, what)]
    return f"the article ({claim}): {words}", value


# how an axis names each key of a result
AXIS = {"tokens_per_s": "tokens/s per GPU (higher is better)", "peak_memory_gb": "peak allocated GB (lower is better)",
        "busbw_gbps": "all-reduce bus bandwidth, GB/s", "step_time_s": "seconds a step (lower is better)",
        "first_step_s": "seconds to the end of the first step"}
METHODS = {"lora": "LoRA", "qlora": "QLoRA", "full": "full fine-tune"}
METHOD_COLORS = {"full": "tab:red", "lora": "tab:blue", "qlora": "tab:green"}
# presets of another shape than the course's Llama-2-7B: the model named in front of a row's label
MODELS = {"llama3_8b": "Llama-3.1-8B", "mistral7b": "Mistral-7B", "qwen25_7b": "Qwen2.5-7B", "qwen3_8b": "Qwen3-8B",
          "gemma2_9b": "Gemma-2-9B"}
OPTIMIZERS = {"adamw8bit": "8-bit AdamW", "paged_adamw8bit": "paged 8-bit AdamW", "adamw_foreach": "AdamW (foreach)",
              "lion": "Lion", "lion8bit": "8-bit Lion", "lion_pytorch": "Lion (lion-pytorch)"}
ATTENTION = {"eager": "eager attention", "flex_attention": "FlexAttention", "sdpa": "SDPA"}
MARK_COLORS = ("black", "tab:red", "tab:purple", "tab:brown")
CLAIM_COLORS = ("black", "tab:purple", "tab:brown", "tab:red")  # the article's figures, apart from METHOD_COLORS


def _color(label: str, i: int) -> str:
    return "tab:gray" if label.startswith("published") else ("tab:blue", "tab:orange", "tab:olive")[i % 3]


def _legend(fig, ax, ncols: int = 3) -> None:
    """The axes' legend below the plot, outside it: it can cover no bar, point or label."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(ncols, len(handles)), fontsize=8)


def setup(r: dict) -> str:
    """What a result measured, in a few words, from its config: "QLoRA, batch 8, checkpointing",
    "LoRA, batch 4, DDP on 2 GPUs", "Qwen2.5-7B: LoRA, batch 4, compiled". Fields at the course's defaults
    (rank 16 on every linear layer, seq 2048, padded batches, tunekit's attention choice) are not named."""
    c = r.get("config") or {}
    method = c.get("method", "?")
    parts = [METHODS.get(method, method) + (f" r{c['lora_r']}" if c.get("lora_r", 16) != 16 else "")]
    parts.append(f"batch {c.get('batch_size', '?')}")
    offloaded = [what for what, on in (("checkpoints", c.get("grad_ckpt") and c.get("grad_ckpt_offload")),
                                       ("embeddings", c.get("embed_offload"))) if on]
    if c.get("grad_ckpt") and not c.get("grad_ckpt_offload"):
        parts.append("checkpointing")
    if offloaded:
        parts.append(" and ".join(offloaded) + " in CPU memory")
    if c.get("lora_targets", "all-linear") != "all-linear" and method != "full":
        parts.append(c["lora_targets"].replace("_proj", "").replace(",", "/") + " only")
    model = next((m for p, m in MODELS.items() if str(c.get("preset", "")).startswith(p)), "")
    if not model and c.get("num_kv_heads") and c.get("num_heads") and c["num_kv_heads"] < c["num_heads"]:
        parts.append(f"{c['num_kv_heads']} KV heads")  # on the Llama-2 shape: a change; another model's own
    if c.get("max_length", 2048) != 2048:
        parts.append(f"seq {c['max_length']}")
    if c.get("packing") == "pack":
        parts.append("packed rows")
    if c.get("attention", "auto") != "auto":
        backend = c.get("sdpa_backend", "auto")
        parts.append(ATTENTION.get(c["attention"], c["attention"]) + (f" {backend}" if c["attention"] == "sdpa"
                                                                      and backend != "auto" else ""))
    if c.get("optimizer", "adamw") != "adamw":
        parts.append(OPTIMIZERS.get(c["optimizer"], c["optimizer"]))
    if c.get("compile", "none") != "none":
        parts.append("compiled" + (" whole" if c["compile"] == "model" else ""))
    if c.get("fast_lora") is True:
        parts.append("fused LoRA")
    if c.get("fp8"):
        parts.append("FP8")
    if (r.get("world_size") or 1) > 1:  # distributed.choose_parallel's `auto`: FSDP2 for full, DDP otherwise
        parallel = c.get("parallel", "auto")
        parallel = ("fsdp" if method == "full" else "ddp") if parallel == "auto" else parallel
        parts.append(f"{'FSDP2' if parallel == 'fsdp' else parallel.upper()} on {r['world_size']} GPUs")
    return (f"{model}: " if model else "") + ", ".join(parts)


def _rows(rows, sides: dict[str, dict[str, dict]]) -> dict[str, str]:
    """{name: label}: `rows` as given ({name: label}), or names labelled by `setup` of the last series' result (the
    published one: the same label on every machine), else of another series', else the name; two rows alike
    are told apart by their names."""
    if isinstance(rows, dict):
        return dict(rows)
    out = {}
    for name in rows:
        found = [rs[name] for label, rs in reversed(sides.items()) if name in rs]
        out[name] = setup(found[0]) if found and found[0].get("config") else name
    seen = list(out.values())
    return {n: f"{label} ({n})" if seen.count(label) > 1 else label for n, label in out.items()}


def _drawn(sides: dict[str, dict[str, dict]], names: list[str], key: str) -> dict[str, dict[str, dict]]:
    """The series with a value of `key` in some row: one with none takes no room, and no legend entry."""
    return {label: rs for label, rs in sides.items() if any(_value(rs.get(n), key) is not None for n in names)}


def _grouped(ax, sides: dict[str, dict[str, dict]], names: list[str], key: str, spread: str = "",
             colors: list[str] | None = None) -> None:
    """Horizontal bars of `key`, a row per name and a bar per series in it (`colors`: one a series, default
    `_color`'s); `spread`: the key of a result's [low, high] drawn as an error bar."""
    colors = dict(zip(sides, colors or [_color(label, j) for j, label in enumerate(sides)]))
    sides = _drawn(sides, names, key)
    height = 0.8 / max(len(sides), 1)
    for j, (label, rs) in enumerate(sides.items()):
        ys, vals, err = [], [], [[], []]
        for i, name in enumerate(names):
            v = _value(rs.get(name), key)
            if v is None:
                continue
            ys.append(i - 0.4 + height * (j + 0.5))
            vals.append(v)
            low, high = (rs[name].get(spread) or (v, v)) if spread else (v, v)
            err[0].append(max(v - low, 0))
            err[1].append(max(high - v, 0))
        ax.barh(ys, vals, height=0.9 * height, color=colors[label], label=label,
                xerr=err if spread and vals else None, error_kw={"elinewidth": 1, "capsize": 2})
    for i, name in enumerate(names):
        if all(_value(rs.get(name), key) is None for rs in sides.values()):
            ax.text(0, i, " not measured", va="center", fontsize=8, color="gray")
    ax.set_ylim(len(names) - 0.5, -0.5)  # the first row on top
    ax.set_xlabel(AXIS.get(key, key.replace("_", " ")))


def _relative_marks(ax, sides: dict[str, dict[str, dict]], names: list[str], key: str,
                    article: tuple[str, str] | None) -> None:
    """C16's figure on the row `article[0]`: 14/3 of the row `article[1]`'s value, in each series that has both
    (a speed-up is read against the same machine's before)."""
    if not article or article[0] not in names:
        return
    legend, factor = claimed("C16", "speed-up")
    legend += f" ({factor:.2f}x the before's speed)"
    sides = _drawn(sides, names, key)  # as `_grouped` placed the bars
    height = 0.8 / max(len(sides), 1)
    i = names.index(article[0])
    for j, rs in enumerate(sides.values()):
        base = _value(rs.get(article[1]), key)
        if base is not None:
            y = i - 0.4 + height * (j + 0.5)
            ax.vlines(factor * base, y - height / 2, y + height / 2, colors="tab:red", linewidth=2, label=legend)
            legend = None  # one legend entry


def bars(sides: dict[str, dict[str, dict]], rows, keys: str | tuple[str, ...] = "tokens_per_s", title: str = "",
         marks: dict[str, dict[str, float]] | None = None, article: list[tuple[str, str]] | None = None):
    """Bars of `keys` (a panel a key), a row per result and a bar per series of `sides`. `rows`: {name: label} or
    names (labelled by `setup`). `marks`: {legend: {name: value}} on the first panel, each drawn on its own row only
    (a cited figure for that configuration); `article`: (claim, what) of `ARTICLE`, a figure for every row, drawn as
    a line on the panel of its unit (GB: peak memory's)."""
    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    rows = _rows(rows, sides)
    names = list(rows)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys) + 4, 0.32 * len(names) * max(len(sides), 2) + 1.8),
                             sharey=True, layout="constrained", squeeze=False)
    for ax, key in zip(axes[0], keys):
        _grouped(ax, sides, names, key)
    ax = axes[0][0]
    for k, (legend, values) in enumerate((marks or {}).items()):
        at = [(names.index(n), v) for n, v in values.items() if n in names and v is not None]
        ax.vlines([v for _, v in at], [i - 0.45 for i, _ in at], [i + 0.45 for i, _ in at],
                  colors=MARK_COLORS[k % len(MARK_COLORS)], linewidth=2.5, label=legend)
    for k, (claim, what) in enumerate(article or []):  # on the panel of its unit: a figure in GB on the GB panel
        key = "peak_memory_gb" if what == "GB" else keys[0]
        if key in keys:
            legend, value = claimed(claim, what)
            axes[0][keys.index(key)].axvline(value, ls="--", color=CLAIM_COLORS[k % len(CLAIM_COLORS)], label=legend)
    ax.set_yticks(range(len(names)), [rows[n] for n in names])
    fig.suptitle(title, fontsize=10)
    handles = [h for a in axes[0] for h in zip(*a.get_legend_handles_labels())]
    fig.legend(*zip(*handles), loc="outside lower center", ncols=3, fontsize=8)
    return fig


def loss_curve(steps: list[int], losses: list[float], title: str = "", ylabel: str = "loss (nats per target token)"):
    """A training loss against the step."""
    fig, ax = plt.subplots(figsize=(7, 3), layout="constrained")
    ax.plot(steps, losses)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    return fig


def convergence(convs: list[dict], title: str = "held-out loss, each optimizer at its best learning rate"):
    """The held-out loss against the step of each optimizer of `speedups.run_convergence` results, at its best
    learning rate."""
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    for conv in convs:
        for opt, best in conv["best"].items():
            run = next(x for x in conv["runs"] if x["optimizer"] == opt and x["lr"] == best["lr"])
            steps, losses = zip(*run["eval"])
            ax.plot(steps, losses, marker="o", label=f"{opt} (lr {best['lr']:g})")
    ax.set(xlabel="step", ylabel="held-out loss (nats per token)", title=title)
    _legend(fig, ax, ncols=4)
    return fig


def _gb_axis(ax, axis: str = "x") -> None:
    """A log axis of GB with plain numbers for ticks: 4, 8, 16, ..."""
    scale = getattr(ax, f"{axis}axis")
    scale.set_major_locator(FixedLocator([2 ** k for k in range(10)]))  # a locator: the limits stay the data's
    scale.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    scale.set_minor_formatter(NullFormatter())


def frontier(sides: dict[str, dict[str, dict]], cards: tuple[float, ...] = (24, 48, 80), title: str = "",
             article: tuple[str, ...] = ("C4", "C5", "C6")):
    """Peak memory against tokens/s, a point per configuration (colour: its method; marker: its series), the frontier
    of each series (the fastest configuration within each amount of memory) as a staircase, a line at each card's
    memory with the fastest configuration under it named, and the article's figures: a point for each claim of
    `article` with both a memory and a speed (its speed a multiple of the fastest full fine-tune on the chart, of
    the first series that has one), a line for one with a memory only (C6)."""
    fig, ax = plt.subplots(figsize=(10, 5.5), layout="constrained")
    markers = ("o", "s", "^")
    points = {label: sorted((r["peak_memory_gb"], r["tokens_per_s"], name) for name, r in rs.items()
                            if _value(r, "peak_memory_gb") and _value(r, "tokens_per_s"))
              for label, rs in sides.items()}
    for j, (label, pts) in enumerate(points.items()):
        rs = sides[label]
        for method, color in METHOD_COLORS.items():
            mine = [(m, t) for m, t, n in pts if (rs[n].get("config") or {}).get("method") == method]
            if mine:
                ax.scatter(*zip(*mine), marker=markers[j % 3], s=36, color=color,
                           facecolors=color if j == 0 else "none", label=f"{METHODS[method]}, {label}")
        best, stair = 0.0, []
        for m, t, _ in pts:
            if t > best:
                best = t
                stair.append((m, t))
        if stair:
            xs, ys = zip(*stair)
            ax.step([*xs, max(cards + xs) * 1.1], [*ys, ys[-1]], where="post", color=_color(label, j), lw=1,
                    alpha=0.7, label=f"frontier, {label}")
    first = next(((label, pts) for label, pts in points.items() if pts), None)
    named = set()
    for gb in cards:
        ax.axvline(gb, ls=":", color="gray", lw=1)
        fits = [p for p in (first[1] if first else []) if p[0] <= gb]
        if fits:
            m, t, name = max(fits, key=lambda p: p[1])
            if name not in named:  # one name a point, where two cards share their fastest configuration
                named.add(name)
                ax.annotate(f"{setup(sides[first[0]][name])}\n{t:,.0f} tok/s, {m:.1f} GB", (m, t), xytext=(-6, 10),
                            textcoords="offset points", ha="right", fontsize=7,
                            arrowprops={"arrowstyle": "-", "color": "gray", "lw": 0.5})
    fulls = [[t for _, t, n in pts if (sides[label][n].get("config") or {}).get("method") == "full"]
             for label, pts in points.items()]
    full = next((max(ts) for ts in fulls if ts), None)  # the fastest full fine-tune of the first series with one
    for k, claim in enumerate(article):
        legend, gb = claimed(claim, "GB")
        if (claim, "x full") in ARTICLE and full:
            _, x = claimed(claim, "x full")
            ax.scatter([gb], [x * full], marker="*", s=160, color=CLAIM_COLORS[k % len(CLAIM_COLORS)],
                       label=f"{legend} at {ARTICLE[(claim, 'x full')][1]} full's speed")
        else:
            ax.axvline(gb, ls="--", color=CLAIM_COLORS[k % len(CLAIM_COLORS)], lw=1, label=legend)
    ax.set_xscale("log")
    _gb_axis(ax)
    top = ax.secondary_xaxis("top")  # the cards named on the top axis, clear of the title and the points
    top.set_xticks(list(cards), [f"{gb:g} GB card" for gb in cards], fontsize=8)
    top.xaxis.set_minor_formatter(NullFormatter())
    ax.set(xlabel="peak allocated GB (log scale)", ylabel="tokens/s per GPU", title=title)
    ax.set_ylim(0, 1.3 * max((t for pts in points.values() for _, t, _ in pts), default=1))  # room for the names
    _legend(fig, ax, ncols=2)
    return fig


def estimate_vs_measured(sides: dict[str, dict[str, dict]], estimate, band: float = 0.15, title: str = "",
                         named: float = 0.10):
    """The estimated peak against the measured one, a point per step result of each series; `estimate(result)`
    gives its estimate in GB. The line y = x with a band of ±`band` around it; points more than `named` off, of
    the first series, are named."""
    fig, ax = plt.subplots(figsize=(7, 6), layout="constrained")
    lo, hi = math.inf, 0.0
    for j, (label, rs) in enumerate(sides.items()):
        pts = [(r["peak_memory_gb"], estimate(r), r) for r in rs.values() if _value(r, "peak_memory_gb")]
        if not pts:
            continue
        ax.scatter([m for m, _, _ in pts], [e for _, e, _ in pts], s=28, color=_color(label, j),
                   marker=("o", "s", "^")[j % 3], facecolors=_color(label, j) if j == 0 else "none", label=label)
        lo, hi = min(lo, *(min(m, e) for m, e, _ in pts)), max(hi, *(max(m, e) for m, e, _ in pts))
        if j == 0:
            for m, e, r in sorted(pts, key=lambda p: p[0]):
                if abs(e / m - 1) > named:  # above the line: named to its left, below it: to its right
                    ax.annotate(f"{setup(r)}: {e / m - 1:+.0%}", (m, e), xytext=(-8, 2) if e > m else (8, -8),
                                textcoords="offset points", fontsize=7, ha="right" if e > m else "left")
    lo, hi = (lo / 1.3, hi * 1.3) if hi else (1, 100)
    xs = [lo, hi]
    ax.plot(xs, xs, color="black", lw=1, label="estimate = measured")
    ax.fill_between(xs, [x * (1 - band) for x in xs], [x * (1 + band) for x in xs], color="tab:green", alpha=0.15,
                    label=f"within ±{band:.0%}")
    ax.set(xscale="log", yscale="log", xlim=xs, ylim=xs, xlabel="measured peak allocated GB",
           ylabel="estimated peak GB (tunekit.estimate)", title=title)
    _gb_axis(ax, "x")
    _gb_axis(ax, "y")
    _legend(fig, ax, ncols=2)
    return fig


def bandwidth(sides: dict[str, dict[str, dict]], labels: dict[str, str], title: str = "all-reduce between GPUs"):
    """All-reduce bus bandwidth against message size (log-log), a line per NCCL setting of `labels` ({result name:
    the setting}) and series (solid: the first, dashed: the others), from each `commbench` result's rows."""
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, (label, rs) in enumerate(sides.items()):
        for k, (name, setting) in enumerate(labels.items()):
            rows = (rs.get(name) or {}).get("rows") or []
            pts = [(x["mb"], x["busbw_gbps"]) for x in rows if x.get("busbw_gbps")]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=4, color=colors[k % len(colors)], ls=("-", "--", ":")[j % 3],
                        label=f"{setting}, {label}")
    ax.set(xscale="log", yscale="log", xlabel="message size, MB (log scale)",
           ylabel="bus bandwidth, GB/s (log scale)", title=title)
    _legend(fig, ax, ncols=2)
    return fig


def speedups(sides: dict[str, dict[str, dict]], rows: list[tuple], title: str = "", key: str = "tokens_per_s"):
    """Each switch's speed-up over the same step without it, a row a switch and a bar per series, growing left or
    right from 1x (log scale). `rows`: (label, result name, the result it is read against, (claim, what) of
    `ARTICLE` or None); a claimed figure is drawn on its row (a range as a shaded span)."""
    names = [label for label, *_ in rows]

    def ratio(rs: dict, name: str, base: str) -> float:  # 0 where either result is missing
        return (_value(rs.get(name), key) or 0) / (_value(rs.get(base), key) or math.inf)

    sides = {label: rs for label, rs in sides.items() if any(ratio(rs, n, b) for _, n, b, _ in rows)}
    height = 0.8 / max(len(sides), 1)
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(rows) * max(len(sides), 2) + 1.8), layout="constrained")
    for j, (label, rs) in enumerate(sides.items()):
        drawn = 0
        for i, (_, name, base, _) in enumerate(rows):
            x = ratio(rs, name, base)
            if not x:
                continue
            y = i - 0.4 + height * (j + 0.5)
            ax.barh(y, x - 1, left=1, height=0.9 * height, color=_color(label, j), label=None if drawn else label)
            ax.text(x, y, f" {x:.2f}x ", va="center", ha="left" if x >= 1 else "right", fontsize=7)
            drawn += 1
    legends: list[str] = []
    for i, (_, _, _, claim) in enumerate(rows):
        if claim is None:
            continue
        legend, value = claimed(*claim)
        first = legend not in legends
        legends += [legend] if first else []
        color = CLAIM_COLORS[legends.index(legend) % len(CLAIM_COLORS)]
        if isinstance(value, tuple):  # a range: shaded behind the bars
            ax.fill_betweenx([i - 0.45, i + 0.45], *value, color=color, alpha=0.15, lw=0, zorder=0,
                             label=legend if first else None)
        else:
            ax.vlines(value, i - 0.45, i + 0.45, colors=color, linewidth=2.5, label=legend if first else None)
    ax.axvline(1, color="black", lw=0.8)
    ax.set_xscale("log")
    ticks = [0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(0.3, 4.5)
    ax.set_yticks(range(len(rows)), names)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set(xlabel="speed-up over the same step without the switch (log scale)", title=title)
    _legend(fig, ax)
    return fig


# the profiler's categories (bench.profile_step), in the order stacked; each keeps its colour in every bar
CATEGORIES = ("matmul", "attention", "elementwise, other", "copy, cast", "norm, activation, rope", "optimizer")


def kernel_time(profiles: dict[str, dict], title: str = ""):
    """GPU kernel time a step by category, a stacked bar per profile result ({label: result}, `tunekit bench
    --profile`). Every category has one colour in every bar, stacked in the same order."""
    extra = [row["category"] for p in profiles.values() for row in p["breakdown"] if row["category"] not in CATEGORIES]
    order = [*CATEGORIES, *dict.fromkeys(extra)]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(profiles) + 2), layout="constrained")
    for i, p in enumerate(profiles.values()):
        ms = {row["category"]: 1e3 * row["seconds"] for row in p["breakdown"]}
        left = 0.0
        for k, category in enumerate(order):
            ax.barh(i, ms.get(category, 0.0), left=left, color=colors[k % len(colors)], height=0.6,
                    label=category if i == 0 else None)
            left += ms.get(category, 0.0)
        ax.text(left, i, f" {left:,.0f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(profiles)), list(profiles))
    ax.set_ylim(len(profiles) - 0.5, -0.5)
    ax.set_xlim(0, 1.15 * max(sum(row["seconds"] for row in p["breakdown"]) * 1e3 for p in profiles.values()))
    ax.set(xlabel="GPU kernel time per step, ms", title=title)
    _legend(fig, ax)
    return fig


STACK_NAMES = {"hf_peft": "plain HF + peft", "tunekit": "tunekit", "unsloth": "Unsloth"}
STACK_COLORS = {"hf_peft": "tab:gray", "tunekit": "tab:green", "unsloth": "tab:purple"}


def stacks(comparisons: list[dict], labels: dict[str, str] | None = None,
           title: str = "each row: one run, the stacks back to back on one GPU"):
    """The `bench --compare` results on one chart: a row per comparison (labelled by `labels` {name: label}, else
    by `setup`), a bar per stack (the same colour in every row), tokens/s and peak memory side by side. A stack
    skipped or failed has no bar."""
    order = list(dict.fromkeys(s["stack"] for r in comparisons for s in r["stacks"]))
    sides = {STACK_NAMES.get(stack, stack): {r["name"]: s for r in comparisons for s in r["stacks"] if s["stack"] == stack}
             for stack in order}
    names = [r["name"] for r in comparisons]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.22 * len(names) * max(len(order), 2) + 1.8), sharey=True,
                             layout="constrained")
    for ax, key in zip(axes, ("tokens_per_s", "peak_memory_gb")):
        _grouped(ax, sides, names, key, colors=[STACK_COLORS.get(stack, "tab:blue") for stack in order])
    axes[0].set_yticks(range(len(names)), [(labels or {}).get(r["name"]) or setup(r) for r in comparisons])
    fig.suptitle(title, fontsize=10)
    _legend(fig, axes[0])
    return fig


def whole_runs(sides: dict[str, dict[str, dict]], labels: dict[str, str] | None = None, title: str = "",
               article: tuple[str, str] | None = ("l5_article_checklist", "l5_article_before")):
    """Lesson 5's whole runs: on the left the training loss against minutes since each run's start (the first
    series' runs; dots: the held-out loss after each epoch), on the right each run's steady real tokens/s, a bar
    per series, with the article's speed-up (C16) drawn on the row `article[0]` against `article[1]`."""
    from tunekit_course.runlog import elapsed_minutes

    first = next(iter(sides.values()), {})
    names = list(dict.fromkeys([*(labels or {}), *(n for rs in sides.values() for n in rs)]))
    names = [n for n in names if any(n in rs for rs in sides.values())]
    rows = {**_rows([n for n in names if n not in (labels or {})], sides), **(labels or {})}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 4.8), layout="constrained")
    for name, r in first.items():
        if name not in rows or not r.get("curve"):
            continue
        minutes = elapsed_minutes(r)
        line, = ax.plot(minutes, [row[1] for row in r["curve"]], lw=1, label=rows[name])
        at = dict(zip((row[0] for row in r["curve"]), minutes))
        for step, loss in r.get("eval_losses") or []:
            ax.plot(at.get(step, minutes[-1]), loss, "o", color=line.get_color())
    ax.set(xlabel="minutes since the run started", ylabel="training loss (dots: held-out)", title=title)
    _grouped(bx, sides, names, "tokens_per_s", spread="tok_per_s_p10_p90")
    _relative_marks(bx, sides, names, "tokens_per_s", article)
    bx.set_yticks(range(len(names)), [rows[n] for n in names])
    bx.set(xlabel="steady real tokens/s (bars: 10th-90th percentile)", title="speed of each run's steps")
    (h1, t1), (h2, t2) = ax.get_legend_handles_labels(), bx.get_legend_handles_labels()
    fig.legend([*h1, *h2], [*t1, *t2], loc="outside lower center", ncols=3, fontsize=8)  # below both: over no curve
    return fig


def fp8_band(fp8s: list[dict], bf16s: list[dict], window: int = 20, title: str = ""):
    """FP8 base weights against bf16's run-to-run band (`runlog.fp8_band`'s runs): on the left every run's training
    loss as `window`-step means (a colour a seed; solid bf16, dashed FP8; dots: held-out), on the right each FP8
    run's gap to the bf16 run of its seed, inside the band of what changing the seed moves (the bf16 seeds' spread,
    shaded either side of zero; `runlog.band_curves`)."""
    from tunekit_course.runlog import band_curves, smoothed
    from tunekit_course.runlog import seed_of as seed

    colors = {s: f"C{i}" for i, s in enumerate(sorted({seed(r) for r in (*bf16s, *fp8s)}, key=str))}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.2), layout="constrained")
    for r, kind, style in [*((r, "bf16", "-") for r in bf16s), *((r, "FP8", "--") for r in fp8s)]:
        s = smoothed(r, window)
        ax.plot(list(s), list(s.values()), style, lw=1.2, color=colors[seed(r)], label=f"{kind}, seed {seed(r)}")
        for step, loss in r.get("eval_losses") or []:
            marker = "o" if kind == "bf16" else "x"
            ax.plot(step, loss, marker, color=colors[seed(r)], ms=6, label=f"held-out, {kind}"
                    if f"held-out, {kind}" not in ax.get_legend_handles_labels()[1] else None)
    ax.set(xlabel="optimizer step", ylabel=f"training loss, {window}-step mean",
           title=title or "bf16 and FP8 base weights, whole runs")
    if c := band_curves(fp8s, bf16s, window):
        bx.fill_between(c["steps"], [-b for b in c["band"]], c["band"], color="tab:gray", alpha=0.3,
                        label="bf16's seeds apart (the run-to-run band)")
        for s, gaps in c["gaps"].items():
            bx.plot(c["steps"], gaps, "--", color=colors[s], label=f"FP8 minus bf16, seed {s}")
    bx.axhline(0, color="black", lw=0.8)
    bx.set(xlabel="optimizer step", ylabel="training loss gap, nats", title="FP8's gap to bf16 of its seed")
    (h1, t1), (h2, t2) = ax.get_legend_handles_labels(), bx.get_legend_handles_labels()
    fig.legend([*h1, *h2], [*t1, *t2], loc="outside lower center", ncols=4, fontsize=8)
    return fig


def waterfall(rows: list[tuple], labels: list[str], article: tuple[str, str] | None = None,
              title: str = "one change a bar, each keeping the changes above it"):
    """Lesson 5's waterfall, `waterfall.shown`'s rows (name, label, result here, published result, change): a row a
    bar, the steady real tokens/s of each series with its 10th-90th percentile. `labels`: the series' labels,
    yours then the published (the published alone: only the published column is drawn). The article's
    speed-up (C16) is drawn on the row `article[0]` against `article[1]`; by default on the bar whose label ends
    with "the article's checklist", against the first bar (the before)."""
    if article is None:
        checklist = next((row[0] for row in rows if row[1].endswith("the article's checklist")), None)
        article = (checklist, rows[0][0]) if checklist and rows else None
    columns = [2, 3][-len(labels):]
    sides = {label: {row[0]: row[col] for row in rows if row[col]} for label, col in zip(labels, columns)}
    names = [row[0] for row in rows]
    fig, ax = plt.subplots(figsize=(11, 0.3 * len(rows) * max(len(sides), 2) + 1.8), layout="constrained")
    _grouped(ax, sides, names, "tokens_per_s", spread="tok_per_s_p10_p90")
    _relative_marks(ax, sides, names, "tokens_per_s", article)
    ax.set_yticks(range(len(rows)), [row[1] for row in rows])
    ax.set(xlabel="steady real tokens/s (bars: 10th-90th percentile)", title=title)
    _legend(fig, ax)
    return fig
