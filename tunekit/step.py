"""One training step: the micro-step and the optimizer step, which never see a config.

One optimizer step = `grad_accum` micro-batches. The loss is summed over target tokens and divided by the
number of target tokens in the *whole* step (not by the number of micro-batches), so accumulating 4 x 2
samples gives the same loss and gradients as one batch of 8 whatever the padding.

`micro_step` is a plain function of (model, batch, n_targets): later lessons compile it, wrap the model in
FSDP or swap the loss for a fused kernel without touching the loop.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tunekit import distributed, memory, speedups
from tunekit import loss as loss_fn
from tunekit.attention import sdpa_context
from tunekit.data import batching
from tunekit.data.batching import IGNORE


def count_targets(micro_batches: list[dict]) -> int:
    """Target tokens in the whole step: labels that are not ignored, after the one-token shift."""
    return sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in micro_batches)


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
        labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
        # position_ids restart at each packed sample: transformers then masks attention per sample.
        inputs = {"input_ids": input_ids, "position_ids": position_ids}
        with torch.autocast(labels.device.type, dtype=autocast_dtype or torch.float32,
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
            return loss_fn.chunked_lm_loss(hidden.to(dtype), head, labels, scale,
                                           softcap=loss_fn.softcap_of(self.model),
                                           compiled=loss_fn.compiled_for(self.model))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1),
                               ignore_index=IGNORE, reduction="sum") * scale


def micro_step(model, batch: dict, n_targets: int, autocast_dtype: torch.dtype | None,
               loss: str = "plain", scale: float | None = None, step_module=None) -> torch.Tensor:
    """Forward and backward on one micro-batch; returns its share of the step loss (detached): its summed
    token loss times `scale` (default `1 / n_targets`). `step_module` (a `StepModule`, perhaps wrapped by
    DDP or FSDP2) is what runs; by default one around `model`."""
    module = step_module if step_module is not None else StepModule(model, loss, autocast_dtype)
    labels = batch["labels"]  # on the device (the token ids may be on the host: `to_device`)
    value = module(batch["input_ids"], labels, batch.get("position_ids"),
                   loss_fn.as_scale(1.0 / n_targets if scale is None else scale, labels.device))
    value.backward()
    return value.detach()


def train_step(model, micro_batches: list[dict], optimizer, scheduler, max_grad_norm: float,
               autocast_dtype: torch.dtype | None, loss: str = "plain", sdpa_backends=None,
               step_module=None, n_targets: int | None = None) -> dict:
    """One optimizer step over `micro_batches` (already on the device). `n_targets`: the step's target tokens
    over all ranks (`count_targets` of the batches before they went to the device, summed over ranks), which
    the caller counted on the host; None counts them here from the device's batches, which waits for the
    device once a micro-batch (and, distributed, for a collective).

    Distributed (`step_module` wrapped by DDP or FSDP2, see tunekit/distributed.py): the loss is divided by
    the target tokens of the step on all ranks, counted before any backward, and multiplied by the world size
    (the wrappers average gradients over ranks), so the gradients are those of one process on the global
    batch; gradients are synchronised on the last micro-step only. The loss returned is the global one.
    `sdpa_backends` (from `attention.sdpa_backends`) holds for forward *and* backward: checkpointing
    recomputes attention in backward."""
    module = step_module if step_module is not None else StepModule(model, loss, autocast_dtype)
    device = micro_batches[0]["labels"].device
    world = distributed.world_size()
    if n_targets is None:
        n_targets = distributed.all_reduce_sum(count_targets(micro_batches))
    n_targets = max(1, n_targets)
    speedups.begin_step()
    value = torch.zeros((), device=device)
    scale = loss_fn.as_scale(world / n_targets, device)  # once a step, every micro-batch's input
    with sdpa_context(sdpa_backends):
        for i, b in enumerate(micro_batches):
            with distributed.gradient_sync(module, enabled=i == len(micro_batches) - 1):
                value += micro_step(model, b, n_targets, None, scale=scale, step_module=module)
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


def _eval_forward(step_module):
    """What the held-out evaluation calls: `step_module`, but where its whole forward was compiled for training
    (`compile="model"`), the same forward run eagerly. That graph is for train mode with gradients: called in
    eval mode under no_grad it would be traced and compiled anew, minutes for a 7B model (longer than the
    evaluation itself), at the end of every run. Under DDP, the step it wraps (no gradient to reduce)."""
    inner = getattr(step_module, "module", step_module)
    if hasattr(inner.forward, "_torchdynamo_orig_callable"):  # torch.compile's wrapper of the bound forward
        return functools.partial(type(inner).forward, inner)
    return step_module


def to_device(batch: dict, device: str, host_ids: bool = False) -> dict:
    """`batch` on `device` (copies queued, not waited for); with `host_ids` the token ids stay where they are,
    on the host, for a model whose embedding table is there (`memory.host_embedded`)."""
    return {k: v if host_ids and k == "input_ids" else v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def evaluate(step_module, model, eval_ds, batch_size: int, collate, device: str, sdpa_backends=None) -> float:
    """Mean token loss over the held-out rows, `batch_size` rows at a time made into batches by `collate` (a
    `batching.Collator`), each rank its share (rows rank, rank + world, ...), summed over ranks. The model is
    in eval mode for it and back in train mode after."""
    rank, world = distributed.rank(), distributed.world_size()
    rows = list(range(rank, len(eval_ds), world))
    view = batching.model_columns(eval_ds)
    total, count = torch.zeros((), device=device), 0
    forward = _eval_forward(step_module)
    host_ids = memory.host_embedded(model)
    model.eval()
    try:
        with torch.no_grad(), sdpa_context(sdpa_backends):
            for i in range(0, len(rows), batch_size):
                batch = collate([view[j] for j in rows[i:i + batch_size]])
                batch.pop("attention_mask", None)
                count += count_targets([batch])  # on the host: no wait for the device
                b = to_device(batch, device, host_ids)
                total += forward(b["input_ids"], b["labels"], b.get("position_ids"), 1.0).float()
    finally:
        model.train()
    total = distributed.all_reduce_sum(total)
    return float(total) / max(1, distributed.all_reduce_sum(count))
