"""Benchmarks: the result dict, saving and loading results, the table and plot, FLOPs, timing."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import SMALL_ARCH

from tunekit import bench
from tunekit.config import tiny
from tunekit.model import llama_config


@pytest.fixture(scope="module")
def result(tmp_path_factory, small_data):
    cfg = tiny(out_dir=str(tmp_path_factory.mktemp("bench") / "run"), data=str(small_data), batch_size=4,
               max_length=32, bench_warmup=1, bench_steps=2, **SMALL_ARCH)
    return cfg, bench.run_bench(cfg, name="tiny-cpu", verbose=False)


def test_run_bench_result(result):
    cfg, r = result
    for key in bench.REQUIRED_KEYS:
        assert key in r, key
    assert r["name"] == "tiny-cpu" and r["preset"] == "tiny" and r["world_size"] == 1
    assert len(r["step_times_s"]) == cfg.bench_steps and all(t > 0 for t in r["step_times_s"])
    assert r["tokens_per_step"] == cfg.batch_size * cfg.grad_accum * cfg.max_length
    assert r["tokens_per_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_time_s"], rel=1e-3)
    assert 0 < r["params_trainable"] < r["params_total"]  # LoRA
    assert r["config"] == {**r["config"], "hidden_size": cfg.hidden_size, "preset": "tiny"}
    assert r["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert r["peak_memory_gb"] >= 0 and r["peak_reserved_gb"] >= r["peak_memory_gb"]
    if not torch.cuda.is_available():
        assert r["gpu"].startswith("cpu") and r["mfu"] is None
    json.dumps(r)  # serialisable as is


def test_save_and_load_results(tmp_path, result):
    _, r = result
    in_folder = bench.save_result(r, tmp_path / "results")
    assert in_folder == tmp_path / "results" / "tiny-cpu.json"
    as_file = bench.save_result({**r, "name": "other"}, tmp_path / "x" / "mine.json")
    assert as_file == tmp_path / "x" / "mine.json"
    for path in (in_folder, as_file):
        assert json.loads(path.read_text())["tokens_per_s"] == r["tokens_per_s"]
    loaded = bench.load_results(tmp_path / "results", as_file)
    assert [x["name"] for x in loaded] == ["tiny-cpu", "other"]
    assert loaded[0]["_file"] == str(in_folder)


def test_load_results_rejects_missing_keys(tmp_path):
    path = tmp_path / "partial.json"
    path.write_text(json.dumps({"name": "x", "tokens_per_s": 1.0}))
    with pytest.raises(ValueError) as e:
        bench.load_results(path)
    assert str(path) in str(e.value)
    assert "gpu" in str(e.value) and "peak_memory_gb" in str(e.value)


def test_load_results_rejects_bad_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"name": "x",\n')
    with pytest.raises(ValueError) as e:
        bench.load_results(tmp_path)  # a folder: every *.json in it
    assert str(path) in str(e.value) and "JSON" in str(e.value)


def test_format_table(result):
    _, r = result
    table = bench.format_table([r, {**r, "name": "second", "mfu": 0.4321}])
    lines = table.splitlines()
    assert len(lines) == 4 and lines[0].startswith("| name")
    assert "tiny-cpu" in lines[2] and "second" in lines[3] and "43.2%" in lines[3]


def test_plot_results(result):
    import matplotlib
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    assert matplotlib.get_backend().lower() == "agg"
    _, r = result
    fig = bench.plot_results([r, {**r, "name": "second"}], reference={"paper": 100.0}, title="t")
    try:
        assert isinstance(fig, Figure) and len(fig.axes) == 2
        labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
        assert labels == ["tiny-cpu", "second"]
    finally:
        plt.close(fig)


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
    got = bench.flops_per_token(4096, 32, 32, 32, 11008, 32000, seq, "full")
    assert got == pytest.approx(6 * 6.74e9 + attention, rel=0.02)
    assert got == pytest.approx(6 * linear + attention, rel=1e-6)  # every matmul weight, no embedding lookup


def test_lora_flops_are_two_thirds_of_full():
    args = (4096, 32, 32, 32, 11008, 32000)
    full_short = bench.flops_per_token(*args, 1, "full")
    lora_short = bench.flops_per_token(*args, 1, "lora")
    assert lora_short / full_short == pytest.approx(2 / 3, rel=1e-3)
    # At seq 2048 attention (the same in both) pulls the ratio a little above 2/3.
    ratio = bench.flops_per_token(*args, 2048, "lora") / bench.flops_per_token(*args, 2048, "full")
    assert 2 / 3 < ratio < 0.75
    # Adapter weights train fully: 6 FLOPs per adapter weight per token.
    extra = bench.flops_per_token(*args, 2048, "lora", lora_params=1_000_000) - \
        bench.flops_per_token(*args, 2048, "lora")
    assert extra == pytest.approx(6e6)


def test_gqa_reduces_kv_flops():
    mha = bench.flops_per_token(4096, 32, 32, 32, 11008, 32000, 2048, "full")
    gqa = bench.flops_per_token(4096, 32, 32, 8, 11008, 32000, 2048, "full")
    # k and v projections shrink from 4096x4096 to 4096x1024 in each of 32 layers.
    assert mha - gqa == pytest.approx(6 * 32 * 2 * 4096 * (4096 - 1024))


def test_peak_flops_lookup():
    assert bench.peak_flops("NVIDIA H200") == bench.PEAK_BF16["H200"]
    assert bench.peak_flops("NVIDIA A100-SXM4-80GB") == bench.PEAK_BF16["A100"]
    assert bench.peak_flops("NVIDIA A10G") == bench.PEAK_BF16["A10"]
    assert bench.peak_flops("NVIDIA L40S") == bench.PEAK_BF16["L40S"]
    assert bench.peak_flops("cpu (x86_64)") is None


# ---- timing --------------------------------------------------------------------------------------


def test_measure_step_counts_calls():
    calls = []
    times = bench.measure_step(lambda: calls.append(1), warmup=3, steps=5, device="cpu")
    assert len(calls) == 8 and len(times) == 5 and all(t >= 0 for t in times)


def test_measure_step_times_only_timed_calls():
    import time

    n = []

    def step():
        n.append(1)
        time.sleep(0.3 if len(n) <= 2 else 0.0)  # slow warm-up must not show in the times

    times = bench.measure_step(step, warmup=2, steps=3, device="cpu")
    assert len(n) == 5 and sum(times) < 0.25


def test_versions_lists_packages():
    v = bench.versions()
    assert v["torch"] and v["transformers"] and v["python"]
    assert "bitsandbytes" in v  # None where not installed
