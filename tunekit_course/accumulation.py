"""Lesson 3's accumulation check: how far from one big batch the gradients of gradient accumulation land,
dividing by the step's target tokens (tunekit) or averaging the micro-batches' means (the article).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tunekit.data.batching import IGNORE
from tunekit.step import count_targets, micro_step


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
    big = {k: torch.cat([F.pad(b[k], (0, width - b[k].shape[1]), value=0 if k == "input_ids" else IGNORE)
                         for b in micro_batches]) for k in ("input_ids", "labels")}
    reference = grads_of([big], [1.0 / sum(counts)])
    exact = grads_of(micro_batches, [1.0 / sum(counts)] * len(counts))
    naive = grads_of(micro_batches, [1.0 / (c * len(counts)) for c in counts])

    def distance(g):
        return float((g - reference).norm() / reference.norm())

    return {"targets_per_micro_batch": counts, "exact": distance(exact), "mean_of_means": distance(naive)}
