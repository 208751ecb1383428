"""From a config to the plain objects a run is made of: the device, the model with its techniques applied, the
optimizer and scheduler, the step's options and the stream of batches.

`apply_techniques` is the one place the techniques are applied, in this order: kernels (Liger) -> LoRA ->
fused LoRA or FP8 -> checkpointing -> offload -> the loss check; `build_training` then wraps the model and its
loss for DDP or FSDP2 (compiling, if asked, inside the wrapper) and builds the optimizer over what that left.
Nothing below this module takes a config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import signal

import torch

from tunekit import distributed, estimate, fastlora, memory, speedups, stopping
from tunekit import loss as loss_fn
from tunekit import model as mdl
from tunekit.attention import choose_attention, sdpa_backends
from tunekit.config import ConfigError, TuneConfig
from tunekit.data.batching import Collator, build_dataloader
from tunekit.optim import build_optimizer, build_scheduler
from tunekit.presets import GPU_PRESETS
from tunekit.step import StepModule


def resolve_runtime(cfg: TuneConfig) -> tuple[str, torch.dtype]:
    """(device, dtype) for `cfg` on this machine, refusing before any data or model work what cannot run here."""
    device = mdl.resolve_device(cfg.device)
    if device != "cuda" and cfg.preset in GPU_PRESETS and not cfg.model and cfg.hidden_size >= 2048:  # its own shape
        billions = estimate.parameter_count(estimate.Setup.of(cfg, vocab_size=cfg.vocab_size or 32000)) / 1e9
        raise RuntimeError(f"preset {cfg.preset!r} builds a {billions:.1f}B-parameter {cfg.arch} model and needs a "
                           "CUDA GPU, but none is visible (run `tunekit doctor`). On this machine use --preset tiny.")
    if cfg.method == "qlora":
        mdl.require_cuda_for_4bit(device)  # before data and model work, not after
    return device, mdl.resolve_dtype(cfg.dtype, device)


def cpu_threads(cfg: TuneConfig) -> int:
    """The CPU thread count a run on the CPU should use (see the config field `cpu_threads`); 0: leave
    PyTorch's own choice alone."""
    if cfg.cpu_threads:
        return cfg.cpu_threads
    if os.environ.get("OMP_NUM_THREADS"):
        return 0  # the user chose; torch already follows it
    return 1 if cfg.hidden_size <= 1024 and not cfg.model else 0


@contextlib.contextmanager
def threads_for(cfg: TuneConfig, device: str):
    """PyTorch's CPU threads as `cpu_threads` says for the block, put back after it (a run on the CPU only)."""
    threads, before = cpu_threads(cfg) if device == "cpu" else 0, torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads:
            torch.set_num_threads(before)


def with_config_threads(fn):
    """`fn(cfg, ...)` under `threads_for(cfg, ...)`: the CPU threads a benchmark of `cfg` runs with, put back after
    it, as `train` does for a run."""

    @functools.wraps(fn)
    def run(cfg: TuneConfig, *args, **kwargs):
        with threads_for(cfg, mdl.resolve_device(cfg.device)):
            return fn(cfg, *args, **kwargs)

    return run


def run_arch(cfg: TuneConfig, vocab_size: int):
    """The model config of a random-init run: the family `arch` (a Llama by default, exactly as before families
    existed) of the config's shape, with its vocabulary or the tokenizer's. The estimator reads the same config
    (`estimate.Setup.of`)."""
    return mdl.family_config(cfg.arch, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.intermediate_size,
                             cfg.vocab_size or vocab_size, cfg.num_kv_heads, cfg.head_dim, cfg.tie_embeddings,
                             max(cfg.max_length, 2048))


def autocast_dtype(device: str, dtype: torch.dtype) -> torch.dtype | None:
    """What the step autocasts to: the weights' dtype on a GPU when it is not fp32; nothing on the CPU."""
    return dtype if dtype != torch.float32 and device == "cuda" else None


# ---- the model -------------------------------------------------------------------------------------------


def build_base_model(cfg: TuneConfig, vocab_size: int, device: str, dtype: torch.dtype):
    """The base weights as `cfg` names them: random init of its shape, a hub name or a local folder; 4-bit NF4
    for QLoRA. Returns (model, the attention kernel's reason)."""
    arch = run_arch(cfg, vocab_size)
    attn, why = choose_attention(cfg.attention, device, packed=cfg.packing == "pack",
                                 model_class=mdl.model_class_of(None if cfg.model else arch, cfg.model,
                                                                cfg.trust_remote_code))
    if cfg.vocab_size and vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {vocab_size} tokens but vocab_size is {cfg.vocab_size}; "
                         f"raise --vocab-size or lower --tokenizer-vocab.")
    if cfg.method != "qlora":
        return mdl.build_model(arch, cfg.model, dtype, device, attn, cfg.seed, cfg.trust_remote_code), why
    # Rank 0 saves the random-init model once; the others load what it wrote (under torchrun, transformers
    # writes no config.json from the other ranks).
    source = cfg.model or str(distributed.main_first(lambda: mdl.save_random_init(arch, torch.bfloat16, cfg.seed)))
    model = mdl.load_quantized(source, device, attn, trust_remote_code=cfg.trust_remote_code)
    if cfg.peft_kbit_prepare:  # peft's guides; upcasts the non-4-bit weights to fp32 (measured in lesson 2)
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return model, why


def apply_techniques(model, cfg: TuneConfig, device: str, dtype: torch.dtype):
    """Apply the config's techniques to the base model, in this order, the one place they are applied:
    kernels (Liger) -> LoRA -> fused LoRA or FP8 -> checkpointing -> embedding offload -> then the model and
    its loss as one module (`step.StepModule`), compiled and wrapped for DDP or FSDP2 (`distributed.parallelize`,
    in torchtitan's order). Model code stays single-device and eager until here.

    Returns (model, step module, what was swapped in): the model is what the optimizer and checkpoints see, the
    step module is what a step calls."""
    kernels = speedups.apply_liger(model) if cfg.kernels == "liger" else []
    if cfg.method in ("lora", "qlora"):
        torch.manual_seed(cfg.seed + 1)
        model = mdl.apply_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets,
                               cast_input=cfg.lora_input_cast)
    parallel = distributed.choose_parallel(cfg.parallel, cfg.method)
    if cfg.fast_lora and cfg.method == "qlora" and parallel == "fsdp":
        raise ValueError("--fast-lora with QLoRA under FSDP: the fused layer reads each 4-bit weight whole, which "
                         "FSDP shards; use --parallel ddp, or leave --fast-lora off")
    if cfg.fast_lora:  # with fp8: the frozen base weights in FP8, quantized once (4-bit ones read at each use)
        # FSDP2 shards each layer's weight on its own; a group's concatenated weight would stay whole on each GPU
        kernels.append(fastlora.attach(model, fp8=cfg.fp8, group=cfg.fast_lora_group and parallel != "fsdp"))
    elif cfg.fp8:  # the base layers (LoRA's own adapters stay bf16/fp32)
        kernels.append(f"float8 rowwise in {speedups.apply_fp8(model)} linear layers")
    if cfg.grad_ckpt:
        memory.apply_gradient_checkpointing(model, offload=cfg.grad_ckpt_offload)
    if cfg.embed_offload:
        memory.offload_embeddings(model)
        if device == "cuda":
            torch.cuda.empty_cache()
    model.train()
    memory.check_checkpointing(model, cfg.grad_ckpt)
    if cfg.loss != "plain" and (blocker := loss_fn.fused_loss_blocker(model)):
        raise ValueError(f"config field 'loss' = {cfg.loss!r}: {blocker}; use --loss plain for this model.")
    if cfg.loss == "liger" and (why := speedups.liger_available() or (
            loss_fn.softcap_of(model) and "the model soft-caps its logits, which tunekit's Liger path does not")):
        raise RuntimeError(f"config field 'loss' = 'liger': {why}; use --loss chunked (tunekit's own fused loss).")
    step_module = distributed.parallelize(StepModule(model, cfg.loss, autocast_dtype(device, dtype)), model,
                                          parallel, device, dtype, cfg.fsdp_reshard, cfg.compile,
                                          speedups.compile_dynamic(cfg.compile, cfg.packing), cfg.compile_recompute)
    return model, step_module, kernels


def build_training_model(cfg: TuneConfig, vocab_size: int, device: str, dtype: torch.dtype, verbose: bool = True):
    """The model as it will train, unwrapped: base weights with every technique of `apply_techniques`."""
    return _build(cfg, vocab_size, device, dtype, verbose)[0]


def _build(cfg: TuneConfig, vocab_size: int, device: str, dtype: torch.dtype, verbose: bool):
    model, why = build_base_model(cfg, vocab_size, device, dtype)
    model, step_module, kernels = apply_techniques(model, cfg, device, dtype)
    if verbose:
        trainable, total = mdl.count_parameters(model)
        family = "" if cfg.arch == "llama" else f" {type(mdl.base_model(model)).__name__}"  # a Llama's line as before
        source = cfg.model or (f"random init{family} (no pretrained knowledge: speed and memory match real weights, "
                               "the loss starts from noise)")
        print(f"model: {total / 1e6:.1f}M params, {trainable / 1e6:.2f}M trainable ({cfg.method}), {source}")
        ckpt = ("on, offloaded to CPU" if cfg.grad_ckpt_offload else "on") if cfg.grad_ckpt else "off"
        print(f"attention: {why}; {sdpa_backends(cfg.sdpa_backend, device)[1]}")
        print(f"dtype {dtype}; checkpointing {ckpt}; loss {cfg.loss}; optimizer {cfg.optimizer}; device {device}")
        if kernels or cfg.compile != "none":
            print(f"speed-ups: {', '.join(kernels) or 'no kernel swaps'}; compile {cfg.compile}")
        if distributed.launched():
            print(f"parallel: {distributed.choose_parallel(cfg.parallel, cfg.method)} over "
                  f"{distributed.world_size()} processes")
    return model, step_module


def build_training(cfg: TuneConfig, vocab_size: int, device: str, dtype: torch.dtype, max_steps: int,
                   verbose: bool = True):
    """(model, optimizer, scheduler, `train_step` options) for a config: everything a step needs. The options
    hold the `step_module` to call: the model and its loss, wrapped by DDP or FSDP2 under torchrun.
    Benchmarks pass a huge `max_steps`, so the learning rate never decays while they time."""
    model, step_module = _build(cfg, vocab_size, device, dtype, verbose)
    # After the wrapping: FSDP2 replaces the parameters with sharded ones.
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, device, cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.warmup_steps, max_steps, cfg.min_lr_ratio)
    return model, optimizer, scheduler, {**step_options(cfg, device, dtype), "step_module": step_module}


def step_options(cfg: TuneConfig, device: str, dtype: torch.dtype) -> dict:
    """The keyword arguments of `train_step` that a config decides."""
    return {"autocast_dtype": autocast_dtype(device, dtype), "loss": cfg.loss, "sdpa_backends": sdpa_backends(cfg.sdpa_backend, device)[0]}


def batch_widths(cfg: TuneConfig) -> dict:
    """The collator's width rules: packed rows at `max_length`; padded batches to a multiple of 8 tokens, or of
    64 under --compile (few shapes, few compilations)."""
    return {"pad_to": cfg.max_length if cfg.packing == "pack" else 0,
            "pad_to_multiple_of": speedups.compile_pad_multiple(cfg.compile, cfg.packing) or 8}


def collator(cfg: TuneConfig, pad_id: int) -> Collator:
    """The collator of the run's batches (`batch_widths`), for rows read outside the DataLoader (held-out rows)."""
    return Collator(pad_id, **batch_widths(cfg))


def batches_from(ds, cfg: TuneConfig, pad_id: int, epoch: int = 0, start_batch: int = 0):
    """Yield (epoch, batch index within epoch, batch) forever, starting at a saved position.

    One DataLoader serves every epoch (its sampler moves on), so persistent workers really persist."""
    loader = build_dataloader(ds, cfg.batch_size, pad_id, cfg.seed, epoch, start_batch, cfg.num_workers,
                              rank=distributed.rank(), world=distributed.world_size(),
                              pin_memory=cfg.pin_memory and torch.cuda.is_available(),
                              prefetch_factor=cfg.prefetch_factor, persistent_workers=cfg.persistent_workers,
                              group_by_length=cfg.packing == "group", **batch_widths(cfg))
    loader.worker_init_fn = functools.partial(_worker_init, loader.worker_init_fn)
    while True:
        for i, batch in enumerate(loader, start_batch):
            yield epoch, i, batch
        epoch, start_batch = epoch + 1, 0
        loader.sampler.set_epoch(epoch)


def _worker_init(then, worker_id: int) -> None:
    """DataLoader workers leave SIGINT, SIGTERM and SIGHUP (Ctrl-C, `kill` and a closed terminal reach the whole
    process group) to the training process, which finishes its step, saves and then shuts them down. Left to
    torch, they die, and the training process fails with "DataLoader worker ... killed by signal" wherever it
    is, before saving."""
    for signum in stopping.STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if then is not None:
        then(worker_id)


def batch_plan(cfg: TuneConfig, world: int) -> TuneConfig:
    """`cfg` with `grad_accum` computed from `global_batch` when that is set: global_batch / (batch_size x
    world), which must be whole; otherwise a ConfigError that says which values would work."""
    if not cfg.global_batch:
        return cfg
    per_step = cfg.batch_size * world
    if cfg.global_batch % per_step:
        below, above = cfg.global_batch // per_step * per_step, -(-cfg.global_batch // per_step) * per_step
        near = sorted({max(per_step, below), above})
        raise ConfigError(f"config field 'global_batch' = {cfg.global_batch}: not a whole number of micro-batches "
                          f"of batch_size {cfg.batch_size} on {world} GPU(s) ({per_step} rows each); use "
                          f"{' or '.join(map(str, near))}, or another --batch-size")
    return dataclasses.replace(cfg, grad_accum=cfg.global_batch // per_step)


def run_length(cfg: TuneConfig, rows: int, world: int = 1, say=print) -> TuneConfig:
    """`cfg` with `max_steps` computed from `epochs` when that is set: optimizer steps that take `epochs`
    passes over `rows` batch rows (samples, or packed rows), whole batches only, as the loader gives them;
    `eval_every` -1 becomes one epoch's steps.
    On `world` processes each reads `rows // world` of them (`batching.EpochSampler`)."""
    if not cfg.epochs:
        return cfg
    per_epoch = rows // world // cfg.batch_size  # each rank's batches; the loader drops an incomplete last one
    steps = max(1, math.ceil(cfg.epochs * per_epoch / cfg.grad_accum))
    say(f"length: {cfg.epochs:g} epochs of {per_epoch} batches of {cfg.batch_size} -> {steps} optimizer steps")
    # eval_every -1: the held-out loss after each epoch's optimizer steps (and at the end)
    every = max(1, per_epoch // cfg.grad_accum) if cfg.eval_every == -1 else cfg.eval_every
    return dataclasses.replace(cfg, max_steps=steps, eval_every=every)


def resolved_config(cfg: TuneConfig, device: str, dtype: torch.dtype) -> TuneConfig:
    """`cfg` with what `auto` and the empty out_dir resolved to here: what the run's config.json records."""
    name = {v: k for k, v in mdl.DTYPE.items()}[dtype]
    return dataclasses.replace(cfg, device=device, dtype=name, out_dir=str(cfg.run_dir()))
