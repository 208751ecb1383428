"""Lesson 4's switches: each reversible, each the same numbers as its reference."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from helpers import SMALL_ARCH

from tunekit import config, estimate, speedups, train, validation
from tunekit.build import batches_from
from tunekit.optim import (
    OPTIMIZER_NOTES,
    Lion,
    build_optimizer,
    lion_settings,
    optimizer_state_bytes,
    state_bytes_per_param,
)
from tunekit.prepare import prepare
from tunekit.presets import llama7b_lora, tiny
from tunekit.step import StepModule, micro_step, train_step
from tunekit_course.race import parse_sweep, run_convergence


def test_tf32_is_switched_and_put_back():
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    with speedups.tf32(True):
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
        with speedups.tf32(False):
            assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "high"
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before
    with pytest.raises(RuntimeError), speedups.tf32(True):
        raise RuntimeError("inside")
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before


def test_the_heap_is_frozen_inside_and_let_go_on_exit():
    import gc

    assert gc.get_freeze_count() == 0
    kept = [object() for _ in range(10)]  # noqa: F841  (alive on entry: frozen with the rest)
    with speedups.frozen_heap() as refreeze:
        frozen = gc.get_freeze_count()
        assert frozen > 1000 and gc.isenabled()  # the test process's modules, at least
        made = [[i] for i in range(5000)]  # noqa: F841  (made inside: tracked until refrozen)
        assert refreeze() >= 0 and gc.get_freeze_count() >= frozen + 5000
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), speedups.frozen_heap():
        raise RuntimeError("inside")
    assert gc.get_freeze_count() == 0
    with speedups.frozen_heap(enabled=False) as refreeze:
        assert gc.get_freeze_count() == 0 and refreeze() == 0.0
    # a process that froze objects of its own keeps its freeze, inside and after
    gc.freeze()
    try:
        own = gc.get_freeze_count()
        with speedups.frozen_heap() as refreeze:  # nothing added to it, nothing unfrozen (objects may die)
            assert refreeze() == 0.0 and own - 100 < gc.get_freeze_count() <= own
        assert own - 100 < gc.get_freeze_count() <= own
    finally:
        gc.unfreeze()


def test_lion_follows_the_paper_step_by_step():
    """Algorithm 2 of Chen et al. 2023, written out in float64, against `speedups.Lion` over five steps."""
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(7, 5, generator=g, dtype=torch.float64)
    grads = [torch.randn(7, 5, generator=g, dtype=torch.float64) for _ in range(5)]
    lr, (b1, b2), wd = 1e-2, (0.9, 0.99), 0.1
    p = torch.nn.Parameter(w0.clone())
    opt = Lion([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    w, m = w0.clone(), torch.zeros_like(w0)
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
        update = torch.sign(b1 * m + (1 - b1) * grad)
        w = w - lr * (update + wd * w)
        m = b2 * m + (1 - b2) * grad
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-12)
    assert list(opt.state[p]) == ["exp_avg"]  # one state a parameter


def test_lion_settings_and_memory():
    assert lion_settings(3e-4, 0.01) == pytest.approx({"lr": 3e-5, "weight_decay": 0.1})
    cfg = estimate.Setup.of(llama7b_lora(vocab_size=32000))
    adamw = estimate.estimate_memory_for(cfg)["optimizer"]
    assert estimate.estimate_memory_for(cfg.but(optimizer="lion"))["optimizer"] == adamw // 2
    with pytest.raises(ValueError, match="lr"):
        Lion([torch.nn.Parameter(torch.zeros(1))], lr=0)


def test_a_run_trains_with_lion(tmp_path, small_data):
    cfg = tiny(out_dir=str(tmp_path / "run"), data=str(small_data), max_steps=30, batch_size=4,
                      max_length=128, warmup_steps=2, optimizer="lion", lr=3e-4, **SMALL_ARCH)
    summary = train.train(cfg, progress=False)
    losses = summary["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1, losses


# ---- optimizers: each steps, and keeps the state its formula says ----------------------------------------


def test_the_optimizer_list_is_one_list():
    assert tuple(OPTIMIZER_NOTES) == validation.OPTIMIZERS


def test_lion_matches_lion_pytorch():
    lion_pytorch = pytest.importorskip("lion_pytorch")
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(6, 4, generator=g)
    grads = [torch.randn(6, 4, generator=g) for _ in range(4)]
    ours, theirs = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    a = Lion([ours], lr=1e-2, weight_decay=0.1)
    b = lion_pytorch.Lion([theirs], lr=1e-2, weight_decay=0.1)
    for grad in grads:
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("name", ["adamw", "adamw_foreach", "lion", "lion_pytorch"])
def test_each_cpu_optimizer_steps_and_keeps_its_formula_of_state(name):
    if name == "lion_pytorch":
        pytest.importorskip("lion_pytorch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    model[0].weight.requires_grad_(False)  # frozen: no state
    opt = build_optimizer(model, 1e-3, 0.01, "cpu", name)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 16)).square().sum().backward()
    opt.step()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()) if p.requires_grad)
    assert torch.equal(before[0], model[0].weight)
    n = sum(p.numel() for p in trainable)
    counters = 4 * len(trainable) if "adamw" in name else 0  # AdamW's per-tensor step count (fp32 scalar)
    assert optimizer_state_bytes(opt) == state_bytes_per_param(name, 4) * n + counters


@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw", "lion8bit"])
def test_bitsandbytes_optimizers_say_they_need_a_gpu(name):
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        build_optimizer(torch.nn.Linear(2, 2), 1e-3, 0.0, "cpu", name)


# ---- compilation: the same numbers as eager ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["regional", "model"])
def test_compiled_step_matches_eager(mode):
    """The tiny LoRA model with checkpointing, one micro-step compiled by inductor (on CPU) and one eager: the
    same loss and LoRA gradients within fp32 rounding (rtol 1e-4: inductor fuses and reorders sums)."""
    from tunekit import memory
    from tunekit import model as mdl

    arch = mdl.llama_config(64, 2, 4, 128, 256, 0, 128)

    def build():
        m = mdl.apply_lora(mdl.build_model(arch, "", torch.float32, "cpu", "sdpa", 0), 8, 16)
        memory.apply_gradient_checkpointing(m)
        return m

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 64))
    batch = {"input_ids": ids, "labels": ids.clone()}
    results = []
    for compiled in (False, True):
        torch.manual_seed(1)
        model = build()
        step = StepModule(model, "chunked")
        if compiled:
            step = speedups.compile_step(step, model, mode)
        loss = micro_step(model, batch, 100, None, step_module=step)
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (eager_loss, eager_grads), (loss, grads) = results
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    assert eager_grads.keys() == grads.keys() and len(grads) == 2 * 7 * 2  # A and B of 7 linears, 2 layers
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_compiling_pads_batches_to_few_shapes(tmp_path, small_data):
    """Under --compile a padded batch is rounded up to a multiple of 64 tokens (a handful of shapes, so of
    compilations); packed rows keep their one width."""
    from tunekit.data.batching import IGNORE

    assert speedups.compile_pad_multiple("regional", "pad") == 64
    assert speedups.compile_pad_multiple("regional", "pack") == 0
    assert speedups.compile_pad_multiple("none", "pad") == 0
    cfg = tiny(out_dir=str(tmp_path / "run"), data=str(small_data), packing="pad", compile="regional",
                      max_length=128, batch_size=4)
    tokenizer, ds, _ = prepare(cfg, verbose=False)
    widths = {b["input_ids"].shape[1] for _, _, b in itertools.islice(
        batches_from(ds, cfg, tokenizer.pad_token_id, 0, 0), 20)}
    assert widths and all(w % 64 == 0 for w in widths), widths
    assert IGNORE == -100


@pytest.mark.slow
def test_a_whole_model_compile_of_padded_batches_compiles_once_for_every_width(monkeypatch):
    """Padded batches change width from micro-batch to micro-batch, and the loss's scale (1 / the step's targets)
    from step to step: compiled as a whole with `compile_dynamic`'s flag, nothing is traced again after the
    second micro-batch, whatever the width or scale; with torch's default, each first sight of a changed input
    traces again (on the 7B shape each is minutes on a GPU). AOT autograd without inductor's code generation:
    the guards are dynamo's, and the test stays quick."""
    import functools

    from torch._dynamo.utils import counters

    from tunekit import memory
    from tunekit import model as mdl

    assert speedups.compile_dynamic("model", "pad") is True and speedups.compile_dynamic("model", "group") is True
    assert speedups.compile_dynamic("model", "pack") is None and speedups.compile_dynamic("regional", "pad") is None
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    arch = mdl.llama_config(64, 2, 4, 128, 256, 0, 128)
    graphs = {}
    for dynamic in (None, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = mdl.apply_lora(mdl.build_model(arch, "", torch.float32, "cpu", "sdpa", 0), 8, 16)
        memory.apply_gradient_checkpointing(model)
        step = speedups.compile_step(StepModule(model, "plain"), model, "model", dynamic)
        graphs[dynamic] = []
        # (width, the step's targets): three micro-batches of one step, then two steps of one each
        for width, targets in ((64, 100), (128, 100), (192, 100), (128, 90), (256, 77), (64, 50)):
            ids = torch.randint(0, 256, (2, width))
            micro_step(model, {"input_ids": ids, "labels": ids.clone()}, targets, None, step_module=step)
            graphs[dynamic].append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert graphs[True][1:] == [graphs[True][1]] * 5, graphs  # nothing traced again after the second
    assert graphs[None][-1] > graphs[True][-1], graphs


def test_the_loss_scale_is_an_input_of_a_compiled_step_not_a_constant(monkeypatch):
    """The loss's scale (1 / the step's targets) changes every step. Taken as a Python float, dynamo guards on its
    value where it specialises floats (torch 2.11, the GPU image's, did): on an H200 the whole QLoRA model's
    graph broke at the model call, the loss was left in a frame of its own, and every step traced that frame
    again until the recompile limit sent it back to eager. `micro_step` passes the scale as a 0-d tensor: after
    the first micro-batches nothing is traced again, with a graph break at the same place and floats
    specialised."""
    import functools

    from torch._dynamo.utils import counters

    from tunekit import model as mdl

    class Breaking(torch.nn.Module):  # a model whose call breaks the graph, as the 4-bit one's did
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kw):
            out = self.inner(**kw)
            torch._dynamo.graph_break()
            return out

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = mdl.apply_lora(mdl.build_model(mdl.llama_config(64, 2, 4, 128, 256, 0, 128), "", torch.float32,
                                           "cpu", "sdpa", 0), 8, 16)
    step = speedups.compile_step(StepModule(Breaking(model), "plain"), model, "model", True)
    graphs, losses = [], []
    with torch._dynamo.config.patch(specialize_float=True):
        for width, targets in ((64, 100), (128, 90), (192, 80), (128, 70), (256, 60), (64, 50), (64, 40)):
            ids = torch.randint(0, 256, (2, width))
            batch = {"input_ids": ids, "labels": ids.clone()}
            losses.append((micro_step(model, batch, targets, None, step_module=step),
                           micro_step(model, batch, targets, None)))  # compiled, and the eager step
            graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert graphs[2:] == [graphs[1]] * 5, graphs
    for compiled, eager in losses:
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def _checkpointed_lora(seed: int = 0):
    from tunekit import memory
    from tunekit import model as mdl

    torch.manual_seed(seed)
    model = mdl.apply_lora(mdl.build_model(mdl.llama_config(64, 2, 4, 128, 256, 0, 128), "", torch.float32, "cpu",
                                           "sdpa", 0), 8, 16)
    memory.apply_gradient_checkpointing(model)
    for name, p in model.named_parameters():  # B starts at zero: give the adapters gradients worth comparing
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def test_a_whole_model_compile_with_checkpointing_gives_the_eager_gradients(monkeypatch):
    """`compile_step(..., "model")` with checkpointing is `torch.compile(model)` as the article's user writes it:
    transformers' input-grad hook stays (the graph breaks there, as in a plain HF script) and recomputation may
    skip the context variable transformers' `kernels` layers set inside a checkpointed block (dynamo refuses it
    otherwise). The adapters' gradients are the eager path's within float32 rounding (rtol 1e-4, atol 1e-6)."""
    from tunekit.model import base_model

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint", False)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    grads = []
    for mode in ("none", "model"):
        torch._dynamo.reset()
        model = _checkpointed_lora()
        step = speedups.compile_step(StepModule(model, "plain"), model, mode, True)
        micro_step(model, batch, 100, None, step_module=step)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        assert base_model(model)._require_grads_hooks  # transformers' hook, as the user's script has it
    torch._dynamo.reset()
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 7 * 2  # A and B, 7 targets, 2 blocks
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


def test_unknown_compile_modes_are_refused():
    with pytest.raises(ValueError, match="unknown compile|choose one of"):
        speedups.compile_step(torch.nn.Linear(2, 2), None, "everything")
    with pytest.raises(config.ConfigError, match="compile"):
        tiny(compile="whole")


# ---- GPU-only switches: a clear reason where they cannot run --------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_liger_and_fp8_say_why_they_cannot_run_here(tmp_path, small_data):
    assert speedups.liger_available() and speedups.fp8_available()
    with pytest.raises(RuntimeError, match="kernels=liger: "):
        speedups.apply_liger(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="fp8: "):
        speedups.apply_fp8(torch.nn.Linear(16, 16))
    cfg = tiny(out_dir=str(tmp_path / "run"), data=str(small_data), loss="liger", max_steps=1, **SMALL_ARCH)
    with pytest.raises(RuntimeError, match="'loss' = 'liger'.*--loss chunked"):
        train.train(cfg, progress=False)
    with pytest.raises(config.ConfigError, match="fp8.*4-bit"):
        tiny(method="qlora", fp8=True)


def test_fp8_takes_the_large_linear_layers_only():
    from tunekit import model as mdl

    m = mdl.apply_lora(mdl.build_model(mdl.llama_config(64, 1, 4, 128, 256, 0, 128), "", torch.float32, "cpu",
                                       "sdpa", 0), 8, 16)
    chosen = [n for n, mod in m.named_modules() if speedups.fp8_linear_filter(mod, n)]
    assert len(chosen) == 7 and all(n.endswith("base_layer") for n in chosen), chosen


def test_tf32_is_on_during_a_gpu_run_only_and_put_back(tmp_path, small_data, monkeypatch):
    seen = []
    real = train_step

    def spy(*a, **k):
        seen.append(torch.get_float32_matmul_precision())
        return real(*a, **k)

    monkeypatch.setattr(train, "train_step", spy)
    before = torch.get_float32_matmul_precision()
    cfg = tiny(out_dir=str(tmp_path / "run"), data=str(small_data), max_steps=2, **SMALL_ARCH)
    train.train(cfg, progress=False)
    expected = "high" if torch.cuda.is_available() else before
    assert seen == [expected] * 2 and torch.get_float32_matmul_precision() == before


def test_convergence_runs_each_optimizer_and_picks_its_best_rate(tmp_path, small_data):
    cfg = tiny(out_dir=str(tmp_path / "runs"), data=str(small_data), method="full", max_steps=8,
                      batch_size=4, max_length=128, warmup_steps=1, eval_split=0.2, eval_every=4,
                      weight_decay=0.01, **SMALL_ARCH)
    sweep = parse_sweep("adamw=1e-3,1e-2;lion=1e-4")
    r = run_convergence(cfg, sweep, "conv", verbose=False)
    assert [(x["optimizer"], x["lr"]) for x in r["runs"]] == [("adamw", 1e-3), ("adamw", 1e-2), ("lion", 1e-4)]
    assert [x["weight_decay"] for x in r["runs"]] == [0.01, 0.01, 0.1]  # Lion: 10x the decay (the paper's rule)
    adamw = [x for x in r["runs"] if x["optimizer"] == "adamw"]
    assert r["best"]["adamw"]["lr"] == min(adamw, key=lambda x: x["best_eval_loss"])["lr"]
    for x in r["runs"]:
        assert [s for s, _ in x["eval"]] == [4, 8] and x["eval"][-1][1] == x["final_eval_loss"]
        assert x["best_eval_loss"] == min(loss for _, loss in x["eval"]) <= x["final_eval_loss"]
    with pytest.raises(ValueError, match="OPTIMIZER=LR"):
        parse_sweep("sgd=1e-3")
    with pytest.raises(ValueError, match="eval-split"):
        run_convergence(tiny(), sweep, "x")


def test_the_compile_mode_reaches_torch_compile_and_cuda_graphs_hear_of_each_step(monkeypatch):
    """TUNEKIT_COMPILE_MODE (the command line's) sets `speedups.COMPILE_MODE`, which every compiled block is
    compiled in; under reduce-overhead each train step first tells CUDA graphs a new step begins. An unknown mode
    stops the command line before anything runs, naming the choices. (The numbers under CUDA graphs: the GPU test
    test_compiled_blocks_in_cuda_graphs_match_eager.)"""
    from tunekit import cli
    from tunekit import model as mdl

    asked, marks = [], []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: asked.append(kw) or fn)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    monkeypatch.setattr(speedups, "COMPILE_MODE", None)
    model = mdl.apply_lora(mdl.build_model(mdl.llama_config(64, 2, 4, 128, 256, 0, 128), "", torch.float32, "cpu",
                                           "sdpa", 0), 8, 16)
    speedups.begin_step()
    assert marks == []  # torch's default mode: no CUDA graphs to tell
    monkeypatch.setenv("TUNEKIT_COMPILE_MODE", "reduce-overhead")
    cli.apply_environment()
    assert speedups.COMPILE_MODE == "reduce-overhead"
    asked.clear()  # (building the model compiled transformers' own helpers)
    speedups.compile_step(StepModule(model, "plain"), model, "regional")
    assert [kw.get("mode") for kw in asked] == ["reduce-overhead"] * 2, asked  # each of the two blocks
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    ids = torch.randint(0, 256, (1, 16))
    train_step(model, [{"input_ids": ids, "labels": ids.clone()}], opt, torch.optim.lr_scheduler.LambdaLR(
        opt, lambda _: 1.0), 1.0, None)
    assert marks == [1]
    monkeypatch.setenv("TUNEKIT_COMPILE_MODE", "fastest")
    with pytest.raises(SystemExit, match="TUNEKIT_COMPILE_MODE='fastest': choose one of default, reduce-overhead"):
        cli.apply_environment()
