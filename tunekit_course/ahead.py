"""Ahead of Unsloth, or not: tunekit's speed targets against Unsloth, each judged from the results that measure it.

Every target but FP8's is a ratio within one `tunekit bench --compare` run (the same weights and tokens, one
process a stack, back to back on one GPU), so it holds on whichever GPU ran it; the result says which. A target
is judged on each model shape it names (`SHAPES`, recognized by the architecture a result recorded, not by its
preset's name). Where a setup ran more than once in the same configuration, the newest runs count (as many as the
target judges on: batch 1 takes the median of three, its steps spread too far for one), never the best of them;
among different configurations of tunekit (FP8 or not, offloads, recompute) the one that comes nearest the
target is shown, and said.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

# the architecture fields a result's config records, as (hidden, layers, kv heads, MLP width, vocabulary)
SHAPES = {"Llama-2-7B shape": (4096, 32, 32, 11008, 32000), "Llama-3-8B shape": (4096, 32, 8, 14336, 128256)}
LLAMA2, LLAMA3 = SHAPES


@dataclass(frozen=True)
class Target:
    """A same-run target against Unsloth: tunekit's step in setup (method, batch, checkpointing) at `ratio`x
    Unsloth's or more, on each of `shapes`, within its memory bound: `unsloth_memory` (at most Unsloth's peak in
    the same run) and/or `gb` ({shape: GB at most}). `bf16`: tunekit's step without FP8 (the same arithmetic as
    Unsloth's); otherwise FP8 is allowed and said. `runs`: the newest comparisons of one configuration it is
    judged on, by their median ratio."""
    what: str
    method: str
    batch: int
    ckpt: bool
    ratio: float
    shapes: tuple[str, ...] = (LLAMA2, LLAMA3)
    unsloth_memory: bool = False
    gb: tuple[tuple[str, float], ...] = ()
    bf16: bool = False
    runs: int = 1

    def bound(self, shape: str) -> float | None:
        return dict(self.gb).get(shape)


TARGETS = (
    # at no more memory than tunekit's step held before the push (s14_compare_lora, s26_compare_llama3_lora)
    Target("LoRA bf16, batch 4", "lora", 4, False, 1.20, gb=((LLAMA2, 49.6), (LLAMA3, 54.5)), bf16=True),
    Target("QLoRA with checkpointing, batch 8", "qlora", 8, True, 1.10, unsloth_memory=True),
    Target("QLoRA without checkpointing, batch 4", "qlora", 4, False, 1.15, unsloth_memory=True),
    Target("QLoRA batch 1, least memory", "qlora", 1, True, 1.15, shapes=(LLAMA2,), gb=((LLAMA2, 4.5),), runs=3),
)
FP8_TOKENS = 27_000  # LoRA with FP8 base weights, Llama-2-7B shape, tok/s on one GPU (Unsloth has no such step)
REAL_SHARE = 0.90  # the fastest recipe through `tunekit train` on GSM8K, real tokens against its own step bench


def shape_of(r: dict) -> str | None:
    """Which of `SHAPES` result `r` ran, from the architecture its config recorded; None for any other."""
    c = r.get("config") or {}
    arch = tuple(c.get(k) for k in ("hidden_size", "num_layers", "num_kv_heads", "intermediate_size", "vocab_size"))
    return next((name for name, fields in SHAPES.items() if fields == arch), None)


def setup(r: dict, among_stacks: bool = False) -> str:
    """A result's step in words: preset, method, batch x length, checkpointing, what tunekit switched on, GPU.
    `among_stacks`: the result holds other stacks' steps too, so tunekit's switches are said to be its own."""
    c, own = r["config"], ("tunekit ", "tunekit's ") if among_stacks else ("", "")
    words = [(f"`{c['preset']}` shape, " if c.get("preset") else "") + f"{c['method']} b{c['batch_size']}x{c['max_length']}"]
    if c["grad_ckpt"]:
        words.append("ckpt" + (" offloaded" if c.get("grad_ckpt_offload") else "")
                     + (" on a side stream" if "TUNEKIT_OFFLOAD_STREAM=1" in r.get("entry", "") else ""))
    if c.get("compile", "none") != "none":
        words.append(f"{own[0]}{c['compile']} compile" + (" recomputing" if c.get("compile_recompute") else ""))
    if c.get("fast_lora"):
        words.append(f"{own[1]}fused LoRA" + (" grouped" if c.get("fast_lora_group") else "") + (
            (" reading the 4-bit weights into FP8" if c["method"] == "qlora" else " with FP8 weights")
            if c.get("fp8") else ""))
    elif c.get("fp8"):
        words.append("torchao FP8")
    return ", ".join(words + ([r["gpu"].removeprefix("NVIDIA ")] if r.get("gpu") else []))


def stack(r: dict, name: str) -> dict | None:
    """The row of stack `name` in comparison `r`, where it measured a step."""
    return next((x for x in r.get("stacks", []) if x["stack"] == name and x.get("tokens_per_s")), None)


def configuration(r: dict) -> str:
    """What a run of tunekit was asked and the GPU it ran on, without where its result went or its name: runs of
    one configuration are repeats of each other."""
    asked = re.sub(r"\s--(name|out|unsloth-site)\s+\S+", "", r.get("entry") or r.get("call") or r["name"]).strip()
    return f"{asked} on {r.get('gpu')}"


def _newest(rs: list[dict], n: int) -> dict[str, list[dict]]:
    """{configuration: its newest `n` runs among `rs`}."""
    by: dict[str, list[dict]] = {}
    for r in sorted(rs, key=lambda r: r.get("date", ""), reverse=True):
        by.setdefault(configuration(r), []).append(r)
    return {k: v[:n] for k, v in by.items()}


def comparisons(rs: dict[str, dict], t: Target, shape: str) -> list[dict]:
    """The same-run comparisons with Unsloth that measure target `t` on `shape`."""
    def fits(r: dict) -> bool:
        c = r.get("config") or {}
        return (str(r.get("call", "")).startswith("compare.") and shape_of(r) == shape and c.get("method") == t.method
                and c.get("batch_size") == t.batch and bool(c.get("grad_ckpt")) == t.ckpt
                and not (t.bf16 and c.get("fp8")) and bool(stack(r, "tunekit")) and bool(stack(r, "unsloth")))

    return [r for r in rs.values() if fits(r)]


def judge_target(rs: dict[str, dict], t: Target, shape: str) -> dict:
    """{"state": "met" | "missed" | "unmeasured", "text": a sentence, "files": names} for target `t` on `shape`."""
    want = f">= {t.ratio:.2f}x Unsloth" + (" at <= its memory" if t.unsloth_memory else "") + (
        f" at <= {t.bound(shape):g} GB" if t.bound(shape) else "")
    found = comparisons(rs, t, shape)
    if not found:
        return {"state": "unmeasured", "text": f"{t.what}, {shape}: target {want}, unmeasured", "files": ()}
    judged = []
    for runs in _newest(found, t.runs).values():
        ours, theirs = [stack(r, "tunekit") for r in runs], [stack(r, "unsloth") for r in runs]
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs)]
        ratio, gb = statistics.median(ratios), max(a["peak_memory_gb"] for a in ours)
        fits = (not t.unsloth_memory or all(a["peak_memory_gb"] <= b["peak_memory_gb"] for a, b in zip(ours, theirs))
                ) and (t.bound(shape) is None or gb <= t.bound(shape))
        enough = len(runs) >= t.runs
        judged.append((enough and fits and ratio >= t.ratio, enough, fits, ratio, gb, ratios, runs))
    ok, enough, _, ratio, gb, ratios, runs = max(judged, key=lambda j: j[:4])
    r, ours, theirs = runs[0], stack(runs[0], "tunekit"), stack(runs[0], "unsloth")
    fp8 = ", tunekit's matmuls in FP8" if r["config"].get("fp8") else ""
    if t.runs > 1:
        each = ", ".join(f"{x:.2f}x" for x in ratios)
        measured = (f"median {ratio:.2f}x Unsloth over {len(runs)} same-run comparison{'s' * (len(runs) > 1)} "
                    f"({each}), at most {gb:.1f} GB")
    else:
        measured = (f"{ratio:.2f}x Unsloth ({ours['tokens_per_s']:,.0f} against {theirs['tokens_per_s']:,.0f} tok/s, "
                    f"{ours['peak_memory_gb']:.1f} against {theirs['peak_memory_gb']:.1f} GB)")
    state = "met" if ok else "unmeasured" if not enough else "missed"
    why = "" if ok or enough else f": {len(runs)} of the {t.runs} comparisons it is judged on"
    where = f"{(r.get('gpu') or 'GPU').removeprefix('NVIDIA ')}{fp8}"
    return {"state": state, "text": f"{t.what}, {shape}: {measured}, {where} (target {want}: {state}{why})",
            "files": tuple(x["name"] for x in runs)}


def fp8_benches(rs: dict[str, dict]) -> list[dict]:
    """Step benches of LoRA with FP8 base weights on the Llama-2-7B shape (tunekit's fused layer): the newest run
    of each configuration."""
    found = [r for r in rs.values() if str(r.get("call", "")).startswith("bench.run_bench(") and shape_of(r) == LLAMA2
             and (r.get("config") or {}).get("method") == "lora" and r["config"].get("fp8")
             and r["config"].get("fast_lora") and r.get("tokens_per_s")]
    return [runs[0] for runs in _newest(found, 1).values()]


def accumulates_fast(r: dict) -> bool:
    """Whether FP8 run `r`'s input gradients accumulated fast: its `fp8_fast_accum`, or, in results from before
    that was the default (and recorded), TUNEKIT_FP8_FAST_ACCUM=1 among its command's switches (`_switches`)."""
    return r["fp8_fast_accum"] if "fp8_fast_accum" in r else "TUNEKIT_FP8_FAST_ACCUM=1" in _switches(r)


def judge_fp8(rs: dict[str, dict]) -> dict:
    """FP8's target: the fastest configuration's newest step bench at `FP8_TOKENS` or more, and whole runs of the
    recipe in FP8 of the same arithmetic (fast accumulation or not) within bf16's run-to-run band
    (`runlog.fp8_band`)."""
    from tunekit_course.runlog import band_results, fp8_band, fp8_kind

    benches = fp8_benches(rs)
    want = f">= {FP8_TOKENS:,} tok/s and a loss curve within bf16's run-to-run band"
    if not benches:
        return {"state": "unmeasured", "text": f"LoRA FP8, {LLAMA2}: target {want}, unmeasured", "files": ()}
    best = max(benches, key=lambda r: r["tokens_per_s"])
    fast_accum = accumulates_fast(best)  # judged by the band runs of its arithmetic
    band = fp8_band(*band_results(rs, fp8_kind(fast_accum)))
    learns = ("unmeasured" if band is None else "within it" if band["within"] else "outside it") + (
        " (with fast accumulation, as this bench)" if fast_accum else "")
    fast = best["tokens_per_s"] >= FP8_TOKENS
    state = "met" if fast and band and band["within"] else "missed" if not fast or band else "unmeasured"
    gpu = (best.get("gpu") or "GPU").removeprefix("NVIDIA ")
    return {"state": state, "files": (best["name"],),
            "text": f"LoRA FP8, {LLAMA2}: {best['tokens_per_s']:,.0f} tok/s at {best['peak_memory_gb']:.1f} GB, batch "
                    f"{best['config']['batch_size']}, {gpu} (`{best['name']}`, the fastest of {len(benches)} "
                    f"configurations' newest runs); the whole runs against bf16's band: {learns} (target {want}: "
                    f"{state})"}


def judge_all(rs: dict[str, dict]) -> list[dict]:
    """Every target on every shape it names, then FP8's."""
    return [judge_target(rs, t, shape) for t in TARGETS for shape in t.shapes] + [judge_fp8(rs)]


# ---- what is left: where a profiled step's time goes, and how much faster it could get ---------------------------

CORE = ("matmul", "attention")  # the work a step cannot do without; the rest is what fusion can take out


def _switches(r: dict) -> set[str]:
    """The environment a run set that changes its kernels (`results.BEHAVIOUR_ENV`), defaults left out."""
    return set(re.findall(r"TUNEKIT_\w+=\S+", r.get("entry") or "")) - {"TUNEKIT_OFFLOAD_STREAM=0"}


def twin(p: dict, rs: dict[str, dict]) -> dict | None:
    """The step bench (`tunekit bench` unprofiled) of profile `p`'s configuration, code and GPU: its step time
    is the step's own, without the profiler's overhead."""
    return next((r for r in sorted(rs.values(), key=lambda r: r["name"])
                 if str(r.get("call", "")).startswith("bench.run_bench(") and r.get("config") == p.get("config")
                 and r.get("gpu") == p.get("gpu") and r.get("commit") == p.get("commit")
                 and _switches(r) == _switches(p) and r.get("step_time_s")), None)


def headroom(p: dict, rs: dict[str, dict]) -> dict:
    """Profile `p` read for what is left: its kernels' time a step, the matrix products' and attention's
    (`CORE`), everything else, the step's own time where a bench of the same configuration, code and GPU has it
    (`twin`) and so the time the GPU waited on the host, and the bound: how much faster the step could be with
    nothing but `CORE` left and the GPU never waiting (an upper bound, not a forecast). A profile taken before
    a kernel's category changed (`bench.step.categorize`) has its costliest kernels moved to today's categories
    (its `top`; the rest it recorded by category only); `moved` says how much time that moved."""
    from tunekit.bench.step import categorize

    cats = {b["category"]: b["seconds"] for b in p["breakdown"]}
    moved = 0.0
    for k in p.get("top") or []:
        if (now := categorize(k["kernel"])) != k["category"]:
            cats[k["category"]] -= k["seconds"]
            cats[now] = cats.get(now, 0.0) + k["seconds"]
            moved += k["seconds"]
    core = sum(cats.get(c, 0.0) for c in CORE)
    bench = twin(p, rs)
    step = bench["step_time_s"] if bench else None
    return {"kernels": p["kernel_s_per_step"], "core": core, "rest": p["kernel_s_per_step"] - core,
            "categories": cats, "moved": moved, "bench": bench and bench["name"], "step": step,
            "waiting": None if step is None else max(0.0, step - p["kernel_s_per_step"]),
            "bound": (step or p["kernel_s_per_step"]) / core if core else None}


def headroom_table(rs: dict[str, dict]) -> str:
    """Every profile of a 7B step (`tunekit bench --profile`), newest first, read by `headroom`."""
    rows = [("| profile | step | step, ms (bench) | kernels, ms | matmul | attention | everything else | GPU waiting "
             "| at most, with matmul and attention alone | commit |"), "|---|---|---|---|---|---|---|---|---|---|"]
    profiles = [r for r in rs.values() if str(r.get("call", "")).startswith("bench.profile_step(") and r.get("gpu")]
    def ms(s: float | None) -> str:
        return "-" if s is None else f"{1e3 * s:.1f}"

    for p in sorted(profiles, key=lambda r: r.get("date", ""), reverse=True):
        h = headroom(p, rs)
        rest = ", ".join(f"{c} {ms(s)}" for c, s in sorted(h["categories"].items(), key=lambda x: -x[1])
                         if c not in CORE and s >= 5e-4)
        step = "-" if h["step"] is None else f"{ms(h['step'])} (`{h['bench']}`)"
        moved = f" ({ms(h['moved'])} ms recategorized)" if h["moved"] else ""
        rows.append(f"| `{p['name']}` | {setup(p)} | {step} | {ms(h['kernels'])}{moved} | "
                    f"{ms(h['categories'].get('matmul'))} | {ms(h['categories'].get('attention'))} | {ms(h['rest'])}: "
                    f"{rest} | {ms(h['waiting'])} | {h['bound']:.2f}x | {(p.get('commit') or '-')[:7]} |")
    if len(rows) == 2:
        rows.append("| *(no profile yet)* | | | | | | | | | |")
    return "\n".join(rows)
