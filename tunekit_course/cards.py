"""What to run on the card you have: each lesson ends with the fastest configuration it measured that fits each
common size of GPU memory, read from its own result files.

A measured configuration fits a card when its peak as the caching allocator held it (`peak_reserved_gb`, or the
allocated peak with the estimator's reserve factor where a result has no reserved peak) plus the CUDA context
(`estimate.CUDA_CONTEXT_BYTES`: driver and kernels, outside PyTorch's count) is within the card's memory. The
speeds are those of the GPU that measured them (an H200 for the published results): a smaller card is slower,
the order of the configurations is what carries over.
"""

from __future__ import annotations

# GPU memory sizes a learner rents, with examples: a GPU with FP8 matmuls (Ada or Hopper) and one without
CARDS = ((24, "RTX 4090", "RTX 3090"), (48, "L40S", "RTX A6000"), (80, "H100", "A100 80GB"), (141, "H200", None))


# the fields that make two results the same model at the same length: only such results are compared
SHAPE = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size", "max_length")


def same_shape(results: dict[str, dict], like: dict) -> dict[str, dict]:
    """The results of `results` that trained the model `like` trained, at its sequence length (`SHAPE`)."""
    want = {k: (like.get("config") or {}).get(k) for k in SHAPE}
    return {n: r for n, r in results.items() if {k: (r.get("config") or {}).get(k) for k in SHAPE} == want}


def card_need_gb(r: dict) -> float:
    """The memory result `r`'s configuration needs on a card, in GB: its reserved peak (or allocated peak with
    the allocator's reserve factor) plus the CUDA context."""
    from tunekit.estimate import CUDA_CONTEXT_BYTES
    from tunekit.fitting import RESERVE_FACTOR

    held = r.get("peak_reserved_gb") or r["peak_memory_gb"] * RESERVE_FACTOR
    return held + CUDA_CONTEXT_BYTES / 1e9


def fastest_per_card(results: dict[str, dict], cards=CARDS, key: str = "tokens_per_s") -> list[dict]:
    """For each card of `cards`, the fastest of `results` ({name: result}, step results with `key` and a peak)
    that fits it (`card_need_gb`): on its GPU with FP8 matmuls any of them, on its GPU without (an RTX 3090, an
    A100) the fastest without FP8 base weights; one row where the two are the same. Rows [{gb, gpus, result,
    need_gb}], result None where nothing measured fits."""
    steps = [r for r in results.values() if r.get(key) and r.get("peak_memory_gb") and "error" not in r]
    rows = []
    for gb, with_fp8, without in cards:
        fits = [r for r in steps if card_need_gb(r) <= gb]
        picks = {}
        for gpu, fp8_ok in ((with_fp8, True), (without, False)):
            if gpu is None:
                continue
            best = max((r for r in fits if fp8_ok or not (r.get("config") or {}).get("fp8")),
                       key=lambda r: r[key], default=None)
            picks.setdefault(best and best["name"], (best, []))[1].append(gpu)
        for best, gpus in picks.values():
            rows.append({"gb": gb, "gpus": gpus, "result": best, "need_gb": best and round(card_need_gb(best), 1)})
    return rows


def what_to_run(results: dict[str, dict], gpu: str = "the published H200", cards=CARDS, gpus: int = 1) -> str:
    """`fastest_per_card` as the lines a lesson prints: a card a line, what to run, its speed and the memory it
    needs, and the GPU the speeds are from. With `gpus` > 1, for that many cards of each size: the results run
    on that many GPUs, each card holding one process's peak, speeds per GPU."""
    from tunekit_course.charts import setup

    if gpus > 1:
        results = {n: r for n, r in results.items() if (r.get("world_size") or 1) == gpus}
        head = (f"What to run on {gpus} cards, by the memory of each (the fastest configuration measured on {gpus} "
                f"GPUs where each process fits one card; tok/s per GPU, {gpu}'s):")
    else:
        head = (f"What to run, by the memory of your card (the fastest configuration measured that fits it; speeds "
                f"are {gpu}'s):")
    lines = [head]
    for row in fastest_per_card(results, cards):
        card = f"{row['gb']} GB ({', '.join(row['gpus'])})" if row["gpus"] else f"{row['gb']} GB"
        r = row["result"]
        if r is None:
            lines.append(f"  {card}: nothing measured here fits")
            continue
        lines.append(f"  {card}: {setup(r)}: {r['tokens_per_s']:,.0f} tok/s, needs ~{row['need_gb']:.1f} GB")
    return "\n".join(lines)


def for_lesson(prefix: str, like: str, mine: dict[str, dict] | None = None, skip: tuple[str, ...] = (),
               gpu: str = "", gpus: int = 1) -> str:
    """A lesson's closing "what to run": `what_to_run` over the published results named PREFIX... of the model
    the published result `like` trained (less names holding a word of `skip`), and over `mine` (this GPU's own
    results of the lesson, named `gpu`) first where given; on `gpus` cards of each size where more than one."""
    from tunekit.results import by_name
    from tunekit_course import RESULTS

    published = by_name(RESULTS)
    if like not in published:
        return f"what to run: no published result {like} to read the model from"

    def pick(rs: dict[str, dict]) -> dict[str, dict]:
        rs = {n: r for n, r in rs.items() if n.startswith(prefix) and not any(w in n for w in skip)}
        return same_shape(rs, published[like])

    parts = [what_to_run(pick(mine), gpu, gpus=gpus)] if mine and gpu else []
    return "\n\n".join([*parts, what_to_run(pick(published), "the published H200", gpus=gpus)])
