"""The training loop: read it top to bottom.

One optimizer step = `grad_accum` micro-batches. The loss is summed over target tokens and divided by the
number of target tokens in the *whole* step (not by the number of micro-batches), so accumulating 4 x 2
samples gives the same loss and gradients as one batch of 8 whatever the padding.

Speed choices, each with its reason:
- bf16 weights and autocast on GPUs that have it; fp32 on CPU (CPU bf16 matmuls are slow and inexact).
- No attention mask: batches are right-padded and attention is causal, so real tokens never see a pad.
  Without a mask SDPA can pick its fused flash/cuDNN kernels.
- Fused AdamW on CUDA (one kernel for all parameters instead of several per tensor).
- Progress, metrics and checkpoints happen once per step, outside the micro-step.

`micro_step` is a plain function of (model, batch, n_targets): later lessons compile it, wrap the model in
FSDP or swap the loss for a fused kernel without touching the loop.

Around the loop, nothing a user ran is lost (README, "Reliability"): a run folder holds one run (checked by
`checkpoint.open_run` before any data or model work), its files are written once the run has started, a
non-finite loss stops the run with its metrics row kept, and SIGINT/SIGTERM finish the step and checkpoint
(tunekit/stopping.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tunekit import batching, checkpoint, data, distributed, memory, prepared, runlock, speedups, stopping
from tunekit import loss as loss_fn
from tunekit import model as mdl
from tunekit.attention import choose_attention, sdpa_backends, sdpa_context
from tunekit.config import GPU_PRESETS, TuneConfig, save_config
from tunekit.speedups import build_optimizer  # noqa: F401  (the run's API: train.build_optimizer, ...)
from tunekit.stopping import Diverged, Interrupted, read_metrics  # noqa: F401  (train.Diverged, ...)

# ---- building the pieces from a config ---------------------------------------------------------------


def resolve_runtime(cfg: TuneConfig) -> tuple[str, torch.dtype]:
    device = mdl.resolve_device(cfg.device)
    if device != "cuda" and cfg.preset in GPU_PRESETS and not cfg.model and cfg.hidden_size >= 2048:  # its own shape
        raise RuntimeError(f"preset {cfg.preset!r} builds a {'1.1' if cfg.hidden_size == 2048 else '6.7'}B-parameter "
                           "model and needs a CUDA GPU, "
                           "but none is visible (run `tunekit doctor`). On this machine use --preset tiny.")
    if cfg.method == "qlora":
        mdl.require_cuda_for_4bit(device)  # before data and model work, not after
    if device == "cpu" and (threads := cpu_threads(cfg)):
        torch.set_num_threads(threads)
    return device, mdl.resolve_dtype(cfg.dtype, device)


def cpu_threads(cfg: TuneConfig) -> int:
    """The CPU thread count a run on the CPU should use (see the config field `cpu_threads`); 0: leave
    PyTorch's own choice alone."""
    import os

    if cfg.cpu_threads:
        return cfg.cpu_threads
    if os.environ.get("OMP_NUM_THREADS"):
        return 0  # the user chose; torch already follows it
    return 1 if cfg.hidden_size <= 1024 and not cfg.model else 0


def training_texts(ds, source: str = "dataset") -> list[str]:
    """The text of every record, as the tokenizer will see it (chats included)."""
    layout = data.detect_layout(ds.column_names, source)
    return [data.record_text(r, *layout) for r in ds]


def build_tokenizer(cfg: TuneConfig, records=None):
    if cfg.tokenizer or cfg.model:
        return mdl.load_tokenizer(cfg.tokenizer or cfg.model, cfg.trust_remote_code)
    records = records if records is not None else data.load_records(cfg.data, fields=cfg.fields)
    return mdl.train_tokenizer(training_texts(records, cfg.data), cfg.tokenizer_vocab)


def prepare(cfg: TuneConfig, num_proc: int | None = None, verbose: bool = True, *, commit: bool = True,
            check_run: bool = False):
    """Tokenize the training data offline into `<run_dir>/prepared/`, or reuse it if it is up to date and
    every file of it verifies (tunekit/prepared.py: a key that follows the data's content, checksums).

    Returns (tokenizer, tokenized dataset, stats); `stats["packing"]` is the strategy the config's `packing`
    resolved to (`auto` decides from the sample lengths, `batching.choose_packing`), and the dataset is then
    packed rows if it is `pack`. What is made goes to the cache first; `commit=False` (a run's start) leaves
    it there (`stats["staged"]`) for `prepared.commit` to copy in once the run has started, so a start that
    fails changes nothing. `check_run` (a resume): the data, the tokenizer and the samples must be those of
    the run's record (`data.json`), else a DataError says what changed."""
    import datasets

    if cfg.tokenize == "in_loop":
        return _in_loop(cfg, verbose, check_run)
    say = print if verbose else (lambda *a, **k: None)
    run_dir = cfg.run_dir()
    out = run_dir / "prepared"
    digest = data.source_digest(cfg.data)
    record = _run_record(run_dir, check_run, say)
    prepared.check_data(record, digest, cfg.data, run_dir)  # before any work
    key = prepare_key(cfg, digest)
    where, remote = out, getattr(cfg, "trust_remote_code", False)
    found, problem = prepared.load(out, key, remote)
    if found is None:
        if problem:
            say(f"data: {problem}; preparing the data again")
        where = prepared.cache_folder(key)
        found, problem = prepared.load(where, key, remote)
        if found is None and where.exists():  # damaged: made again below
            shutil.rmtree(where, ignore_errors=True)
    if found is not None:
        tokenizer, ds, stats = found
        stats["cached"] = True  # this run reused the prepared data
        say(f"data: reusing {where} ({stats['samples']} samples, {stats['tokens']} tokens)")
    else:
        if not verbose or not stopping.on_terminal():  # progress bars are carriage returns in a log file
            datasets.disable_progress_bars()
        records = data.load_records(cfg.data, fields=cfg.fields)
        tokenizer = build_tokenizer(cfg, records)
        # datasets' own cache beside a save_to_disk folder is named by the fingerprint in its state.json, which an
        # edit of its arrow files keeps: tokenized afresh (the key above follows the files).
        ds, stats = data.tokenize_dataset(records, tokenizer, cfg.max_length, num_proc=num_proc, source=cfg.data,
                                          use_cache=not Path(data.resolve_source(cfg.data)).is_dir(),
                                          **text_options(cfg))
        stats["packing"], stats["packing_reason"] = batching.choose_packing(cfg.packing, data.lengths_of(ds),
                                                                            cfg.max_length)
        if stats["packing"] == "pack":
            ds = data.pack_dataset(ds, cfg.max_length)
            stats["packed_rows"] = len(ds)
        stats.update(key=key, data=cfg.data, data_sha256=digest, vocab_size=len(tokenizer))
        cached = stats.pop("cached")
        prepared.save(where, tokenizer, ds, stats)
        found, problem = prepared.load(where, key, remote, verify=False)  # memory-mapped, as later starts read it
        if found is None:
            raise data.DataError(f"{where}: the data just prepared cannot be read back: {problem}")
        tokenizer, ds, stats = found
        stats["cached"] = cached
        say(f"data: {stats['samples']} samples, {stats['tokens']} tokens, {stats['truncated']} truncated "
            f"to {cfg.max_length} -> {out}")
    say(f"batches: {stats['packing_reason']}")
    prepared.check_run(record, stats, run_dir, cfg.tokenizer or cfg.model or f"trained on {cfg.data}")
    if where != out:
        if commit:
            prepared.copy_in(where, out)
        else:
            stats["staged"] = str(where)
    return tokenizer, ds, stats


def prepare_key(cfg: TuneConfig, digest: str | None = None) -> str:
    """What names a config's prepared data: the content of its data (`digest`, computed if not given) and of
    a local tokenizer, not their size and mtime (tunekit/prepared.py), and every option that changes a sample."""
    digest = digest or data.source_digest(cfg.data)
    return hashlib.sha256(json.dumps([cfg.data, digest, prepared.tokenizer_source(cfg.tokenizer or cfg.model),
                                      cfg.tokenizer_vocab, cfg.max_length, cfg.packing, cfg.fields,
                                      cfg.response_template, cfg.instruction_template,
                                      data.read_chat_template(cfg.chat_template)]).encode()).hexdigest()[:16]


def _run_record(run_dir: Path, check_run: bool, say) -> dict | None:
    """On a resume, what the run recorded it trained on (None, saying so, for a run from before the record)."""
    record = prepared.read_record(run_dir) if check_run else None
    if check_run and record is None:
        say(f"resume: {run_dir} has no {prepared.RECORD} (started before tunekit recorded its data): its data and "
            "tokenizer cannot be checked this time; they are recorded from now on")
    return record


def text_options(cfg: TuneConfig) -> dict:
    """How a record's text becomes a sample (masking markers, chat template): what every tokenization of the
    run's data, training or held-out, offline or in the loop, is given."""
    return {"response_template": cfg.response_template, "instruction_template": cfg.instruction_template,
            "chat_template": cfg.chat_template}


def _in_loop(cfg: TuneConfig, verbose: bool, check_run: bool = False):
    """`tokenize=in_loop`: the records as they are, tokenized sample by sample as the DataLoader reads them
    (`data.InLoopTokenized`); only the tokenizer is made (or read) before training. A resume checks the data
    and the tokenizer against the run's record, as `prepare` does."""
    run_dir = cfg.run_dir()
    digest = data.source_digest(cfg.data)
    record = _run_record(run_dir, check_run, print if verbose else (lambda *a, **k: None))
    prepared.check_data(record, digest, cfg.data, run_dir)
    records = data.load_records(cfg.data, fields=cfg.fields)
    tokenizer = build_tokenizer(cfg, records)
    ds = data.InLoopTokenized(records, tokenizer, cfg.max_length, cfg.data, **text_options(cfg))
    reason = "pad: tokenize=in_loop (each batch tokenized as it is read, padded to its longest sample)"
    stats = {"samples": len(ds), "tokens": None, "target_tokens": None, "truncated": None, "packing": "pad",
             "packing_reason": reason, "tokenize": "in_loop", "data": cfg.data, "data_sha256": digest,
             "tokenizer_sha256": prepared.tokenizer_digest(tokenizer), "vocab_size": len(tokenizer)}
    prepared.check_run(record, stats, run_dir, cfg.tokenizer or cfg.model or f"trained on {cfg.data}")
    if verbose:
        print(f"data: {len(ds)} records of {cfg.data}, tokenized in the loop")
        print(f"batches: {reason}")
    return tokenizer, ds, stats


def run_arch(cfg: TuneConfig, vocab_size: int):
    """The Llama config of a random-init run: the config's shape, its vocabulary or the tokenizer's."""
    return mdl.llama_config(cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.intermediate_size,
                            cfg.vocab_size or vocab_size, cfg.num_kv_heads, max(cfg.max_length, 2048))


def build_training_model(cfg: TuneConfig, vocab_size: int, device: str, dtype: torch.dtype, verbose: bool = True):
    """The model as it will train: base weights (random init, hub or local), LoRA/QLoRA, checkpointing."""
    attn, why = choose_attention(cfg.attention, device, packed=cfg.packing == "pack")
    arch = run_arch(cfg, vocab_size)
    if cfg.vocab_size and vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {vocab_size} tokens but vocab_size is {cfg.vocab_size}; "
                         f"raise --vocab-size or lower --tokenizer-vocab.")
    if cfg.method == "qlora":
        # Rank 0 saves the random-init model once; the others load what it wrote (under torchrun, transformers
        # writes no config.json from the other ranks).
        source = cfg.model or str(distributed.main_first(lambda: mdl.save_random_init(arch, torch.bfloat16, cfg.seed)))
        model = mdl.load_quantized(source, device, attn, trust_remote_code=cfg.trust_remote_code)
        if cfg.peft_kbit_prepare:  # peft's guides; upcasts the non-4-bit weights to fp32 (measured in lesson 2)
            from peft import prepare_model_for_kbit_training

            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        model = mdl.build_model(arch, cfg.model, dtype, device, attn, cfg.seed, cfg.trust_remote_code)
    # Model code stays single-device and eager; what changes its kernels comes here, before the adapters.
    kernels = speedups.apply_liger(model) if cfg.kernels == "liger" else []
    if cfg.method in ("lora", "qlora"):
        torch.manual_seed(cfg.seed + 1)
        model = mdl.apply_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets,
                               cast_input=cfg.lora_input_cast)
    if cfg.fast_lora:  # with fp8: the frozen base weights in FP8, quantized once
        from tunekit import fastlora

        # FSDP2 shards each layer's weight on its own; a group's concatenated weight would stay whole on each GPU
        group = cfg.fast_lora_group and distributed.choose_parallel(cfg.parallel, cfg.method) != "fsdp"
        kernels.append(fastlora.attach(model, fp8=cfg.fp8, group=group))
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
    if cfg.loss == "liger" and (why := speedups.liger_available()):
        raise RuntimeError(f"config field 'loss' = 'liger': {why}; use --loss chunked (tunekit's own fused loss).")
    if verbose:
        trainable, total = mdl.count_parameters(model)
        source = cfg.model or "random init (no pretrained knowledge: speed and memory match real weights, the loss starts from noise)"
        print(f"model: {total / 1e6:.1f}M params, {trainable / 1e6:.2f}M trainable ({cfg.method}), {source}")
        ckpt = ("on, offloaded to CPU" if cfg.grad_ckpt_offload else "on") if cfg.grad_ckpt else "off"
        print(f"attention: {why}; {sdpa_backends(cfg.sdpa_backend, device)[1]}")
        print(f"dtype {dtype}; checkpointing {ckpt}; loss {cfg.loss}; optimizer {cfg.optimizer}; device {device}")
        if kernels or cfg.compile != "none":
            print(f"speed-ups: {', '.join(kernels) or 'no kernel swaps'}; compile {cfg.compile}")
    return model


def build_training(cfg: TuneConfig, vocab_size: int, device: str, dtype: torch.dtype, max_steps: int,
                   verbose: bool = True):
    """(model, optimizer, scheduler, `train_step` options) for a config: everything a step needs. The options
    hold the `step_module` to call: the model and its loss, wrapped by DDP or FSDP2 under torchrun.
    Benchmarks pass a huge `max_steps`, so the learning rate never decays while they time."""
    model = build_training_model(cfg, vocab_size, device, dtype, verbose=verbose)
    options = step_options(cfg, device, dtype)
    # The one place parallelism is applied (a no-op in a single process); the optimizer comes after, since
    # FSDP2 replaces the parameters with sharded ones.
    parallel = distributed.choose_parallel(cfg.parallel, cfg.method)
    options["step_module"] = distributed.parallelize(StepModule(model, cfg.loss, options["autocast_dtype"]), model,
                                                     parallel, device, dtype, cfg.fsdp_reshard, cfg.compile)
    if verbose and distributed.launched():
        print(f"parallel: {parallel} over {distributed.world_size()} processes")
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, device, cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.warmup_steps, max_steps, cfg.min_lr_ratio)
    return model, optimizer, scheduler, options


def build_scheduler(optimizer, warmup_steps: int, max_steps: int, min_lr_ratio: float):
    """Linear warm-up to the peak, then a cosine down to `min_lr_ratio` of it."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---- one step ----------------------------------------------------------------------------------------


def count_targets(micro_batches: list[dict]) -> int:
    """Target tokens in the whole step: labels that are not ignored, after the one-token shift."""
    return sum(int((b["labels"][:, 1:] != data.IGNORE).sum()) for b in micro_batches)


class StepModule(torch.nn.Module):
    """The model and its loss as one module: `forward(input_ids, labels, position_ids, scale)` returns the
    micro-batch's summed token loss times `scale`. DDP and FSDP2 wrap this module (`distributed.parallelize`),
    so every call goes through their hooks: the chunked loss calls the decoder and the LM head separately,
    which would go around the hooks of a wrapped language model.

    Labels are shifted rather than logits sliced, which would copy the largest tensor of the step.
    `loss="chunked"` computes the LM head and the loss together, never holding the logits (tunekit/loss.py);
    `loss="liger"` is Liger's kernel for the same."""

    def __init__(self, model, loss: str = "plain", autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.model, self.loss, self.autocast_dtype = model, loss, autocast_dtype

    def forward(self, input_ids, labels, position_ids=None, scale: float = 1.0) -> torch.Tensor:
        autocast_dtype = self.autocast_dtype
        labels = F.pad(labels[:, 1:], (0, 1), value=data.IGNORE)
        # position_ids restart at each packed sample: transformers then masks attention per sample.
        inputs = {"input_ids": input_ids, "position_ids": position_ids}
        with torch.autocast(input_ids.device.type, dtype=autocast_dtype or torch.float32,
                            enabled=autocast_dtype is not None):
            if self.loss != "plain":
                hidden, head = loss_fn.hidden_and_head(self.model, **inputs)
            else:
                logits = self.model(**inputs, use_cache=False).logits
        if self.loss != "plain":
            dtype = autocast_dtype or hidden.dtype  # the head's matmul runs in the autocast dtype, as inside
            head = head.to(hidden.device, dtype, non_blocking=True)  # (a head kept in CPU memory comes over)
            if self.loss == "liger":
                return speedups.liger_loss(hidden.to(dtype), head, labels, scale)
            return loss_fn.chunked_lm_loss(hidden.to(dtype), head, labels, scale)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1),
                               ignore_index=data.IGNORE, reduction="sum") * scale


def micro_step(model, batch: dict, n_targets: int, autocast_dtype: torch.dtype | None,
               loss: str = "plain", scale: float | None = None, step_module=None) -> torch.Tensor:
    """Forward and backward on one micro-batch; returns its share of the step loss (detached): its summed
    token loss times `scale` (default `1 / n_targets`). `step_module` (a `StepModule`, perhaps wrapped by
    DDP or FSDP2) is what runs; by default one around `model`."""
    module = step_module if step_module is not None else StepModule(model, loss, autocast_dtype)
    value = module(batch["input_ids"], batch["labels"], batch.get("position_ids"),
                   1.0 / n_targets if scale is None else scale)
    value.backward()
    return value.detach()


def train_step(model, micro_batches: list[dict], optimizer, scheduler, max_grad_norm: float,
               autocast_dtype: torch.dtype | None, loss: str = "plain", sdpa_backends=None,
               step_module=None) -> dict:
    """One optimizer step over `micro_batches` (already on the device).

    Distributed (`step_module` wrapped by DDP or FSDP2, see tunekit/distributed.py): the loss is divided by
    the target tokens of the step on all ranks, counted before any backward, and multiplied by the world size
    (the wrappers average gradients over ranks), so the gradients are those of one process on the global
    batch; gradients are synchronised on the last micro-step only. The loss returned is the global one.
    `sdpa_backends` (from `attention.sdpa_backends`) holds for forward *and* backward: checkpointing
    recomputes attention in backward."""
    module = step_module if step_module is not None else StepModule(model, loss, autocast_dtype)
    device = micro_batches[0]["input_ids"].device
    world = distributed.world_size()
    n_targets = max(1, distributed.all_reduce_sum(count_targets(micro_batches)))
    value = torch.zeros((), device=device)
    with sdpa_context(sdpa_backends):
        for i, b in enumerate(micro_batches):
            with distributed.gradient_sync(module, enabled=i == len(micro_batches) - 1):
                value += micro_step(model, b, n_targets, None, scale=world / n_targets, step_module=module)
    if world > 1:
        value = distributed.all_reduce_sum(value) / world
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: the norm of sharded gradients is a DTensor
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": value, "grad_norm": grad_norm, "targets": n_targets}


def accumulation_check(model, micro_batches: list[dict]) -> dict:
    """How far from one big batch the gradients of gradient accumulation land, two ways (claim C12):
    `exact` divides the summed token losses by the target tokens of the whole step (`train_step`);
    `mean_of_means` takes each micro-batch's mean loss divided by the number of micro-batches (the article's
    `loss / gradient_accumulation_steps`). Each is compared with the gradient of all the micro-batches as one
    batch: the relative L2 distance over the trainable parameters. Unpacked, right-padded batches; the
    model's gradients are left zeroed."""
    def grads_of(batches, scales) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        for b, scale in zip(batches, scales):
            micro_step(model, b, 1, None, scale=scale)
        flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return flat

    if any("position_ids" in b for b in micro_batches):
        raise ValueError("accumulation_check takes unpacked batches (without position_ids)")
    counts = [count_targets([b]) for b in micro_batches]
    width = max(b["input_ids"].shape[1] for b in micro_batches)
    big = {k: torch.cat([F.pad(b[k], (0, width - b[k].shape[1]), value=0 if k == "input_ids" else data.IGNORE)
                         for b in micro_batches]) for k in ("input_ids", "labels")}
    reference = grads_of([big], [1.0 / sum(counts)])
    exact = grads_of(micro_batches, [1.0 / sum(counts)] * len(counts))
    naive = grads_of(micro_batches, [1.0 / (c * len(counts)) for c in counts])

    def distance(g):
        return float((g - reference).norm() / reference.norm())

    return {"targets_per_micro_batch": counts, "exact": distance(exact), "mean_of_means": distance(naive)}


def step_options(cfg: TuneConfig, device: str, dtype: torch.dtype) -> dict:
    """The keyword arguments of `train_step` that a config decides."""
    return {"autocast_dtype": dtype if dtype != torch.float32 and device == "cuda" else None,
            "loss": cfg.loss, "sdpa_backends": sdpa_backends(cfg.sdpa_backend, device)[0]}


def to_device(batch: dict, device: str) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def batch_widths(cfg: TuneConfig) -> dict:
    """The collator's width rules: packed rows at `max_length`; padded batches to a multiple of 8 tokens, or of
    64 under --compile (few shapes, few compilations)."""
    return {"pad_to": cfg.max_length if cfg.packing == "pack" else 0,
            "pad_to_multiple_of": speedups.compile_pad_multiple(cfg.compile, cfg.packing) or 8}


def batches_from(ds, cfg: TuneConfig, pad_id: int, epoch: int, start_batch: int):
    """Yield (epoch, batch index within epoch, batch) forever, starting at a saved position.

    One DataLoader serves every epoch (its sampler moves on), so persistent workers really persist."""
    loader = data.build_dataloader(ds, cfg.batch_size, pad_id, cfg.seed, epoch, start_batch, cfg.num_workers,
                                   rank=distributed.rank(), world=distributed.world_size(),
                                   pin_memory=cfg.pin_memory and torch.cuda.is_available(),
                                   prefetch_factor=cfg.prefetch_factor, persistent_workers=cfg.persistent_workers,
                                   group_by_length=cfg.packing == "group",
                                   **batch_widths(cfg))
    loader.worker_init_fn = functools.partial(_worker_init, loader.worker_init_fn)
    while True:
        for i, batch in enumerate(loader, start_batch):
            yield epoch, i, batch
        epoch, start_batch = epoch + 1, 0
        loader.sampler.set_epoch(epoch)


def split_eval(ds, cfg: TuneConfig, tokenizer=None, stats: dict | None = None):
    """(training rows, held-out rows or None): `eval_data` tokenized as the training data was (packed if it
    is), or `eval_split` of the rows, picked by a permutation of `seed`, so a resumed run holds out the same
    ones."""
    if cfg.eval_data:
        records = data.load_records(cfg.eval_data, fields=cfg.fields)
        if cfg.tokenize == "in_loop":
            return ds, data.InLoopTokenized(records, tokenizer, cfg.max_length, cfg.eval_data, **text_options(cfg))
        held, _ = data.tokenize_dataset(records, tokenizer, cfg.max_length, source=cfg.eval_data, **text_options(cfg))
        return ds, data.pack_dataset(held, cfg.max_length) if (stats or {}).get("packing") == "pack" else held
    if not cfg.eval_split:
        return ds, None
    n = max(1, round(cfg.eval_split * len(ds)))
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(cfg.seed + 7)).tolist()
    return ds.select(sorted(order[n:])), ds.select(sorted(order[:n]))


@torch.no_grad()
def evaluate(step_module, model, eval_ds, cfg: TuneConfig, pad_id: int, device: str, sdpa_backends=None) -> float:
    """Mean token loss over the held-out rows, each rank its share (rows rank, rank + world, ...), summed over
    ranks. The model is in eval mode for it and back in train mode after."""
    rank, world = distributed.rank(), distributed.world_size()
    rows = list(range(rank, len(eval_ds), world))
    collate = batching.Collator(pad_id, **batch_widths(cfg))
    view = batching.model_columns(eval_ds)
    total, count = torch.zeros((), device=device), 0
    model.eval()
    try:
        with sdpa_context(sdpa_backends):
            for i in range(0, len(rows), cfg.batch_size):
                batch = collate([view[j] for j in rows[i:i + cfg.batch_size]])
                batch.pop("attention_mask", None)
                b = to_device(batch, device)
                total += step_module(b["input_ids"], b["labels"], b.get("position_ids"), 1.0).float()
                count += count_targets([b])
    finally:
        model.train()
    total = distributed.all_reduce_sum(total)
    return float(total) / max(1, distributed.all_reduce_sum(count))


def finished(run_dir: Path, cfg: TuneConfig) -> bool:
    """Whether a run whose final checkpoint exists also wrote what follows it: the adapter (or the whole model)
    and `summary.json`. A kill between them leaves a run that a resume finishes rather than calls done."""
    out = run_dir / ("model/config.json" if cfg.method == "full" else "adapter/adapter_config.json")
    return out.exists() and (run_dir / "summary.json").exists()


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
    from tunekit.config import ConfigError

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
    passes over `rows` batch rows (samples, or packed rows), whole batches only, as the loader gives them.
    On `world` processes each reads `rows // world` of them (`batching.EpochSampler`)."""
    if not cfg.epochs:
        return cfg
    per_epoch = rows // world // cfg.batch_size  # each rank's batches; the loader drops an incomplete last one
    steps = max(1, math.ceil(cfg.epochs * per_epoch / cfg.grad_accum))
    say(f"length: {cfg.epochs:g} epochs of {per_epoch} batches of {cfg.batch_size} -> {steps} optimizer steps")
    return dataclasses.replace(cfg, max_steps=steps)


def resolved_config(cfg: TuneConfig, device: str, dtype: torch.dtype) -> TuneConfig:
    """`cfg` with what `auto` and the empty out_dir resolved to here: what the run's config.json records."""
    name = {v: k for k, v in mdl.DTYPE.items()}[dtype]
    return dataclasses.replace(cfg, device=device, dtype=name, out_dir=str(cfg.run_dir()))


# ---- the run -----------------------------------------------------------------------------------------


def train(cfg: TuneConfig, resume: bool = False, stop_after: int | None = None, progress: bool = True,
          overwrite: bool = False, allow_config_change: bool = False) -> dict:
    """Train `cfg.max_steps` steps; checkpoint every `save_every`; with `resume`, continue from the newest
    checkpoint that verifies, exactly. `stop_after` ends the process's work after that step (as a kill
    would) — for time-boxed sessions and the resume test. Returns a summary with the loss curve.

    Nothing is lost: a folder holding another run is refused unless `overwrite` (its files are deleted once
    the new run has started); run files are written only once data and model are built; a resume refuses a
    changed config unless every change is in `config.RESUME_SAFE_FIELDS` and `allow_config_change`. A
    non-finite loss or gradient norm writes its metrics row and raises `Diverged`; SIGINT/SIGTERM finish the
    step, write a checkpoint and raise `Interrupted`."""
    from tqdm.auto import tqdm

    if resume and overwrite:
        raise ValueError("--resume continues the run in the folder and --overwrite replaces it: pick one.")
    t0 = time.perf_counter()
    device, dtype = resolve_runtime(cfg)
    distributed.init(device)  # under torchrun: the process group, this rank's GPU (else nothing)
    main = distributed.is_main()  # rank 0 alone prints and writes the run's files
    cfg = batch_plan(cfg, distributed.world_size())
    resolved = resolved_config(cfg, device, dtype)
    run_dir = cfg.run_dir()
    say = print if progress and main else (lambda *a, **k: None)
    state = {"started": False, "signal": None, "step": 0, "checkpoint": None}  # shared with the signal handler
    # The lock (rank 0's: one launch is one writer) is taken before the folder is looked at and dropped before
    # an empty new folder is removed.
    with stopping.removed_if_left_empty(run_dir), runlock.hold(run_dir, "this run") if main else \
            contextlib.nullcontext(), stopping.stop_requests(state), speedups.tf32(cfg.tf32, device):
        ckpt, changes = checkpoint.open_run(run_dir, resolved, resume, overwrite, allow_config_change, say,
                                            clean=main)
        step = checkpoint.checkpoint_step(ckpt) if ckpt else 0
        if ckpt is not None and (was := checkpoint.checkpoint_world(ckpt)) != distributed.world_size():
            raise checkpoint.CheckpointError(
                f"{ckpt} was written by a run on {was} process(es), this one has {distributed.world_size()}: each "
                f"rank's place in the data is counted in its own batches. Resume with the same launch "
                f"(torchrun --nproc_per_node {was}{' ...' if was > 1 else ''}), or start a new run.")
        planned = cfg.max_steps
        if cfg.epochs and ckpt is not None:  # the data decides the length: known here only if epochs is as saved
            saved_cfg = checkpoint.saved_config(run_dir)
            planned = saved_cfg.max_steps if saved_cfg.epochs == cfg.epochs else math.inf
        finishing = step >= planned and not finished(run_dir, resolved)
        if step >= planned and not finishing:  # before the data and the model are built
            say(f"nothing to do: {run_dir} already ran {step} of {planned} steps")
            stats = json.loads((run_dir / "summary.json").read_text()).get("data")
            return {"steps": step, "losses": [], "final_loss": None, "data": stats, "run_dir": str(run_dir)}
        if finishing:  # killed after its final checkpoint, before the outputs that follow it were written
            say(f"resume: {run_dir} ran all {step} steps but its outputs were not all written; writing them from {ckpt}")

        # Rank 0 tokenizes (into the cache, copied into the run folder once it has started); the others then read
        # what it wrote.
        timings = {"start_s": time.perf_counter() - t0}  # the device resolved, the run folder checked
        tokenizer, ds, stats = distributed.main_first(lambda: prepare(cfg, verbose=progress and main, commit=False,
                                                                      check_run=ckpt is not None))
        staged = stats.pop("staged", None)  # made in the cache: copied into the folder once the run has started
        say(data.preview(ds, tokenizer, stats))  # one sample as the model sees it, the masked part marked
        ds, eval_ds = distributed.main_first(lambda: split_eval(ds, cfg, tokenizer, stats))
        if eval_ds is not None:
            when = f"{'every ' + str(cfg.eval_every) + ' steps and ' if cfg.eval_every else ''}at the end"
            say(f"held out: {len(eval_ds)} rows of {cfg.eval_data} for the eval loss ({when})" if cfg.eval_data else
                f"held out: {len(eval_ds)} of {len(ds) + len(eval_ds)} rows for the eval loss ({when})")
        world = distributed.world_size()
        if len(ds) // world < cfg.batch_size:  # each rank reads len(ds) // world rows
            what = "packed rows" if stats["packing"] == "pack" else "samples"
            on = f" on each of {world} processes" if world > 1 else ""
            raise ValueError(f"{cfg.data}: {len(ds) // world} {what}{on}, fewer than one batch of {cfg.batch_size}.")
        cfg = run_length(dataclasses.replace(cfg, packing=stats["packing"]), len(ds), world, say)
        resolved = resolved_config(cfg, device, dtype)
        torch.manual_seed(cfg.seed)
        t_build = time.perf_counter()
        timings["prepare_s"] = t_build - t0 - timings["start_s"]  # tokenizing (or reading it back), held-out rows
        model, optimizer, scheduler, options = build_training(cfg, len(tokenizer), device, dtype, cfg.max_steps,
                                                              progress and main)
        timings["build_s"] = time.perf_counter() - t_build
        epoch, start_batch = 0, 0
        if ckpt is not None:
            saved = checkpoint.load_checkpoint(ckpt, model, optimizer, scheduler, verify=False)  # open_run did
            step, epoch, start_batch = saved["step"], saved["data"]["epoch"], saved["data"]["next_batch"]
            say(f"resume: from {ckpt} (step {step}, epoch {epoch}, batch {start_batch})")
        elif resume:
            say(f"resume: no checkpoint in {run_dir}; starting fresh")
        for change in changes:
            say(f"resume: {change} (--allow-config-change)")

        # The run has started: only now are its files written (a failed start leaves the folder as it was).
        state.update(started=True, step=step, checkpoint=ckpt)  # a signal from here on stops at a step's end
        if main and overwrite and (removed := checkpoint.remove_run(run_dir)):
            say(f"overwrite: removed the earlier run's {', '.join(removed)} from {run_dir}")
        if main:  # the prepared data it trains on, and its record of them (data.json) that a resume checks
            prepared.commit(run_dir, staged, stats, resumed=ckpt is not None)
        if main and ckpt is not None:  # checkpoints newer than it failed to verify: their steps are done again
            found = checkpoint.checkpoints(run_dir)
            for later in found[found.index(ckpt) + 1:]:
                shutil.rmtree(later, ignore_errors=True)
        metrics_file = run_dir / "metrics.jsonl"
        rows = [r for r in stopping.read_metrics_file(metrics_file) if r["step"] <= step] if ckpt else []  # drop later steps
        if main:
            checkpoint.atomic_write_text(metrics_file, "".join(stopping.json_line(r) for r in rows))
            save_config(resolved, run_dir / "config.json")
        last_finite = next(((r["step"], r["loss"]) for r in reversed(rows) if r["loss"] is not None), None)

        stream = batches_from(ds, cfg, tokenizer.pad_token_id, epoch, start_batch)
        # A bar of carriage returns only on a terminal; sent to a file, the log is plain lines.
        bar = tqdm(total=cfg.max_steps, initial=step, desc="train") if progress and stopping.on_terminal() else None
        memory.reset_peak_memory(device)
        t_last, tokens_since, losses, saved_at, eval_losses = time.perf_counter(), 0, [], step, []
        t_loop, eval_total = t_last, 0.0
        # Samples and real tokens trained on so far, and the run's wall-clock seconds, counting the run this one
        # resumes.
        seen = {k: saved["data"].get(k, 0) if ckpt else 0 for k in ("samples", "tokens")}
        elapsed0 = saved["data"].get("elapsed_s", 0.0) if ckpt else 0.0
        position = {"epoch": epoch, "next_batch": start_batch, **seen, "world": world,  # of the last finished step
                    "elapsed_s": elapsed0}
        with open(metrics_file, "a") if main else contextlib.nullcontext() as mf:
            while step < cfg.max_steps and state["signal"] is None:
                micro, counts = [], [0, 0]  # this rank's samples and real tokens (counted on the host)
                for _ in range(cfg.grad_accum):
                    epoch, index, batch = next(stream)
                    counts[0] += batching.count_samples(batch)
                    counts[1] += int(batch.pop("attention_mask").sum())
                    micro.append(to_device(batch, device))
                out = train_step(model, micro, optimizer, scheduler, cfg.max_grad_norm, **options)
                if world > 1:  # every rank's counts, and whether any was asked to stop
                    *counts, stop = distributed.all_reduce_sum(torch.tensor([*counts, state["signal"] or 0])).tolist()
                    if stop and state["signal"] is None:  # another rank was: all stop after this step
                        state["signal"] = signal.SIGTERM
                seen["samples"], seen["tokens"] = seen["samples"] + int(counts[0]), seen["tokens"] + int(counts[1])
                tokens_since += int(counts[1])
                step += 1
                position = {"epoch": epoch, "next_batch": index + 1, **seen, "world": world,
                            "elapsed_s": round(elapsed0 + time.perf_counter() - t0, 3)}
                loss, grad_norm = out["loss"].item(), float(out["grad_norm"])
                if "first_step_s" not in timings:  # compiling and CUDA's warm-up happen here, once a run
                    timings["first_step_s"] = time.perf_counter() - t_loop
                losses.append(loss)
                diverged = not (math.isfinite(loss) and math.isfinite(grad_norm))
                eval_now = eval_ds is not None and not diverged and (
                    step == cfg.max_steps or (cfg.eval_every and step % cfg.eval_every == 0))
                eval_s = 0.0
                if eval_now:  # not counted in tok/s
                    t_eval = time.perf_counter()
                    eval_losses.append((step, evaluate(options["step_module"], model, eval_ds, cfg,
                                                       tokenizer.pad_token_id, device, options["sdpa_backends"])))
                    eval_s = time.perf_counter() - t_eval
                    eval_total += eval_s
                if diverged or eval_now or step % cfg.log_every == 0 or step == cfg.max_steps:
                    now = time.perf_counter()
                    alloc, _ = memory.peak_memory_gb(device)
                    row = {"step": step, "loss": round(loss, 6), "lr": scheduler.get_last_lr()[0],
                           "grad_norm": round(grad_norm, 6), "epoch": epoch, **seen,
                           "tok_per_s": round(tokens_since / (now - t_last - eval_s), 1),
                           "peak_mem_gb": round(alloc, 3), "elapsed_s": round(elapsed0 + now - t0, 3)}
                    if eval_now:
                        row["eval_loss"] = round(eval_losses[-1][1], 6)
                    if mf is not None:
                        mf.write(stopping.json_line(row))
                        mf.flush()
                    if bar is not None:
                        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tok_per_s']:.0f}", mem=f"{alloc:.1f}G")
                    else:
                        held = f" (held-out {row['eval_loss']:.4f})" if eval_now else ""
                        say(f"step {step}/{cfg.max_steps}: loss {loss:.4f}{held}, lr {row['lr']:.3g}, grad norm "
                            f"{grad_norm:.3g}, {row['tok_per_s']:,.0f} tok/s, peak {alloc:.2f} GB, "
                            f"{seen['samples']:,} samples seen", flush=True)
                    t_last, tokens_since = now, 0
                if diverged:
                    if bar is not None:
                        bar.close()
                    last = (f"last finite loss {last_finite[1]:.4f} at step {last_finite[0]}" if last_finite
                            else "no finite loss before it")
                    raise stopping.Diverged(f"diverged at step {step}: loss {loss}, grad norm {grad_norm} ({last}); last "
                                   f"good checkpoint: {state['checkpoint'] or 'none'}. Lower --lr or clip with "
                                   "--max-grad-norm, and start again.")
                last_finite = (step, loss)
                if bar is not None:
                    bar.update(1)
                if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
                    state["checkpoint"] = checkpoint.save_checkpoint(run_dir, step, model, optimizer, scheduler,
                                                                     position, cfg.keep_checkpoints)
                    saved_at = step
                state["step"] = step
                if stop_after is not None and step >= stop_after:
                    break
        if bar is not None:
            bar.close()
        if state["signal"] is not None and step < cfg.max_steps:
            if saved_at != step:
                state["checkpoint"] = checkpoint.save_checkpoint(run_dir, step, model, optimizer, scheduler,
                                                                 position, cfg.keep_checkpoints)
                what = f"at step {step}; checkpoint written: {state['checkpoint']}"
            elif state["checkpoint"] is not None:
                what = f"at step {step}; its checkpoint is {state['checkpoint']}"
            else:
                what = "before the first step finished; no checkpoint"
            raise stopping.Interrupted(state["signal"], step, state["checkpoint"], what)
        summary = {"steps": step, "losses": losses, "final_loss": losses[-1] if losses else None,
                   "samples_seen": seen["samples"], "tokens_seen": seen["tokens"],
                   "epochs_seen": round(seen["samples"] / max(1, stats["samples"]), 4),
                   "packing": stats["packing"], "data": stats, "run_dir": str(run_dir),
                   "eval_losses": eval_losses, "eval_loss": eval_losses[-1][1] if eval_losses else None,
                   "vocab_size": len(tokenizer), "params_trainable": mdl.count_parameters(model)[0],
                   # this process's wall-clock seconds: start (device, run folder), prepare (tokenizing or reading
                   # it back), build (model, adapters, wrapping), train (the steps, held-out evaluations included)
                   "timings": {**{k: round(v, 3) for k, v in timings.items()},
                               "train_s": round(time.perf_counter() - t_loop, 3), "eval_s": round(eval_total, 3)}}
        if finishing:  # no step ran in this process: the run's own record of its last losses
            rows = stopping.read_metrics_file(metrics_file)
            losses_run = [r["loss"] for r in rows if r.get("loss") is not None]
            summary.update(final_loss=losses_run[-1] if losses_run else None,
                           eval_losses=[(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None])
            summary["eval_loss"] = summary["eval_losses"][-1][1] if summary["eval_losses"] else None
        if step >= cfg.max_steps:  # (a signal now changes nothing: the run is finishing)
            if not finishing:  # (finishing: the final checkpoint is there, verified)
                checkpoint.save_checkpoint(run_dir, step, model, optimizer, scheduler, position, cfg.keep_checkpoints)
            # LoRA: the PEFT adapter folder; full fine-tuning: the whole model, loadable with from_pretrained.
            weights = distributed.full_trainable(model) if distributed.is_sharded(model) else None  # all ranks
            if main:
                mdl.save_adapter(model, run_dir / ("adapter" if cfg.method != "full" else "model"), weights)
                checkpoint.atomic_write_json(run_dir / "summary.json",
                                             {k: v for k, v in summary.items() if k != "losses"})
        distributed.barrier()  # no rank leaves (and tears the group down) while another still talks to it
        return summary
