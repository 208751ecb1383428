"""Training: accumulation equals one big batch, the no-mask claim, a loss that falls, exact resume,
atomic checkpoints, adapter round trip, clear errors for bad setups, and runs that never lose work (a refused
folder, divergence on record, a resume that checks its config and checkpoints, SIGINT/SIGTERM)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import SMALL_ARCH, SMALL_ARCH_ARGS, gpu, write_jsonl
from safetensors.torch import load_file

from tunekit import checkpoint, config, train
from tunekit import model as mdl
from tunekit.build import batches_from, build_training, collator, resolve_runtime, resolved_config
from tunekit.config import REPO_ROOT
from tunekit.data import batching
from tunekit.data.batching import IGNORE, Collator
from tunekit.data.records import load_records
from tunekit.data.tokens import tokenize_dataset
from tunekit.io import atomic_write_text
from tunekit.optim import build_optimizer, build_scheduler
from tunekit.prepare import prepare, split_eval
from tunekit.presets import llama7b_after, llama7b_before, llama7b_lora, resolve, tiny
from tunekit.step import count_targets, evaluate, micro_step, train_step
from tunekit.stopping import Diverged, Interrupted, read_metrics
from tunekit_course.accumulation import accumulation_check

# ---- helpers -------------------------------------------------------------------------------------


def tiny_model(vocab: int, method: str = "full", seed: int = 0, attention: str = "sdpa"):
    """A random-init fp32 model; for LoRA the B matrices are randomised so every adapter weight gets a
    gradient (peft initialises B to zero, which would make A's gradients trivially zero)."""
    model = mdl.build_model(mdl.llama_config(vocab_size=vocab, **SMALL_ARCH), attention=attention, seed=seed)
    if method == "lora":
        torch.manual_seed(seed + 1)
        model = mdl.apply_lora(model, r=4, alpha=8)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
    return model


@pytest.fixture(scope="module")
def samples(tokenizer, small_data):
    ds, _ = tokenize_dataset(load_records(str(small_data)), tokenizer, 128)
    return [ds[i] for i in range(len(ds))]


def eight_of_varied_length(samples) -> list[dict]:
    """8 samples whose lengths differ, so micro-batches of 2 pad to other widths than the batch of 8."""
    by_len = sorted(samples, key=lambda s: len(s["input_ids"]))
    step = len(by_len) // 8
    chosen = [by_len[i * step] for i in range(8)]
    lengths = [len(s["input_ids"]) for s in chosen]
    assert max(lengths) - min(lengths) >= 8, lengths
    return chosen


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


# ---- gradient accumulation -----------------------------------------------------------------------


@pytest.mark.parametrize("method", ["full", "lora"])
def test_accumulation_equals_one_big_batch(method, samples, tokenizer):
    chosen = eight_of_varied_length(samples)
    collate = Collator(tokenizer.pad_token_id)
    big = collate(chosen)
    micro = [collate(chosen[i:i + 2]) for i in range(0, 8, 2)]
    assert any(m["input_ids"].shape[1] < big["input_ids"].shape[1] for m in micro)
    n_targets = count_targets(micro)
    assert n_targets == count_targets([big])
    assert n_targets == sum(sum(t != IGNORE for t in s["labels"][1:]) for s in chosen)

    one = tiny_model(len(tokenizer), method)
    loss_one = micro_step(one, big, n_targets, None)
    many = tiny_model(len(tokenizer), method)
    loss_many = sum(micro_step(many, b, n_targets, None) for b in micro)

    torch.testing.assert_close(loss_many, loss_one, rtol=1e-5, atol=1e-6)
    g_one, g_many = grads(one), grads(many)
    assert g_one.keys() == g_many.keys() and len(g_one) > 0
    for name in g_one:
        assert g_one[name].abs().sum() > 0, f"{name} has no gradient"
        torch.testing.assert_close(g_many[name], g_one[name], rtol=1e-4, atol=1e-6, msg=name)


def test_train_step_accumulated_matches_big_batch(samples, tokenizer):
    """Through `train_step`: same loss, same gradient norm, same update (SGD, lr 1, no clipping)."""
    chosen = eight_of_varied_length(samples)
    collate = Collator(tokenizer.pad_token_id)
    results, params = [], []
    for batches in ([collate(chosen)], [collate(chosen[i:i + 2]) for i in range(0, 8, 2)]):
        model = tiny_model(len(tokenizer))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = build_scheduler(opt, warmup_steps=0, max_steps=10, min_lr_ratio=1.0)
        results.append(train_step(model, batches, opt, sched, max_grad_norm=0.0, autocast_dtype=None))
        after = dict(model.named_parameters())
        assert all(p.grad is None for p in after.values()), "train_step must zero the gradients"
        params.append({n: before[n] - after[n].detach() for n in before})
    one, many = results
    assert one["targets"] == many["targets"]
    torch.testing.assert_close(many["loss"], one["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(many["grad_norm"], one["grad_norm"], rtol=1e-4, atol=1e-6)
    for name in params[0]:
        assert params[0][name].abs().sum() > 0
        torch.testing.assert_close(params[1][name], params[0][name], rtol=1e-4, atol=1e-6, msg=name)


def test_grad_clipping_bounds_the_norm(samples, tokenizer):
    """The gradients the optimizer applies are scaled to `max_grad_norm` when their norm is above it, untouched
    when it is 0 (off) or above their norm; the norm before clipping is what train_step reports."""
    batch = Collator(tokenizer.pad_token_id)(samples[:4])

    def applied(max_grad_norm: float) -> tuple[float, dict[str, torch.Tensor]]:
        """(reported norm, the gradients as optimizer.step sees them) for one step of a fresh model."""
        model = tiny_model(len(tokenizer))
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        names = {id(p): n for n, p in model.named_parameters()}
        seen = {}
        opt.register_step_pre_hook(lambda o, args, kwargs: seen.update(
            {names[id(p)]: p.grad.detach().clone() for g in o.param_groups for p in g["params"]}))
        sched = build_scheduler(opt, 0, 10, 1.0)
        out = train_step(model, [{k: v.clone() for k, v in batch.items()}], opt, sched,
                               max_grad_norm=max_grad_norm, autocast_dtype=None)
        return float(out["grad_norm"]), seen

    def norm(g: dict[str, torch.Tensor]) -> float:
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in g.values()])))

    full_norm, raw = applied(0.0)  # clipping off
    assert full_norm > 0 and norm(raw) == pytest.approx(full_norm, rel=1e-5)
    limit = full_norm / 4
    reported, clipped = applied(limit)
    assert reported == pytest.approx(full_norm, rel=1e-5)  # the norm before clipping is reported
    assert norm(clipped) == pytest.approx(limit, rel=1e-4) and norm(clipped) <= limit * (1 + 1e-5)
    for name, g in raw.items():  # the same direction, scaled down
        torch.testing.assert_close(clipped[name], g * (limit / full_norm), rtol=1e-4, atol=1e-9, msg=name)
    _, loose = applied(full_norm * 4)  # a limit above the norm changes nothing
    for name, g in raw.items():
        torch.testing.assert_close(loose[name], g, rtol=1e-6, atol=0, msg=name)


# ---- the no-attention-mask claim -----------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_right_padding_needs_no_attention_mask(attention, samples, tokenizer):
    batch = Collator(tokenizer.pad_token_id)(eight_of_varied_length(samples))
    mask = batch["attention_mask"]
    assert (mask == 0).any(), "the batch must contain padding"
    model = tiny_model(len(tokenizer), attention=attention).eval()
    with torch.no_grad():
        plain = model(input_ids=batch["input_ids"]).logits
        masked = model(input_ids=batch["input_ids"], attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(plain[real], masked[real], rtol=1e-5, atol=1e-5)


# ---- learning rate schedule ----------------------------------------------------------------------


def test_scheduler_warms_up_then_decays_to_min():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = build_scheduler(opt, warmup_steps=4, max_steps=20, min_lr_ratio=0.1)
    lrs = []
    for _ in range(25):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert all(a >= b for a, b in itertools.pairwise(lrs[4:])), "cosine must not increase"
    assert lrs[20] == pytest.approx(0.2) and lrs[24] == pytest.approx(0.2)


# ---- a real run ----------------------------------------------------------------------------------


def test_tiny_run_loss_falls(make_cfg):
    # LoRA on a random-init base learns slowly (the base knows nothing): 60 steps fall ~8%.
    steps = 60
    cfg = make_cfg(max_steps=steps, warmup_steps=5, lr=3e-3)
    summary = train.train(cfg, progress=False)
    rows = read_metrics(cfg.run_dir())
    assert summary["steps"] == steps and [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["loss"] for r in rows] == pytest.approx(summary["losses"], abs=1e-5)
    first, last5 = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert last5 < 0.95 * first, (first, last5)
    assert last5 < sum(r["loss"] for r in rows[5:10]) / 5
    # The schedule in the metrics: peak after warm-up, min_lr_ratio * lr at the end.
    assert max(r["lr"] for r in rows) == pytest.approx(cfg.lr)
    assert rows[-1]["lr"] == pytest.approx(cfg.lr * cfg.min_lr_ratio)
    assert all(r["tok_per_s"] > 0 and r["grad_norm"] > 0 for r in rows)
    run = cfg.run_dir()
    for name in ("config.json", "metrics.jsonl", "summary.json", "adapter/adapter_config.json", "prepared/stats.json"):
        assert (run / name).exists(), name
    resolved = resolved_config(cfg, *resolve_runtime(cfg))
    assert config.load_config(run / "config.json") == dataclasses.replace(resolved, packing="pack")  # auto chose
    saved = json.loads((run / "summary.json").read_text())
    assert saved["steps"] == steps and saved["final_loss"] == pytest.approx(last5, rel=0.1)
    assert saved["data"]["samples"] == 64


def test_the_frozen_heap_changes_no_number_and_is_let_go(make_cfg, monkeypatch):
    """`gc_freeze` keeps the collector off what the run built; the run is the same, loss for loss, and nothing
    stays frozen once it returns. Inside the loop the model's objects are frozen, not tracked."""
    import gc

    seen = []
    real = train.train_step

    def spying(*args, **kwargs):  # what the collector tracks and what is frozen, at each step
        seen.append((gc.get_freeze_count(), len(gc.get_objects())))
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "train_step", spying)
    frozen = train.train(make_cfg("frozen", max_steps=6), progress=False)
    assert gc.get_freeze_count() == 0
    assert all(f > t for f, t in seen) and len(seen) == 6  # most objects frozen at every step
    seen.clear()
    plain = train.train(make_cfg("plain", max_steps=6, gc_freeze=False), progress=False)
    assert all(f == 0 for f, _ in seen)
    assert frozen["losses"] == plain["losses"]  # exactly: the collector never touches a number


def test_the_loop_counts_each_steps_targets_on_the_host(make_cfg, monkeypatch):
    """The loop counts a step's target tokens on the batches before they go to the device and hands the count
    to the step (counted from a GPU's batches, each micro-batch's count waits for the GPU). The count is the
    one the step makes from its own batches, and the run's losses are those of a step that counts itself."""
    seen, real = [], train.train_step

    def spying(model, micro, *args, n_targets=None, **kwargs):
        seen.append((n_targets, count_targets(micro)))
        return real(model, micro, *args, n_targets=n_targets, **kwargs)

    def counting_itself(*args, n_targets=None, **kwargs):
        return real(*args, **kwargs)

    kw = dict(max_steps=5, grad_accum=2, batch_size=4, packing="pad")
    monkeypatch.setattr(train, "train_step", spying)
    host = train.train(make_cfg("host", **kw), progress=False)
    assert len(seen) == 5 and all(given == counted for given, counted in seen)
    assert len({counted for _, counted in seen}) > 1  # padded batches: the count changes from step to step
    monkeypatch.setattr(train, "train_step", counting_itself)
    itself = train.train(make_cfg("itself", **kw), progress=False)
    assert host["losses"] == itself["losses"]


def test_prepare_is_reused(make_cfg, capsys):
    cfg = make_cfg()
    _, ds1, stats1 = prepare(cfg)
    first = (cfg.run_dir() / "prepared" / "stats.json").stat().st_mtime_ns
    _, ds2, stats2 = prepare(cfg)
    assert "reusing" in capsys.readouterr().out
    assert (cfg.run_dir() / "prepared" / "stats.json").stat().st_mtime_ns == first
    assert stats2.pop("cached") is True, "reused prepared data is cached data"
    stats1.pop("cached")
    assert stats1 == stats2 and ds1["input_ids"] == ds2["input_ids"]
    # Another max_length is another key: tokenized again.
    _, _, stats3 = prepare(tiny(**{**config.config_dict(cfg), "max_length": 40}), verbose=False)
    assert stats3["key"] != stats1["key"] and stats3["truncated"] > 0


def test_log_every_and_grad_accum(make_cfg):
    cfg = make_cfg(max_steps=5, log_every=2, grad_accum=2, batch_size=4)
    summary = train.train(cfg, progress=False)
    assert [r["step"] for r in read_metrics(cfg.run_dir())] == [2, 4, 5]  # and always the last step
    assert len(summary["losses"]) == 5


# ---- kill and resume -----------------------------------------------------------------------------


@pytest.mark.parametrize("method, grad_accum, stop_after", [
    ("lora", 1, 7),   # checkpoint at step 4, mid-epoch
    ("full", 2, 9),   # checkpoint at step 8 = the end of epoch 2 (4 steps an epoch)
])
def test_resume_matches_uninterrupted_run(make_cfg, method, grad_accum, stop_after):
    kw = dict(max_steps=12, save_every=4, method=method, grad_accum=grad_accum, batch_size=16 // (2 * grad_accum))
    a, b = make_cfg("a", **kw), make_cfg("b", **kw)
    train.train(a, progress=False)

    part = train.train(b, stop_after=stop_after, progress=False)
    assert part["steps"] == stop_after
    assert len(read_metrics(b.run_dir())) == stop_after
    assert not (b.run_dir() / "summary.json").exists()
    saved_step = stop_after // 4 * 4
    assert checkpoint.latest_checkpoint(b.run_dir()).name == f"ckpt-{saved_step:07d}"

    rest = train.train(b, resume=True, progress=False)
    assert rest["steps"] == 12 and len(rest["losses"]) == 12 - saved_step
    rows_a, rows_b = read_metrics(a.run_dir()), read_metrics(b.run_dir())
    assert [r["step"] for r in rows_b] == list(range(1, 13)), "rows after the checkpoint must be rewritten"
    assert [r["loss"] for r in rows_b] == pytest.approx([r["loss"] for r in rows_a], abs=1e-5)
    assert [r["lr"] for r in rows_b] == pytest.approx([r["lr"] for r in rows_a], rel=1e-6)
    assert [r["epoch"] for r in rows_b] == [r["epoch"] for r in rows_a]
    final_a = load_file(a.run_dir() / "ckpt-0000012" / checkpoint.WEIGHTS)
    final_b = load_file(b.run_dir() / "ckpt-0000012" / checkpoint.WEIGHTS)
    for name in final_a:
        torch.testing.assert_close(final_b[name], final_a[name], rtol=1e-4, atol=1e-6, msg=name)


def test_resume_is_exact_with_dropout(make_cfg):
    kw = dict(max_steps=10, save_every=4, lora_dropout=0.1)
    a, b = make_cfg("a", **kw), make_cfg("b", **kw)
    train.train(a, progress=False)
    train.train(b, stop_after=6, progress=False)
    train.train(b, resume=True, progress=False)
    assert losses(b.run_dir()) == pytest.approx(losses(a.run_dir()), abs=1e-5)


def test_resume_of_finished_run_keeps_its_summary(make_cfg):
    cfg = make_cfg(max_steps=3)
    train.train(cfg, progress=False)
    before = json.loads((cfg.run_dir() / "summary.json").read_text())
    assert train.train(cfg, resume=True, progress=False)["steps"] == 3
    assert json.loads((cfg.run_dir() / "summary.json").read_text()) == before


def test_resume_without_checkpoint_starts_fresh(make_cfg, capsys):
    cfg = make_cfg(max_steps=3)
    summary = train.train(cfg, resume=True)
    assert summary["steps"] == 3 and "no checkpoint" in capsys.readouterr().out


@pytest.mark.slow
def test_sigkill_then_resume(make_cfg, tmp_path):
    """Kill -9 a real CLI run right after its first checkpoint; resuming in-process matches a clean run."""
    kw = dict(max_steps=1000, save_every=2)  # far more steps than run before the kill
    killed, clean = make_cfg("killed", **kw), make_cfg("clean", **kw)
    cmd = [sys.executable, "-m", "tunekit.cli", "train", "--preset", "tiny", "--out-dir", killed.out_dir,
           "--data", killed.data, "--max-steps", "1000", "--save-every", "2", "--batch-size", "8",
           "--max-length", "128", "--warmup-steps", "2", *SMALL_ARCH_ARGS]
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 120
        while not (killed.run_dir() / checkpoint.LATEST).exists():
            assert proc.poll() is None, f"the run ended early:\n{log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "no checkpoint after 120 s"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    resolved = dataclasses.replace(resolved_config(killed, *resolve_runtime(killed)), packing="pack")
    assert config.load_config(killed.run_dir() / "config.json") == resolved, "the CLI resolved another config"
    ckpt = checkpoint.latest_checkpoint(killed.run_dir())
    step = json.loads((ckpt / "meta.json").read_text())["step"]
    stop = step + 3
    train.train(killed, resume=True, stop_after=stop, progress=False)
    train.train(clean, stop_after=stop, progress=False)
    rows = read_metrics(killed.run_dir())
    assert [r["step"] for r in rows] == list(range(1, stop + 1))
    assert losses(killed.run_dir()) == pytest.approx(losses(clean.run_dir()), abs=1e-5)


# ---- runs that never lose work -------------------------------------------------------------------


def snapshot(run) -> dict[str, bytes]:
    """Every file of a run folder with its bytes (the prepared data left out)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.relative_to(run).parts[0] != "prepared"}


def strict_rows(path) -> list[dict]:
    """metrics.jsonl read as strict JSON, as other readers do: a NaN or Infinity token is an error."""
    def refuse(token):
        raise ValueError(f"{token} in {path}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_a_folder_holding_another_run_is_refused_unless_overwritten(make_cfg):
    first = make_cfg(max_steps=4, save_every=1, keep_checkpoints=4)
    train.train(first, progress=False)
    run = first.run_dir()
    before = snapshot(run)
    second = make_cfg(max_steps=2, seed=1)
    with pytest.raises(checkpoint.RunFolderError) as e:
        train.train(second, progress=False)
    for part in (str(run), "--resume", "--overwrite", "--out-dir", "ckpt-0000004"):
        assert part in str(e.value), part
    assert snapshot(run) == before, "a refused start must leave the folder as it was"
    # With overwrite the old run's files go: none of its checkpoints is left for a --resume to pick up.
    train.train(second, progress=False, overwrite=True)
    assert [p.name for p in checkpoint.checkpoints(run)] == ["ckpt-0000002"]
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert config.load_config(run / "config.json").seed == 1


def test_a_start_that_fails_writes_nothing(make_cfg, tmp_path):
    good = make_cfg(max_steps=2)
    train.train(good, progress=False)
    before = snapshot(good.run_dir())
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises((FileNotFoundError, ValueError)):
        train.train(make_cfg(max_steps=3, data=missing), progress=False, overwrite=True)
    assert snapshot(good.run_dir()) == before, "a run that never started replaced the good run's files"
    with pytest.raises((FileNotFoundError, ValueError)):
        train.train(make_cfg("fresh", data=missing), progress=False)
    assert not (tmp_path / "fresh").exists(), "a failed start left a folder behind"


@pytest.mark.parametrize("field, value, log_every", [
    ("loss", float("nan"), 1), ("loss", float("inf"), 3), ("grad_norm", float("inf"), 1)])
def test_divergence_keeps_the_history_and_says_where(make_cfg, monkeypatch, field, value, log_every):
    real_step, calls = train_step, itertools.count(1)

    def step_that_diverges_at_5(*args, **kwargs):
        out = real_step(*args, **kwargs)
        return {**out, field: torch.tensor(value)} if next(calls) == 5 else out

    monkeypatch.setattr(train, "train_step", step_that_diverges_at_5)
    cfg = make_cfg(max_steps=8, save_every=2, log_every=log_every)
    with pytest.raises(Diverged) as e:
        train.train(cfg, progress=False)
    rows = strict_rows(cfg.run_dir() / "metrics.jsonl")  # no NaN/Infinity tokens
    assert [r["step"] for r in rows] == ([1, 2, 3, 4, 5] if log_every == 1 else [3, 5])
    assert rows[-1][field] is None and all(r["loss"] is not None for r in rows[:-1])
    message = str(e.value)
    assert "\n" not in message and message.startswith("diverged at step 5")
    assert "last finite loss" in message and "at step 4" in message
    assert str(cfg.run_dir() / "ckpt-0000004") in message
    assert not (cfg.run_dir() / "summary.json").exists()


def test_resume_refuses_a_changed_config(make_cfg):
    cfg = make_cfg(max_steps=6, save_every=2)
    train.train(cfg, stop_after=4, progress=False)
    run = cfg.run_dir()
    before = snapshot(run)
    for change, listed in (({"lr": 1e-3}, ["lr: 0.003 -> 0.001"]),
                           ({"batch_size": 4, "lora_r": 8}, ["batch_size: 8 -> 4", "lora_r: 16 -> 8"]),
                           ({"data": str(run / "other.jsonl")}, ["data: "])):
        with pytest.raises(config.ConfigError) as e:  # not even with the flag
            train.train(make_cfg(max_steps=6, save_every=2, **change), resume=True, allow_config_change=True,
                        progress=False)
        assert all(line in str(e.value) for line in listed) and "cannot change" in str(e.value), str(e.value)
    longer = make_cfg(max_steps=8, save_every=2, log_every=2)  # fields that may change, but only when asked
    with pytest.raises(config.ConfigError, match="--allow-config-change") as e:
        train.train(longer, resume=True, progress=False)
    assert "max_steps: 6 -> 8" in str(e.value) and "log_every: 1 -> 2" in str(e.value)
    assert snapshot(run) == before
    train.train(longer, resume=True, allow_config_change=True, progress=False)
    saved = config.load_config(run / "config.json")
    assert (saved.max_steps, saved.log_every) == (8, 2)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 6, 8]


def flip_bytes(path, n: int = 64) -> None:
    raw = bytearray(path.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + n] = bytes(b ^ 0xFF for b in raw[mid:mid + n])
    path.write_bytes(bytes(raw))


def test_resume_falls_back_past_a_corrupt_checkpoint(make_cfg, capsys):
    kw = dict(max_steps=8, save_every=2)
    a, b = make_cfg("a", **kw), make_cfg("b", **kw)
    train.train(a, progress=False)
    train.train(b, stop_after=5, progress=False)  # checkpoints at 2 and 4
    weights = b.run_dir() / "ckpt-0000004" / checkpoint.WEIGHTS
    flip_bytes(weights)
    capsys.readouterr()
    train.train(b, resume=True)
    out = capsys.readouterr().out
    assert f"{weights} is corrupt" in out and f"falling back to {b.run_dir() / 'ckpt-0000002'}" in out
    assert losses(b.run_dir()) == pytest.approx(losses(a.run_dir()), abs=1e-5)


def test_resume_with_no_checkpoint_that_verifies_is_refused(make_cfg):
    cfg = make_cfg(max_steps=6, save_every=2)
    train.train(cfg, stop_after=4, progress=False)
    for ckpt in checkpoint.checkpoints(cfg.run_dir()):
        (ckpt / "state.pt").write_bytes(b"")
    before = snapshot(cfg.run_dir())
    with pytest.raises(checkpoint.CheckpointError) as e:
        train.train(cfg, resume=True, progress=False)
    for step in (2, 4):
        assert str(cfg.run_dir() / f"ckpt-{step:07d}" / "state.pt") in str(e.value)
    assert "--overwrite" in str(e.value) and snapshot(cfg.run_dir()) == before


def test_resume_takes_the_newest_complete_checkpoint(make_cfg, capsys):
    cfg = make_cfg(max_steps=8, save_every=2)
    train.train(cfg, stop_after=4, progress=False)
    (cfg.run_dir() / checkpoint.LATEST).write_text("ckpt-0000002\n")  # killed between rename and pointer
    capsys.readouterr()
    train.train(cfg, resume=True)
    assert f"resume: from {cfg.run_dir() / 'ckpt-0000004'} (step 4" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(cfg.run_dir())] == list(range(1, 9))


def test_the_next_start_removes_temps_of_killed_writes(make_cfg, capsys):
    cfg = make_cfg(max_steps=4, save_every=2)
    train.train(cfg, stop_after=2, progress=False)
    run = cfg.run_dir()
    half = run / ".ckpt-0000004.4242.tmp"
    half.mkdir()
    (half / "trainable.pt").write_bytes(b"half a file")
    (run / ".latest.k2j4h1.tmp").write_text("ckpt-00")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 4.1')  # the row a kill cut short
    capsys.readouterr()
    train.train(cfg, resume=True)
    assert not list(run.glob(".*.tmp"))
    out = capsys.readouterr().out
    assert ".ckpt-0000004.4242.tmp" in out and ".latest.k2j4h1.tmp" in out
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]


def test_resume_of_finished_run_builds_nothing(make_cfg, monkeypatch, capsys):
    cfg = make_cfg(max_steps=3)
    train.train(cfg, progress=False)

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished run was asked to resume: nothing should be built")

    monkeypatch.setattr(train, "prepare", must_not_run)
    monkeypatch.setattr(train, "build_training", must_not_run)
    summary = train.train(cfg, resume=True)
    assert summary["steps"] == 3 and "nothing to do" in capsys.readouterr().out


def test_config_json_records_what_was_resolved(make_cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = make_cfg(max_steps=1, out_dir="")
    train.train(cfg, progress=False)
    path = tmp_path / "runs" / "tiny" / "config.json"
    saved = json.loads(path.read_text())
    assert saved["device"] in ("cpu", "cuda") and saved["dtype"] in ("fp32", "bf16", "fp16")
    assert saved["out_dir"] == "runs/tiny" and saved["packing"] == "pack"  # what `auto` chose for this data
    resolved = resolved_config(cfg, *resolve_runtime(cfg))
    assert config.load_config(path) == dataclasses.replace(resolved, packing="pack")


def test_summary_says_the_prepared_data_was_reused(make_cfg, tmp_path, small_records):
    data_file = write_jsonl(tmp_path / "own.jsonl", small_records)  # never tokenized before: no datasets cache
    cfg = make_cfg(max_steps=4, save_every=2, data=str(data_file))
    train.train(cfg, stop_after=2, progress=False)
    train.train(cfg, resume=True, progress=False)
    assert json.loads((cfg.run_dir() / "summary.json").read_text())["data"]["cached"] is True


def test_log_is_plain_lines_when_output_is_not_a_terminal(make_cfg, capsys):
    train.train(make_cfg(max_steps=5, log_every=2))  # pytest captures the output: not a terminal
    out, err = capsys.readouterr()
    assert "\r" not in out + err, "a progress bar of carriage returns went to a file"
    steps = [line.split(":")[0] for line in out.splitlines() if line.startswith("step ")]
    assert steps == ["step 2/5", "step 4/5", "step 5/5"]


def test_keep_checkpoints_is_a_config_field(make_cfg):
    cfg = make_cfg(max_steps=6, save_every=1, keep_checkpoints=3)
    train.train(cfg, progress=False)
    assert [p.name for p in checkpoint.checkpoints(cfg.run_dir())] == ["ckpt-0000004", "ckpt-0000005", "ckpt-0000006"]


@pytest.fixture
def sigterm_guard():
    """Until train installs its own handler, SIGTERM fails the test instead of killing pytest."""
    def fail(signum, frame):
        raise RuntimeError("SIGTERM reached the test: train did not catch it")

    old = signal.signal(signal.SIGTERM, fail)
    yield fail
    signal.signal(signal.SIGTERM, old)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_finishes_the_step_then_checkpoints(make_cfg, monkeypatch, sigterm_guard, signum):
    real_step, calls = train_step, itertools.count(1)

    def step_signalled_at_3(*args, **kwargs):
        if next(calls) == 3:
            os.kill(os.getpid(), signum)  # arrives while step 3 runs
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train, "train_step", step_signalled_at_3)
    kw = dict(max_steps=8, save_every=5)
    cfg, clean = make_cfg("run", **kw), make_cfg("clean", **kw)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(Interrupted) as e:
        train.train(cfg, progress=False)
    assert {s: signal.getsignal(s) for s in handlers} == handlers, "train must put the handlers back"
    assert (e.value.signum, e.value.step) == (signum, 3)
    assert e.value.checkpoint == cfg.run_dir() / "ckpt-0000003"
    assert checkpoint.verify_checkpoint(e.value.checkpoint) is None
    assert str(e.value) == f"interrupted by {signum.name} at step 3; checkpoint written: {e.value.checkpoint}"
    assert [r["step"] for r in read_metrics(cfg.run_dir())] == [1, 2, 3]
    monkeypatch.undo()
    train.train(cfg, resume=True, progress=False)
    train.train(clean, progress=False)
    assert losses(cfg.run_dir()) == pytest.approx(losses(clean.run_dir()), abs=1e-5)


def test_a_second_signal_abandons_the_step(make_cfg, monkeypatch, sigterm_guard):
    real_step, calls = train_step, itertools.count(1)

    def step_signalled_twice_at_3(*args, **kwargs):
        if next(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train, "train_step", step_signalled_twice_at_3)
    cfg = make_cfg(max_steps=8, save_every=2)
    with pytest.raises(Interrupted) as e:
        train.train(cfg, progress=False)
    assert (e.value.signum, e.value.step) == (signal.SIGTERM, 2)
    assert "abandoning the step" in str(e.value) and str(cfg.run_dir() / "ckpt-0000002") in str(e.value)
    assert [p.name for p in checkpoint.checkpoints(cfg.run_dir())] == ["ckpt-0000002"]
    assert [r["step"] for r in read_metrics(cfg.run_dir())] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("signum, code, workers", [(signal.SIGINT, 130, 0), (signal.SIGTERM, 143, 0),
                                                  (signal.SIGTERM, 143, 2)],
                         ids=["SIGINT", "SIGTERM", "SIGTERM-to-the-group-with-workers"])
def test_signal_to_a_real_run(make_cfg, tmp_path, signum, code, workers):
    """SIGINT/SIGTERM to a real `tunekit train`: it finishes the step, writes a checkpoint, prints one line
    with the step and the exact command that resumes, and exits 128 + the signal, with no traceback. Sent to
    the whole process group (as Ctrl-C and many schedulers do), DataLoader workers must not die of it."""
    from tunekit import cli

    kw = dict(max_steps=1000, save_every=500, num_workers=workers)  # far more steps than run before the signal
    run, clean = make_cfg("run", **kw), make_cfg("clean", **kw)
    argv = ["train", "--preset", "tiny", "--out-dir", run.out_dir, "--data", run.data, "--max-steps", "1000",
            "--save-every", "500", "--batch-size", "8", "--max-length", "128", "--warmup-steps", "2",
            "--num-workers", str(workers), *SMALL_ARCH_ARGS]
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "tunekit.cli", *argv], cwd=REPO_ROOT, stdout=o, stderr=e,
                                start_new_session=True)  # its own process group, as a terminal job has
    try:
        deadline = time.monotonic() + 120
        while len(read_metrics(run.run_dir())) < 3:
            assert proc.poll() is None, f"the run ended early:\n{err.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "no metrics after 120 s"
            time.sleep(0.05)
        if workers:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    stderr = err.read_text()
    assert proc.returncode == code, stderr[-2000:]
    assert "Traceback" not in stderr + out.read_text()
    lines = stderr.strip().splitlines()
    last = lines[-1]
    step = int(last.split(" at step ")[1].split(";")[0])
    assert last.startswith(f"tunekit train: interrupted by {signum.name} at step {step}; checkpoint written: ")
    ckpt = run.run_dir() / f"ckpt-{step:07d}"
    assert checkpoint.verify_checkpoint(ckpt) is None
    assert [r["step"] for r in read_metrics(run.run_dir())] == list(range(1, step + 1))
    command = shlex.split(last.split("Continue with: ")[1])
    assert command == ["tunekit", *argv, "--resume"]
    args, rest = cli.make_parser().parse_known_args(command[1:])
    assert args.resume and resolve(args.preset, rest) == run
    train.train(run, resume=True, stop_after=step + 3, progress=False)
    train.train(clean, stop_after=step + 3, progress=False)
    assert losses(run.run_dir()) == pytest.approx(losses(clean.run_dir()), abs=1e-5)



# ---- checkpoints ---------------------------------------------------------------------------------


def _ckpt_parts(tokenizer):
    model = tiny_model(len(tokenizer), "lora")
    opt = build_optimizer(model, 1e-3, 0.0, "cpu")
    sched = build_scheduler(opt, 2, 10, 0.1)
    return model, opt, sched


def test_checkpoint_is_atomic_and_pruned(tmp_path, tokenizer):
    model, opt, sched = _ckpt_parts(tokenizer)
    run = tmp_path / "run"
    for step in (2, 4, 6):
        path = checkpoint.save_checkpoint(run, step, model, opt, sched, {"epoch": 0, "next_batch": step})
        assert not list(run.glob(".ckpt-*.tmp")), "a temp folder was left behind"
        assert (run / checkpoint.LATEST).read_text().strip() == path.name
        assert checkpoint.latest_checkpoint(run) == path
        for part in (checkpoint.WEIGHTS, "state.pt", "meta.json", "adapter/adapter_config.json"):
            assert (path / part).exists(), part
        meta = json.loads((path / "meta.json").read_text())
        assert (meta["step"], meta["data"]) == (step, {"epoch": 0, "next_batch": step})
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-0000004", "ckpt-0000006"]  # keep=2
    assert not list(run.glob(".*.tmp"))


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, tokenizer, monkeypatch):
    model, opt, sched = _ckpt_parts(tokenizer)
    run = tmp_path / "run"
    good = checkpoint.save_checkpoint(run, 2, model, opt, sched, {"epoch": 0, "next_batch": 2})
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        if str(f).endswith("state.pt"):
            raise KeyboardInterrupt("killed mid-save")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(run, 4, model, opt, sched, {"epoch": 0, "next_batch": 4})
    monkeypatch.undo()
    assert checkpoint.latest_checkpoint(run) == good
    assert not (run / "ckpt-0000004").exists()
    fresh, opt2, sched2 = _ckpt_parts(tokenizer)
    assert checkpoint.load_checkpoint(good, fresh, opt2, sched2) == {"step": 2, "data": {"epoch": 0, "next_batch": 2}}
    # The next successful save clears the half-written folder.
    checkpoint.save_checkpoint(run, 4, model, opt, sched, {"epoch": 0, "next_batch": 4})
    assert not list(run.glob(".ckpt-*.tmp"))


def test_a_periodic_checkpoint_is_not_counted_in_the_steps_tokens_per_s(tmp_path, small_data, monkeypatch):
    """A checkpoint written every `save_every` steps is the wall-clock's, not the step's: the row after it keeps the
    steps' own speed (a whole run's steady tok/s read the checkpoint's seconds as a slow step), and the summary
    says how long the checkpoints took."""
    real_save = checkpoint.save_checkpoint

    def slow_save(*args, **kwargs):
        time.sleep(1.0)  # far longer than a tiny step
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_checkpoint", slow_save)
    cfg = tiny(**SMALL_ARCH, data=str(small_data), max_steps=6, save_every=2, log_every=1, batch_size=2,
               max_length=64, out_dir=str(tmp_path / "run"))
    summary = train.train(cfg, progress=False)
    rows = {r["step"]: r["tok_per_s"] for r in read_metrics(tmp_path / "run")}
    after_save, others = [rows[3], rows[5]], [rows[2], rows[4], rows[6]]
    assert min(after_save) > 0.3 * min(others), rows  # with the 1 s counted: ~20x slower
    assert summary["timings"]["checkpoint_s"] >= 2.0


def test_checkpoint_restores_weights_optimizer_and_rng(tmp_path, tokenizer, samples):
    model, opt, sched = _ckpt_parts(tokenizer)
    batch = Collator(tokenizer.pad_token_id)(samples[:4])
    train_step(model, [batch], opt, sched, 1.0, None)
    torch.manual_seed(123)
    path = checkpoint.save_checkpoint(tmp_path, 1, model, opt, sched, {"epoch": 0, "next_batch": 1})
    expected_draw = torch.rand(3)

    fresh, opt2, sched2 = _ckpt_parts(tokenizer)
    checkpoint.load_checkpoint(path, fresh, opt2, sched2)
    torch.testing.assert_close(torch.rand(3), expected_draw)
    trained = checkpoint.trainable_state_dict(model)
    for n, t in checkpoint.trainable_state_dict(fresh).items():
        assert torch.equal(t, trained[n]), n
    assert sched2.state_dict()["last_epoch"] == 1
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def test_checkpoint_from_another_model_is_refused(tmp_path, tokenizer):
    model, opt, sched = _ckpt_parts(tokenizer)
    path = checkpoint.save_checkpoint(tmp_path, 1, model, opt, sched, {"epoch": 0, "next_batch": 1})
    other = tiny_model(len(tokenizer), "full")
    opt2 = build_optimizer(other, 1e-3, 0.0, "cpu")
    with pytest.raises(ValueError, match="lacks"):
        checkpoint.load_checkpoint(path, other, opt2, build_scheduler(opt2, 2, 10, 0.1))


def test_latest_pointing_at_missing_folder(tmp_path, tokenizer):
    """`latest` is a pointer for people; a resume takes the newest checkpoint that verifies, whatever it says."""
    run = tmp_path / "run"
    run.mkdir()
    (run / checkpoint.LATEST).write_text("ckpt-0000099\n")
    assert checkpoint.latest_checkpoint(run) is None
    model, opt, sched = _ckpt_parts(tokenizer)
    good = checkpoint.save_checkpoint(run, 2, model, opt, sched, {"epoch": 0, "next_batch": 2})
    (run / checkpoint.LATEST).write_text("ckpt-0000099\n")
    assert checkpoint.latest_checkpoint(run) == good
    assert checkpoint.latest_checkpoint(tmp_path / "empty") is None


def test_atomic_write_text(tmp_path):
    path = tmp_path / "deep" / "file.txt"
    atomic_write_text(path, "one")
    atomic_write_text(path, "two")
    assert path.read_text() == "two"
    assert [p.name for p in path.parent.iterdir()] == ["file.txt"]


def test_atomic_write_gives_normal_permissions(tmp_path):
    plain, atomic = tmp_path / "plain.txt", tmp_path / "atomic.txt"
    plain.write_text("x")
    atomic_write_text(atomic, "x")
    assert oct(atomic.stat().st_mode & 0o777) == oct(plain.stat().st_mode & 0o777)


# ---- adapters ------------------------------------------------------------------------------------


def test_adapter_save_load_gives_same_logits(tmp_path, tokenizer, samples):
    ids = Collator(tokenizer.pad_token_id)(samples[:3])["input_ids"]
    tuned = tiny_model(len(tokenizer), "lora", seed=5).eval()
    with torch.no_grad():
        expected = tuned(input_ids=ids).logits
    path = mdl.save_adapter(tuned, tmp_path / "adapter")
    mdl.save_adapter(tuned, tmp_path / "adapter")  # over an existing one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    assert (path / "adapter_config.json").exists() and (path / "adapter_model.safetensors").exists()

    base = mdl.build_model(mdl.llama_config(vocab_size=len(tokenizer), **SMALL_ARCH), seed=5).eval()
    with torch.no_grad():
        plain = base(input_ids=ids).logits
    assert not torch.allclose(plain, expected, atol=1e-4), "the adapter must change the logits"
    loaded = mdl.load_adapter(base, path).eval()
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    trainable, total = mdl.count_parameters(loaded)
    assert trainable == 0 and total > 0  # loaded for inference by default


def test_lora_trains_only_adapters(tokenizer):
    model = tiny_model(len(tokenizer), "lora")
    trainable, total = mdl.count_parameters(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert trainable == sum(p.numel() for p in model.parameters() if p.requires_grad) and trainable < total / 5
    # all-linear: every projection of every block, not the LM head
    wrapped = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n in names if "lora_A" in n}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


# ---- bad setups ----------------------------------------------------------------------------------


def test_unwritable_out_dir(tmp_path, small_data):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "run"
    cfg = tiny(out_dir=str(out), data=str(small_data), max_steps=1, **SMALL_ARCH)
    with pytest.raises(OSError) as e:
        train.train(cfg, progress=False)
    assert str(out) in str(e.value) and "--out-dir" in str(e.value)
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"] and blocker.read_text() == "not a folder"


@pytest.mark.skipif(os.geteuid() == 0 if hasattr(os, "geteuid") else True,
                    reason="root can write to read-only folders")
def test_read_only_out_dir(tmp_path, small_data):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        cfg = tiny(out_dir=str(ro / "run"), data=str(small_data), max_steps=1, **SMALL_ARCH)
        with pytest.raises(OSError, match=str(ro)):
            train.train(cfg, progress=False)
    finally:
        ro.chmod(0o700)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_gpu_preset_on_cpu(tmp_path, small_data):
    cfg = llama7b_lora(out_dir=str(tmp_path / "run"), data=str(small_data))
    with pytest.raises(RuntimeError) as e:
        train.train(cfg, progress=False)
    assert "GPU" in str(e.value) and "--preset tiny" in str(e.value)
    assert not (tmp_path / "run").exists(), "nothing should be written before the device check"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_device_on_cpu(make_cfg):
    with pytest.raises(RuntimeError, match="CUDA"):
        train.train(make_cfg(device="cuda"), progress=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_qlora_on_cpu(make_cfg):
    with pytest.raises(RuntimeError, match="CUDA") as e:
        train.train(make_cfg(method="qlora"), progress=False)
    assert "--method lora" in str(e.value)


def test_fewer_samples_than_a_batch(tmp_path, small_records):
    path = write_jsonl(tmp_path / "four.jsonl", small_records[:4])
    cfg = tiny(out_dir=str(tmp_path / "run"), data=str(path), batch_size=8, **SMALL_ARCH)
    with pytest.raises(ValueError, match="fewer than one batch"):
        train.train(cfg, progress=False)


def test_vocab_size_too_small(make_cfg):
    with pytest.raises(ValueError, match="vocab"):
        train.train(make_cfg(vocab_size=300), progress=False)


# ---- GPU -----------------------------------------------------------------------------------------


@gpu
def test_tiny_run_on_gpu_bf16(make_cfg):
    cfg = make_cfg(max_steps=20, device="cuda", dtype="bf16")
    summary = train.train(cfg, progress=False)
    rows = read_metrics(cfg.run_dir())
    assert len(rows) == 20 and rows[-1]["peak_mem_gb"] > 0
    assert summary["losses"][-1] < summary["losses"][0]


def test_atomic_output_replaces_keeps_or_leaves_nothing(tmp_path):
    from tunekit.io import atomic_output

    final = tmp_path / "out"
    with atomic_output(final) as tmp:
        tmp.mkdir()
        (tmp / "a").write_text("1")
    with atomic_output(final) as tmp:  # replaces
        tmp.mkdir()
        (tmp / "a").write_text("2")
    assert (final / "a").read_text() == "2"
    with atomic_output(final, keep_existing=True) as tmp:  # a cache: the first finished copy stays
        tmp.mkdir()
        (tmp / "a").write_text("3")
    assert (final / "a").read_text() == "2"
    with pytest.raises(RuntimeError), atomic_output(tmp_path / "half.txt") as tmp:
        tmp.write_text("partial")
        raise RuntimeError("killed mid-write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp, no half-written file


# ---- fast by default: packed rows, run length in epochs, what a run has seen ------------------------


def expected_seen(cfg, steps: int) -> tuple[int, int]:
    """(samples, real tokens) in the first `steps` optimizer steps of `cfg`'s batches, counted afresh."""
    tokenizer, ds, stats = prepare(cfg, verbose=False)
    run = dataclasses.replace(cfg, packing=stats["packing"])
    stream = batches_from(ds, run, tokenizer.pad_token_id, 0, 0)
    batches = [next(stream)[2] for _ in range(steps * cfg.grad_accum)]
    return (sum(map(batching.count_samples, batches)), sum(int(b["attention_mask"].sum()) for b in batches))


def test_the_default_packs_short_samples_and_counts_what_it_saw(make_cfg):
    cfg = make_cfg(max_steps=5, grad_accum=2, batch_size=2)
    assert cfg.packing == "auto"
    summary = train.train(cfg, progress=False)
    rows = read_metrics(cfg.run_dir())
    assert json.loads((cfg.run_dir() / "config.json").read_text())["packing"] == "pack" == summary["packing"]
    assert [r["samples"] for r in rows] == sorted({r["samples"] for r in rows}), "counts only grow"
    samples, tokens = expected_seen(cfg, 5)
    assert (rows[-1]["samples"], rows[-1]["tokens"]) == (samples, tokens) == (summary["samples_seen"],
                                                                                summary["tokens_seen"])
    assert samples > 5 * 2 * 2, "a packed row holds several samples"
    assert summary["epochs_seen"] == pytest.approx(samples / summary["data"]["samples"], abs=1e-4)


def test_epochs_set_the_run_length_and_a_resume_counts_on(make_cfg, monkeypatch, capsys):
    cfg = make_cfg(epochs=2.5, save_every=2, batch_size=4)
    rows = prepare(cfg, verbose=False)[2]["packed_rows"]
    steps = math.ceil(2.5 * (rows // 4))
    train.train(cfg, stop_after=3, progress=False)
    saved = json.loads((cfg.run_dir() / "config.json").read_text())
    assert saved["max_steps"] == steps and saved["epochs"] == 2.5  # recorded as resolved
    summary = train.train(cfg, resume=True)  # `auto` and the computed max_steps pass the resume check
    assert summary["steps"] == steps and f"-> {steps} optimizer steps" in capsys.readouterr().out
    clean = make_cfg("clean", epochs=2.5, batch_size=4)
    clean_summary = train.train(clean, progress=False)
    for got, want in zip(read_metrics(cfg.run_dir()), read_metrics(clean.run_dir()), strict=True):
        assert [got[k] for k in ("step", "samples", "tokens", "epoch")] == [want[k] for k in ("step", "samples",
                                                                                                "tokens", "epoch")]
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert summary["samples_seen"] == clean_summary["samples_seen"] and 2 < clean_summary["epochs_seen"] <= 2.5

    def must_not_run(*a, **k):
        raise AssertionError("a finished run needs no data and no model")

    monkeypatch.setattr(train, "prepare", must_not_run)
    assert train.train(cfg, resume=True)["steps"] == steps
    assert "nothing to do" in capsys.readouterr().out


def test_accumulation_check_shows_the_mean_of_means_is_off(samples, tokenizer):
    """Micro-batches of unequal target counts: normalising by the step's total matches one big batch to fp32
    precision; the article's loss / grad_accum does not (claim C12)."""
    chosen = eight_of_varied_length(samples)
    collate = Collator(tokenizer.pad_token_id)
    micro = [{k: v for k, v in collate(chosen[i:i + 4]).items() if k != "attention_mask"} for i in (0, 4)]
    model = tiny_model(len(tokenizer), "lora")
    out = accumulation_check(model, micro)
    assert out["targets_per_micro_batch"][0] != out["targets_per_micro_batch"][1]
    assert out["exact"] < 1e-5, out
    assert out["mean_of_means"] > 1e-2, out


def test_held_out_rows_give_an_eval_loss_that_a_resume_keeps(tmp_path, small_data):
    """`eval_split` holds out rows (the same ones on resume), never trains on them, and reports their mean token
    loss every `eval_every` steps and at the end; it equals the loss of those rows computed directly."""
    kw = dict(data=str(small_data), max_steps=6, batch_size=4, max_length=128, warmup_steps=1, eval_split=0.2,
              eval_every=3, packing="pad", **SMALL_ARCH)
    whole = train.train(tiny(out_dir=str(tmp_path / "a"), **kw), progress=False)
    rows = [r for r in read_metrics(tmp_path / "a") if "eval_loss" in r]
    assert [r["step"] for r in rows] == [3, 6] and [s for s, _ in whole["eval_losses"]] == [3, 6]
    assert whole["eval_loss"] == pytest.approx(rows[-1]["eval_loss"], abs=1e-6)
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["eval_loss"] == whole["eval_loss"]
    cfg = tiny(out_dir=str(tmp_path / "b"), **{**kw, "save_every": 3})
    train.train(cfg, stop_after=3, progress=False)
    resumed = train.train(cfg, resume=True, progress=False)
    assert resumed["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-5)
    # `evaluate` is the held-out rows' mean token loss, as the plain logits give it one row at a time
    tokenizer, ds, _ = prepare(cfg, verbose=False)
    train_rows, held = split_eval(ds, cfg)
    assert len(held) == round(0.2 * len(ds)) and len(train_rows) + len(held) == len(ds)
    model, _, _, opts = build_training(cfg, len(tokenizer), "cpu", torch.float32, 10, verbose=False)
    got = evaluate(opts["step_module"], model, held, cfg.batch_size, collator(cfg, tokenizer.pad_token_id), "cpu")
    total, count = 0.0, 0
    with torch.no_grad():
        for row in held:
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
            logits = model(input_ids=ids).logits[0, :-1]
            total += float(torch.nn.functional.cross_entropy(logits, labels[0, 1:], reduction="sum"))
            count += int((labels[0, 1:] != -100).sum())
    assert got == pytest.approx(total / count, rel=1e-5) and model.training
    with pytest.raises(config.ConfigError, match="eval_every"):
        tiny(eval_every=5)


def test_the_held_out_loss_of_a_whole_model_compile_compiles_nothing_more(tmp_path, small_data, monkeypatch):
    """With `compile="model"` the step's graph is for training (train mode, gradients). The held-out evaluation
    runs the same forward eagerly under no_grad: a compiled call in eval mode would trace and compile the whole
    model again (minutes at 7B, at the end of every run); the loss is the eager step's."""
    import functools

    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    cfg = tiny(out_dir=str(tmp_path / "c"), data=str(small_data), batch_size=4, max_length=128, eval_split=0.2,
               packing="pad", grad_ckpt=True, **SMALL_ARCH)
    tokenizer, ds, _ = prepare(cfg, verbose=False)
    _, held = split_eval(ds, cfg)
    collate = collator(cfg, tokenizer.pad_token_id)
    losses = []
    for mode in ("none", "model"):
        torch._dynamo.reset()
        counters.clear()
        model, _, _, opts = build_training(dataclasses.replace(cfg, compile=mode), len(tokenizer), "cpu", torch.float32, 10,
                                           verbose=False)
        losses.append(evaluate(opts["step_module"], model, held, cfg.batch_size, collate, "cpu"))
        assert counters["stats"]["unique_graphs"] == 0 and model.training
    torch._dynamo.reset()
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


def test_in_loop_tokenization_trains_as_offline_on_padded_batches(tmp_path, small_data):
    """`tokenize=in_loop` (the article's "before") reads the same samples in the same order as offline
    tokenization, so a padded run gives the same losses; it refuses packing, whose lengths it cannot know."""
    kw = dict(data=str(small_data), max_steps=4, batch_size=4, max_length=128, warmup_steps=1, packing="pad",
              **SMALL_ARCH)
    offline = train.train(tiny(out_dir=str(tmp_path / "off"), **kw), progress=False)
    in_loop = train.train(tiny(out_dir=str(tmp_path / "in"), tokenize="in_loop", **kw), progress=False)
    assert in_loop["losses"] == pytest.approx(offline["losses"], rel=1e-5)
    assert in_loop["samples_seen"] == offline["samples_seen"] and in_loop["tokens_seen"] == offline["tokens_seen"]
    assert not (tmp_path / "in" / "prepared" / "dataset").exists()  # nothing tokenized ahead
    with pytest.raises(config.ConfigError, match="packing pad"):
        tiny(tokenize="in_loop", packing="pack")


def test_eval_data_is_a_second_dataset_tokenized_like_the_first(tmp_path, small_data, small_records):
    held = write_jsonl(tmp_path / "held.jsonl", small_records[:10])
    for tokenize, packing in (("offline", "pack"), ("in_loop", "pad")):
        cfg = tiny(out_dir=str(tmp_path / tokenize), data=str(small_data), eval_data=str(held), max_steps=2,
                          batch_size=4, max_length=128, warmup_steps=1, tokenize=tokenize, packing=packing,
                          **SMALL_ARCH)
        summary = train.train(cfg, progress=False)
        assert [s for s, _ in summary["eval_losses"]] == [2] and math.isfinite(summary["eval_loss"])
        assert summary["samples_seen"] == 2 * 4 or packing == "pack"
    with pytest.raises(config.ConfigError, match="eval_data"):
        tiny(eval_data=str(held), eval_split=0.1)


def test_the_before_and_after_recipes_are_presets_that_run_on_the_tiny_model(tmp_path, small_data):
    """Lesson 5's two recipes, as presets; on the CPU, at the tiny shape with LoRA for QLoRA (4-bit needs
    CUDA), both train end to end."""
    before, after = llama7b_before(), llama7b_after()
    assert (before.tokenize, before.packing, before.attention, before.compile, before.tf32) == \
        ("in_loop", "pad", "eager", "none", False)
    assert (after.tokenize, after.packing, after.compile) == ("offline", "auto", "regional")
    small = dict(data=str(small_data), max_steps=2, max_length=128, vocab_size=0, tokenizer_vocab=1024, num_kv_heads=0,
                 eval_data="", device="cpu", num_workers=0, batch_size=2, grad_accum=2, **SMALL_ARCH)
    for cfg in (llama7b_before(**small, method="lora", peft_kbit_prepare=False, out_dir=str(tmp_path / "before")),
                llama7b_after(**small, compile="none", out_dir=str(tmp_path / "after"))):
        summary = train.train(cfg, progress=False)
        assert summary["steps"] == 2 and all(math.isfinite(x) for x in summary["losses"])
