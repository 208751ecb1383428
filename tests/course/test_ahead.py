"""tunekit against Unsloth: a step's setup in words, and what a profile says is left (`tunekit_course.ahead`)."""

from __future__ import annotations

from tunekit_course import ahead

ARCH = {"hidden_size": 4096, "num_layers": 32, "num_kv_heads": 32, "intermediate_size": 11008, "vocab_size": 32000}
CONFIG = {**ARCH, "preset": "llama7b_lora", "method": "lora", "batch_size": 4, "max_length": 2048, "grad_ckpt": False,
          "compile": "regional", "fast_lora": True, "fast_lora_group": True, "fp8": True}


def _profile(**extra) -> dict:
    return {"name": "p", "call": "bench.profile_step(...)", "gpu": "NVIDIA H200", "commit": "abc", "date": "2026-12-02",
            "entry": "tunekit bench --profile", "config": CONFIG, "kernel_s_per_step": 0.300,
            "breakdown": [{"category": "matmul", "seconds": 0.230}, {"category": "attention", "seconds": 0.030},
                          {"category": "copy, cast", "seconds": 0.040}],
            # recorded when inductor's fused quantizing reductions still counted as matrix products
            "top": [{"kernel": "triton_red_fused__scaled_mm__to_copy_abs_amax_silu_0", "seconds": 0.020,
                     "category": "matmul"}], **extra}


def _bench(name: str, **extra) -> dict:
    return {"name": name, "call": "bench.run_bench(...)", "gpu": "NVIDIA H200", "commit": "abc", "config": CONFIG,
            "entry": "tunekit bench", "step_time_s": 0.320, "tokens_per_s": 25_600, **extra}


def test_setup_says_what_tunekit_switched_on():
    r = {"config": {**CONFIG, "method": "qlora", "grad_ckpt": True, "grad_ckpt_offload": True,
                    "compile_recompute": True, "fast_lora_group": False}, "gpu": "NVIDIA H100 80GB HBM3",
         "entry": "TUNEKIT_OFFLOAD_STREAM=1 tunekit bench"}
    assert ahead.setup(r, among_stacks=True) == (
        "`llama7b_lora` shape, qlora b4x2048, ckpt offloaded on a side stream, tunekit regional compile recomputing, "
        "tunekit's fused LoRA reading the 4-bit weights into FP8, H100 80GB HBM3")
    assert ahead.setup({"config": CONFIG}) == ("`llama7b_lora` shape, lora b4x2048, regional compile, fused LoRA "
                                               "grouped with FP8 weights")


def test_headroom_reads_a_profile_against_its_own_step():
    rs = {"p": _profile(), "other_commit": _bench("other_commit", commit="def", step_time_s=0.5),
          "other_env": _bench("other_env", entry="TUNEKIT_FP8_FAST_ACCUM=1 tunekit bench", step_time_s=0.5),
          "twin": _bench("twin", entry="TUNEKIT_OFFLOAD_STREAM=0 tunekit bench")}  # the default: the same step
    h = ahead.headroom(rs["p"], rs)
    assert h["bench"] == "twin" and abs(h["waiting"] - 0.020) < 1e-9
    # the quantizing reduction moved out of the matrix products: 0.21 + 0.03 of the 0.32 s step are the core
    assert abs(h["categories"]["matmul"] - 0.210) < 1e-9 and abs(h["categories"]["fp8 quantize"] - 0.020) < 1e-9
    assert abs(h["core"] - 0.240) < 1e-9 and abs(h["rest"] - 0.060) < 1e-9 and abs(h["moved"] - 0.020) < 1e-9
    assert abs(h["bound"] - 0.320 / 0.240) < 1e-9
    row = ahead.headroom_table(rs).splitlines()[2]
    assert row.startswith("| `p` | `llama7b_lora` shape, lora b4x2048, regional compile, fused LoRA grouped with FP8 "
                          "weights, H200 | 320.0 (`twin`) | 300.0 (20.0 ms recategorized) | 210.0 | 30.0 | 60.0: "
                          "copy, cast 40.0, fp8 quantize 20.0 | 20.0 | 1.33x | abc |"), row
    # without a bench of the same step, the bound is on the kernels' time and the waiting is unknown
    alone = ahead.headroom(rs["p"], {"p": rs["p"]})
    assert alone["step"] is None and alone["waiting"] is None and abs(alone["bound"] - 0.300 / 0.240) < 1e-9
    assert "no profile yet" in ahead.headroom_table({})


def _whole(name: str, seed: int, shift: float) -> dict:
    """A whole run of the FP8 band (`runlog.BAND_RUNS`): 40 logged steps and two held-out losses, `shift` above."""
    cfg = {"data": "gsm8k", "batch_size": 4, "grad_accum": 1, "max_length": 2048, "packing": "pack", "epochs": 3.0,
           "max_steps": 0, "seed": seed}
    return {"name": name, "config": cfg, "eval_losses": [[20, 5.0 + seed * 0.04 + shift], [40, 4.0 + seed * 0.02]],
            "curve": [[s, 10.0 - s / 10 + seed * 0.1 + shift, 1.0, 1.0] for s in range(1, 41)]}


def test_the_fp8_target_reads_the_band_runs_of_its_benchs_arithmetic():
    """The fastest FP8 bench with fast accumulation is judged by the band's fast-accumulation runs, not by the
    runs without it; where those are missing its learning is unmeasured."""
    band = {r["name"]: r for r in (_whole("l5c_bf16_s0", 0, 0.0), _whole("l5c_bf16_s1", 1, 0.0),
                                   _whole("l5c_fp8_s0", 0, 0.01))}
    fast = _bench("b_fast", entry="TUNEKIT_FP8_FAST_ACCUM=1 tunekit bench", tokens_per_s=27_500, peak_memory_gb=60.0)
    plain = _bench("b_plain", tokens_per_s=27_100, peak_memory_gb=60.0, config={**CONFIG, "batch_size": 8})
    rs = {**band, "b_fast": fast, "b_plain": plain}
    j = ahead.judge_fp8(rs)
    assert j["files"] == ("b_fast",) and j["state"] == "unmeasured"
    assert "against bf16's band: unmeasured (with fast accumulation, as this bench)" in j["text"]
    j = ahead.judge_fp8({**rs, "l5c_fp8fast_s0": _whole("l5c_fp8fast_s0", 0, 0.01)})
    assert j["state"] == "met" and "within it (with fast accumulation" in j["text"]
    j = ahead.judge_fp8({**rs, "l5c_fp8fast_s0": _whole("l5c_fp8fast_s0", 0, 0.2)})  # 0.2 nats off: outside
    assert j["state"] == "missed" and "outside it" in j["text"]
    j = ahead.judge_fp8({**band, "b_plain": plain})  # without fast accumulation: the runs without it
    assert j["state"] == "met" and "within it;" not in j["text"] and "within it (target" in j["text"]
    # since fast accumulation is the default a result says so itself; older ones in their command alone
    assert ahead.accumulates_fast({**plain, "fp8_fast_accum": True}) and ahead.accumulates_fast(fast)
    assert not ahead.accumulates_fast(plain) and not ahead.accumulates_fast({**fast, "fp8_fast_accum": False})
