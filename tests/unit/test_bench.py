"""Benchmarks: the result dict, saving and loading results, the table and plot, FLOPs, timing."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from helpers import SMALL_ARCH

from tunekit import bench, results, train
from tunekit.bench.loop import run_epoch, run_train_loop
from tunekit.bench.step import by_launcher, categorize, profile_step, run_bench
from tunekit.bench.timing import PEAK_BF16, flops_per_token, measure_step, median_error, peak_flops, spread
from tunekit.data import prepared
from tunekit.model import llama_config
from tunekit.prepare import prepare_key
from tunekit.presets import tiny


@pytest.fixture(scope="module")
def result(tmp_path_factory, small_data):
    cfg = tiny(out_dir=str(tmp_path_factory.mktemp("bench") / "run"), data=str(small_data), batch_size=4,
               max_length=32, bench_warmup=1, bench_steps=2, **SMALL_ARCH)
    return cfg, run_bench(cfg, name="tiny-cpu", verbose=False)


def test_run_bench_result(result):
    cfg, r = result
    for key in (*results.REQUIRED_KEYS, *results.PROVENANCE_KEYS):
        assert key in r, key
    assert r["code_hash"] == results.code_hash() and r["call"].startswith("bench.run_bench(")
    assert r["name"] == "tiny-cpu" and r["preset"] == "tiny" and r["world_size"] == 1
    assert cfg.bench_steps <= len(r["step_times_s"]) <= cfg.bench_max_steps and all(t > 0 for t in r["step_times_s"])
    # the times are saved rounded to 10 us: on a CPU step of a few ms that moves the interquartile range over the
    # median by up to ~1e-5 / median (seen in CI: 0.0462 saved, 0.0484 from the rounded times of 2 ms steps)
    median = statistics.median(r["step_times_s"])
    assert r["step_time_spread"] == pytest.approx(spread(r["step_times_s"]), abs=1e-4 + 3e-5 / median)
    assert r["tokens_per_step"] == cfg.batch_size * cfg.grad_accum * cfg.max_length
    assert r["tokens_per_s"] > 0
    # step_time_s is saved rounded to 10 us too: up to 5e-6 / step_time_s of relative error
    assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_time_s"], rel=1e-3 + 5e-6 / r["step_time_s"])
    assert 0 < r["params_trainable"] < r["params_total"]  # LoRA
    assert r["config"] == {**r["config"], "hidden_size": cfg.hidden_size, "preset": "tiny"}
    assert r["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert r["peak_memory_gb"] >= 0 and r["peak_reserved_gb"] >= r["peak_memory_gb"]
    if not torch.cuda.is_available():
        assert r["gpu"].startswith("cpu") and r["mfu"] is None
    json.dumps(r)  # serialisable as is


# ---- FLOPs ---------------------------------------------------------------------------------------


def _linear_weights_7b() -> tuple[int, int]:
    """(weights in nn.Linear layers, all parameters) of the Llama-2-7B shape, counted on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(llama_config(4096, 32, 32, 11008, 32000))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return linear, sum(p.numel() for p in model.parameters())


def test_flops_per_token_7b_full():
    linear, total = _linear_weights_7b()
    assert total == pytest.approx(6.74e9, rel=0.001)
    seq, layers, hidden = 2048, 32, 4096
    # Causal attention: scores and values are 2 * (seq/2) * hidden MACs per layer = 2*seq*hidden FLOPs
    # forward; training is forward + 2x backward.
    attention = 3 * layers * 2 * seq * hidden
    got = flops_per_token(4096, 32, 32, 32, 11008, 32000, seq, "full")
    assert got == pytest.approx(6 * 6.74e9 + attention, rel=0.02)
    assert got == pytest.approx(6 * linear + attention, rel=1e-6)  # every matmul weight, no embedding lookup


def test_flops_per_token_count_heads_wider_than_hidden_over_heads():
    # Gemma-2-9B: 16 heads of 256 in a width of 3584 (not 224): q/k/v/o and attention are counted at 256
    hidden, layers, heads, kv, inter, vocab, seq = 3584, 42, 16, 8, 14336, 256000, 2048
    got = flops_per_token(hidden, layers, heads, kv, inter, vocab, seq, "full", head_dim=256)
    linear = layers * (hidden * 16 * 256 * 2 + hidden * 8 * 256 * 2 + 3 * hidden * inter) + hidden * vocab
    assert got == pytest.approx(6 * linear + 3 * layers * 2 * seq * 16 * 256, rel=1e-9)
    assert got > flops_per_token(hidden, layers, heads, kv, inter, vocab, seq, "full")


def test_lora_flops_are_two_thirds_of_full():
    args = (4096, 32, 32, 32, 11008, 32000)
    full_short = flops_per_token(*args, 1, "full")
    lora_short = flops_per_token(*args, 1, "lora")
    assert lora_short / full_short == pytest.approx(2 / 3, rel=1e-3)
    # At seq 2048 attention (the same in both) pulls the ratio a little above 2/3.
    ratio = flops_per_token(*args, 2048, "lora") / flops_per_token(*args, 2048, "full")
    assert 2 / 3 < ratio < 0.75
    # Adapter weights train fully: 6 FLOPs per adapter weight per token.
    extra = flops_per_token(*args, 2048, "lora", lora_params=1_000_000) - \
        flops_per_token(*args, 2048, "lora")
    assert extra == pytest.approx(6e6)


def test_gqa_reduces_kv_flops():
    mha = flops_per_token(4096, 32, 32, 32, 11008, 32000, 2048, "full")
    gqa = flops_per_token(4096, 32, 32, 8, 11008, 32000, 2048, "full")
    # k and v projections shrink from 4096x4096 to 4096x1024 in each of 32 layers.
    assert mha - gqa == pytest.approx(6 * 32 * 2 * 4096 * (4096 - 1024))


def test_peak_flops_lookup():
    assert peak_flops("NVIDIA H200") == PEAK_BF16["H200"]
    assert peak_flops("NVIDIA A100-SXM4-80GB") == PEAK_BF16["A100"]
    assert peak_flops("NVIDIA A10G") == PEAK_BF16["A10"]
    assert peak_flops("NVIDIA L40S") == PEAK_BF16["L40S"]
    assert peak_flops("cpu (x86_64)") is None


# ---- timing --------------------------------------------------------------------------------------


def test_measure_step_counts_calls():
    calls = []
    times = measure_step(lambda: calls.append(1), warmup=3, steps=5, device="cpu")
    assert len(calls) == 8 and len(times) == 5 and all(t >= 0 for t in times)


def test_measure_step_times_only_timed_calls():
    import time

    n = []

    def step():
        n.append(1)
        time.sleep(0.3 if len(n) <= 2 else 0.0)  # slow warm-up must not show in the times

    times = measure_step(step, warmup=2, steps=3, device="cpu")
    assert len(n) == 5 and sum(times) < 0.25


def test_measure_step_times_more_steps_while_the_median_is_uncertain(monkeypatch):
    """On a fake clock, so a busy machine cannot make steady steps look noisy."""
    import itertools

    clock = [0.0]
    monkeypatch.setattr(bench.timing.time, "perf_counter", lambda: clock[0])

    def step(durations):
        return lambda: clock.__setitem__(0, clock[0] + next(durations))

    # Steps scattered from 1 to 40 ms: the median stays uncertain, so timing goes on to the cap.
    times = measure_step(step(itertools.cycle([0.001, 0.04, 0.02, 0.03, 0.005])), warmup=0, steps=4, device="cpu",
                               max_steps=12, target_error=0.01)
    assert len(times) == 12
    # Steady steps: the minimum is enough.
    steady = measure_step(step(itertools.repeat(0.002)), warmup=0, steps=4, device="cpu", max_steps=12,
                                target_error=0.5)
    assert len(steady) == 4 and steady == pytest.approx([0.002] * 4)


def test_median_error_and_spread():
    assert median_error([1.0, 1.0, 1.0, 1.0]) == 0.0
    assert median_error([1.0, 2.0]) == float("inf")  # too few to say
    times = [1.0, 1.1, 0.9, 1.0, 1.2, 0.8, 1.0, 1.0]
    mad = 0.05  # |t - 1.0|: 0, .1, .1, 0, .2, .2, 0, 0 -> median .05
    assert median_error(times) == pytest.approx(1.2533 * 1.4826 * mad / 8 ** 0.5)
    # quartiles (exclusive method) of the sorted times .8 .9 1 1 1 1 1.1 1.2: q1 = .925, q3 = 1.075
    assert spread(times) == pytest.approx(0.15)
    assert spread([1.0, 2.0]) == 0.0


# ---- the training loop itself ----------------------------------------------------------------------


def test_run_train_loop_times_the_real_loop(tmp_path, small_data):
    cfg = tiny(out_dir=str(tmp_path / "unused"), data=str(small_data), batch_size=2, max_length=128,
               bench_warmup=1, bench_max_steps=6, **SMALL_ARCH)
    r = run_train_loop(cfg, verbose=False)
    for key in (*results.REQUIRED_KEYS, *results.PROVENANCE_KEYS):
        assert key in r, key
    assert r["name"] == "train_tiny" and r["call"].startswith("bench.run_train_loop(")
    assert r["packing"] == "pack" and r["timed_steps"] == 5 == len(r["step_times_s"])  # warm-up step left out
    assert 0 < r["real_tokens_per_step"] <= cfg.batch_size * cfg.max_length
    assert r["padding_fraction"] == pytest.approx(1 - r["real_tokens_per_step"] / (2 * 128), abs=1e-3)
    seconds = sum(r["step_times_s"])
    assert r["tokens_per_s"] == pytest.approx(r["real_tokens_per_step"] * 5 / seconds, rel=1e-2)
    assert r["samples_per_step"] > cfg.batch_size  # packed rows hold several samples
    assert not (tmp_path / "unused").exists(), "the timed run goes to a scratch folder"
    # The config recorded is the one asked for (`auto` packing); what it resolved to is `packing`.
    assert r["config"]["packing"] == "auto"


def test_run_epoch_times_a_run_from_nothing(tmp_path, small_data, monkeypatch):
    """`bench --epoch F`: `tunekit train --epochs F` in a fresh folder; its parts add up to the wall time, the
    steps' real tokens give tok/s, the loss curve is against seconds since start, and a whole epoch is
    projected from the steps' share."""
    cfg = tiny(data=str(small_data), max_length=128, batch_size=4, packing="pad", eval_data=str(small_data),
                      **SMALL_ARCH)
    r = run_epoch(cfg, 0.5, "epoch_tiny", verbose=False)
    t = r["timings"]
    parts = t["start_s"] + t["prepare_s"] + t["build_s"] + t["train_s"]
    assert parts <= r["wall_s"] + 0.5 and r["wall_s"] - parts < 5  # (the final save and summary are the rest)
    assert r["steps"] == 8 and r["samples_seen"] == 32  # 64 records, half an epoch, batches of 4
    # The first step (compiling, warming up) is paid once: it is not in tok/s, nor scaled up with the rest.
    later_s = t["train_s"] - t["eval_s"] - t["first_step_s"]
    assert 0 < t["first_step_s"] < t["train_s"]
    per_step = r["tokens_seen"] / r["steps"]
    assert r["tokens_seen"] - 2 * per_step < r["tokens_timed"] < r["tokens_seen"]  # one step's tokens left out
    assert r["tokens_per_s"] == pytest.approx(r["tokens_timed"] / later_s, rel=1e-3)
    assert r["epoch_s_projected"] == pytest.approx(t["start_s"] + t["prepare_s"] + t["build_s"] + t["first_step_s"]
                                                   + 2 * later_s + t["eval_s"], abs=0.2)
    times = [x for x, _ in r["curve"]]
    assert times == sorted(times) and len(r["curve"]) == 8 and r["eval_loss"] is not None
    # From nothing each time: the prepared-data cache the run filled is emptied before the next one starts.
    folder = prepared.cache_folder(prepare_key(cfg))
    assert folder.is_dir()
    seen = []

    def no_run(run, **kwargs):
        seen.append(folder.exists())
        raise RuntimeError("not run")

    monkeypatch.setattr(train, "train", no_run)
    with pytest.raises(RuntimeError, match="not run"):
        run_epoch(cfg, 0.5, "epoch_tiny", verbose=False)
    assert seen == [False]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="share of one epoch"):
        run_epoch(cfg, 1.5)


def test_profile_step_says_where_the_time_goes(tmp_path):
    r = profile_step(tiny(max_length=128, vocab_size=256, out_dir=str(tmp_path), **SMALL_ARCH), steps=2,
                           warmup=1, verbose=False)
    assert sum(x["share"] for x in r["breakdown"]) == pytest.approx(1.0, abs=1e-3)
    cats = {x["category"] for x in r["breakdown"]}
    assert {"matmul", "attention"} <= cats and r["kernel_s_per_step"] <= r["step_wall_s"] * 1.5
    assert r["top"][0]["seconds"] == max(x["seconds"] for x in r["top"])
    # the matrix products by shape: the tiny model's LoRA products [tokens, hidden] x [hidden, r] among them
    shapes = {(g["op"], g["shapes"]) for g in r["gemms"]}
    assert r["gemms"] and all(g["seconds"] > 0 and g["calls"] >= 1 for g in r["gemms"])
    assert any(op == "aten::mm" and sh.endswith(", 16]]") for op, sh in shapes), shapes  # x A^T, r 16
    assert r["by_launcher"] == []  # kernels launched by operators: a CUDA profile's
    # GPU kernel names land where a reader expects them
    names = {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul", "nvjet_tst_128x256_64x4": "matmul",
             "flash_fwd_kernel<Flash_fwd_kernel_traits>": "attention", "cudnn_generated_fort_native_sdpa_sm90": "attention",
             "void multi_tensor_apply_kernel<adam>": "optimizer", "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "communication",
             "void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>": "dequantize",
             "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>": "elementwise, other",
             # inductor's fused kernels are named after the ops they hold, the matmul they feed included: not GEMMs
             # (seen on the H200: FP8's activation scaling, 44 ms a step, had been counted as matmul)
             "triton_red_fused__scaled_mm__to_copy_abs_add_amax_bmm_cat_clamp_exp2_floor_log2_mul": "fp8 quantize",
             "triton_poi_fused_add_bmm_squeeze_13": "elementwise, other",
             "triton_poi_fused_add_mul_silu_silu_backward_view_3": "norm, activation, rope",
             "triton_tem_fused_mm_0": "matmul", "Memcpy DtoD (Device -> Device)": "copy, cast", "nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT": "matmul"}
    assert {n: categorize(n) for n in names} == names


def test_by_launcher_groups_kernels_by_the_operator_and_pass_that_launched_them():
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType

    def ev(name, parent=None, kernels=(), device=DeviceType.CPU):
        return E(name=name, cpu_parent=parent, device_type=device,
                 kernels=[E(name=n, duration=us) for n, us in kernels])

    fwd = ev("## Call CompiledFxGraph abc ##", ev("CompiledFunction"))
    engine = ev("autograd::engine::evaluate_function")
    bwd = ev("## Call CompiledFxGraph def ##", ev("CompiledFunctionBackward", engine))
    events = [ev("aten::addmm", fwd, [("nvjet_badd", 300.0), ("Memcpy DtoD (Device -> Device)", 200.0)]),
              ev("aten::addmm", fwd, [("nvjet_badd", 300.0)]), ev("aten::mm", bwd, [("nvjet", 1000.0)]),
              ev("aten::mm", fwd, [("nvjet", 600.0)]), fwd, bwd,  # ranges that launch nothing themselves
              ev("nvjet", device=DeviceType.CUDA)]  # the kernels' own device events are not launchers
    rows = by_launcher(events, steps=2)
    assert [(r["op"], r["phase"], r["seconds"], r["launches"]) for r in rows] == [
        ("aten::mm", "backward", 0.0005, 0.5), ("aten::addmm", "forward", 0.0004, 1.5),
        ("aten::mm", "forward", 0.0003, 0.5)]
    assert rows[1]["kernels"] == {"nvjet_badd": 0.0003, "Memcpy DtoD (Device -> Device)": 0.0001}
