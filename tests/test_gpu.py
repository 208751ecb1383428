"""GPU-only checks: run with `pytest -m gpu` on a CUDA machine (skipped elsewhere, with the reason)."""

import pytest
import torch

from tunekit import bench, config, train

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")]

SMALL = dict(hidden_size=256, num_layers=2, num_heads=4, intermediate_size=688, vocab_size=1024,
             tokenizer_vocab=1024, max_length=128, batch_size=4)


def grads_after_step(cfg, batch):
    device, dtype = train.resolve_runtime(cfg)
    model = train.build_training_model(cfg, cfg.vocab_size, device, dtype, verbose=False)
    autocast = dtype if dtype != torch.float32 else None
    b = train.to_device(batch, device)
    loss = train.micro_step(model, b, train.count_targets([b]), autocast)
    return loss.item(), {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.requires_grad}


def test_bf16_autocast_step_matches_fp32(tmp_path):
    """The bf16 fast path computes the same loss and gradients as fp32, within bf16 rounding."""
    ids = torch.randint(0, 1024, (4, 128), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    loss32, g32 = grads_after_step(config.tiny(**SMALL, dtype="fp32", device="cuda", out_dir=str(tmp_path)), batch)
    loss16, g16 = grads_after_step(config.tiny(**SMALL, dtype="bf16", device="cuda", out_dir=str(tmp_path)), batch)
    assert abs(loss16 - loss32) / loss32 < 1e-2
    for name in g32:
        rel = (g16[name] - g32[name]).norm() / g32[name].norm().clamp_min(1e-12)
        assert rel < 5e-2, f"{name}: relative gradient error {rel:.3g}"


def test_qlora_step_runs_and_counts_full_parameters(tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes")
    cfg = config.tiny(**SMALL, method="qlora", grad_ckpt=True, device="cuda", bench_warmup=1, bench_steps=2,
                      out_dir=str(tmp_path))
    monkeypatch.setenv("TUNEKIT_CACHE", str(tmp_path / "cache"))  # the random-init checkpoint it saves
    result = bench.run_bench(cfg, verbose=False)
    lora = bench.run_bench(config.tiny(**SMALL, device="cuda", bench_warmup=1, bench_steps=2,
                                       out_dir=str(tmp_path)), verbose=False)
    assert result["tokens_per_s"] > 0 and result["peak_memory_gb"] > 0
    assert result["params_total"] == lora["params_total"]  # 4-bit weights count as the weights they encode
    assert result["params_trainable"] == lora["params_trainable"]


def test_bench_on_gpu_reports_memory_and_mfu(tmp_path):
    cfg = config.tiny(**SMALL, device="cuda", bench_warmup=1, bench_steps=3, out_dir=str(tmp_path))
    r = bench.run_bench(cfg, verbose=False)
    assert r["peak_memory_gb"] > 0 and r["memory_measure"] == "torch.cuda.max_memory_allocated"
    if bench.peak_flops(r["gpu"]):
        assert 0 < r["mfu"] < 1
