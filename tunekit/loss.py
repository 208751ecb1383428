"""The loss without the logits: LM head and cross-entropy fused, a chunk of tokens at a time.

The plain path (`model(...).logits` then `F.cross_entropy`) materializes the logits, B*S*V numbers: for
a 32,000-token vocabulary at batch 1 x 2048 that is 65M logits, and its backward holds four copies of
them (bf16 logits, the fp32 log-softmax output autograd saves, the fp32 gradient coming in and the fp32
gradient going out: 14 bytes a logit, 0.92 GB; 7.3 GB at batch 8). On a QLoRA step that is a sixth of
the memory.

`chunked_lm_loss` never holds more than `chunk` tokens' logits. For each chunk it computes the logits,
the loss *and the gradient at once* — the gradient of cross-entropy with respect to the logits is
softmax(logits) - onehot(label), known in the forward pass — and multiplies it straight back through
the LM head: the gradient of the hidden states (and of the head's weight, when it trains) is all that is
kept. Backward then only scales it. Nothing is recomputed, so it costs no extra FLOPs; the idea is
Liger Kernel's fused linear cross-entropy (https://arxiv.org/abs/2410.10989), here in plain PyTorch.

The numbers are those of the plain path: the logits come from the same bf16 matmul and are upcast to
fp32 for the softmax, and the gradient goes back through the head in the head's dtype, as autocast does
(tests/unit/test_loss.py compares losses and gradients).

Under a regionally compiled step (`speedups.compile_step`) each chunk's softmax, loss and gradient run as
compiled code (`_loss_and_grad`): two reads of the chunk's logits and one write of its gradient, where the eager
code, in place for the least memory, passes over fp32 copies of them several times.
"""

from __future__ import annotations

import functools
import os

import torch

from tunekit.data.batching import IGNORE  # the label the loss skips, defined with the data that sets it
from tunekit.model import base_model

DEFAULT_CHUNK_ELEMENTS = 2**25  # logits per chunk: 1024 tokens at a 32k vocabulary, ~0.27 GB in fp32


def chunk_tokens(vocab: int, elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Tokens per chunk so that one chunk's logits hold about `elements` numbers (a power of two)."""
    n = max(1, elements // max(1, vocab))
    return 1 << (n.bit_length() - 1)


def _loss_and_grad(logits, y, scale, softcap: float):
    """One chunk's summed token loss (fp32) and its gradient with respect to the head's output `logits`, in their
    dtype. Eager, it works in place on one fp32 copy of the logits (the least memory); compiled
    (`_compiled_loss_and_grad`), the same steps become two reads of the logits and one write of the gradient."""
    z = logits.float()  # the head's bf16 matmul, upcast for the softmax
    if softcap:
        capped = torch.tanh(z / softcap)
        z = capped * softcap
    lse = torch.logsumexp(z, dim=-1)
    valid = y != IGNORE
    safe = torch.where(valid, y, 0)
    total = torch.where(valid, lse - z.gather(1, safe[:, None]).squeeze(1), 0.0).sum()
    g = z.sub_(lse[:, None]).exp_()  # softmax, in place: the logits are not needed again
    if torch.compiler.is_compiling():  # the label's -1 as a comparison, which fuses into the one pass
        g = g - (torch.arange(g.shape[1], device=g.device)[None, :] == safe[:, None]).to(g.dtype)
    else:  # in place, no full-size temporary
        g[torch.arange(len(y), device=y.device), safe] -= 1.0
    g.mul_((valid.to(g.dtype) * scale)[:, None])  # d(loss)/d(logits)
    if softcap:  # through the soft-cap: d(logits)/dz = 1 - tanh^2
        g.mul_(capped.mul_(capped).neg_().add_(1.0))
    return total, g.to(logits.dtype)


@functools.cache
def _compiled_loss_and_grad():
    """`_loss_and_grad` through `torch.compile`, built on first use (one per process)."""
    return torch.compile(_loss_and_grad)


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, scale, chunk, softcap, compiled):
        # hidden (N, H) in the compute dtype, weight (V, H), labels (N,); returns sum of token losses * scale.
        # softcap > 0: the logits are softcap * tanh(z / softcap) of the head's z (Gemma 2's final soft-capping),
        # and the gradient of z is that of the logits times 1 - tanh^2 (`_loss_and_grad`, compiled or not).
        n = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if weight.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        chunk_fn = _compiled_loss_and_grad() if compiled else _loss_and_grad
        for start in range(0, n, chunk):
            h, y = hidden[start:start + chunk], labels[start:start + chunk]
            part, g = chunk_fn(h @ weight.t(), y, scale, softcap)
            total += part
            grad_hidden[start:start + chunk] = g @ weight
            if grad_weight is not None:  # summed over chunks in fp32
                grad_weight += (g.t() @ h).float()
            del g
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total * scale

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_out.to(grad_hidden.dtype)
        gw = None if grad_weight is None else (grad_weight * grad_out).to(grad_hidden.dtype)
        return gh, gw, None, None, None, None, None


def as_scale(scale: float | torch.Tensor, device) -> torch.Tensor:
    """The loss's scale as a 0-d float32 tensor on `device`: a compiled forward then takes it as an input.
    Passed as a Python float, dynamo guards on its value: it changes every step (1 / the step's targets), so
    each step traced the loss again until torch's recompile limit (8) sent that frame back to eager (seen on an
    H200 with the whole QLoRA model compiled, where a graph break left the loss in a frame of its own)."""
    if torch.is_tensor(scale):
        return scale
    return torch.full((), float(scale), dtype=torch.float32, device=device)


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, scale: float = 1.0,
                    chunk: int | None = None, softcap: float = 0.0, compiled: bool = False) -> torch.Tensor:
    """sum over tokens of cross_entropy(hidden @ weight.T, labels) * scale, without holding the logits.

    `hidden` is (..., H), `labels` the matching (...) targets, already shifted, `IGNORE` where no loss;
    `weight` is the LM head's (V, H). `scale` is usually 1 / (target tokens in the step). `softcap` > 0: the
    logits soft-capped as Gemma 2 does (`softcap_of`). `compiled`: each chunk's elementwise work compiled
    (`_loss_and_grad`; `compiled_for` says whether a model's step asked for it), not under a compile already
    tracing this call."""
    h = hidden.reshape(-1, hidden.shape[-1])
    if weight.dtype != h.dtype:  # under autocast the head would run in the autocast dtype
        weight = weight.to(h.dtype)
    y = labels.reshape(-1).to(h.device)
    if y.shape[0] != h.shape[0]:
        raise ValueError(f"chunked_lm_loss: {h.shape[0]} hidden states but {y.shape[0]} labels")
    compiled = compiled and not torch.compiler.is_compiling()
    # a tensor: a compiled step's input; compiled chunks take it as one too (a float would be a constant of their code)
    scale = as_scale(scale, h.device) if compiled or torch.is_tensor(scale) else float(scale)
    return _ChunkedLMLoss.apply(h, weight, y, scale, chunk or chunk_tokens(weight.shape[0]), float(softcap or 0),
                               compiled)


def compile_with(model) -> None:
    """Mark `model` so that its chunked loss runs compiled (`speedups.compile_step`'s regional mode does)."""
    base_model(model)._tk_compiled_loss = True


def compiled_for(model) -> bool:
    """Whether `model`'s chunked loss runs compiled (`compile_with`); `TUNEKIT_COMPILED_LOSS=0` keeps it eager
    (to time one against the other in the same run)."""
    return bool(getattr(base_model(model), "_tk_compiled_loss", False)) \
        and os.environ.get("TUNEKIT_COMPILED_LOSS", "1") != "0"


def softcap_of(model) -> float:
    """The model's final-logit soft-capping (Gemma 2: `final_logit_softcapping`), 0.0 where it has none."""
    return float(getattr(base_model(model).config, "final_logit_softcapping", None) or 0.0)


def fused_loss_blocker(model) -> str:
    """Why `chunked_lm_loss` cannot stand in for this model's head, or '' when it can.

    It needs a decoder (`model.model`) whose output goes through a bias-free linear head, then at most Gemma 2's
    soft-capping (`softcap_of`, which the chunked loss applies), not a scaling (as Cohere's or Granite's)."""
    base = base_model(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if not hasattr(base, "model") or head is None:
        return f"{type(base).__name__} has no separate decoder and LM head"
    if getattr(head, "bias", None) is not None or not hasattr(head, "weight") or head.weight.dim() != 2:
        return "the LM head is not a bias-free linear layer"
    for attr in ("logit_scale", "logits_scaling"):
        if getattr(base.config, attr, None) not in (None, 1, 1.0):
            return f"the model rescales its logits ({attr})"
    return ""


def hidden_and_head(model, input_ids, position_ids=None):
    """The decoder's last hidden states and the LM head's weight, skipping the logits."""
    base = base_model(model)
    hidden = base.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    return hidden, base.get_output_embeddings().weight
