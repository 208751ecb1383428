"""Memory: gradient checkpointing, and measuring peak memory.

Gradient checkpointing keeps only each decoder block's input in forward and recomputes the block in
backward (https://arxiv.org/abs/1604.06174). It saves most activation memory and costs one extra forward,
about a third more compute. We use PyTorch's non-reentrant implementation, which works with frozen inputs
(LoRA) and with torch.compile.

A trap: transformers applies checkpointing only in train mode, and `from_pretrained` returns a model in
eval mode — so "checkpointing on" can silently do nothing. `apply_gradient_checkpointing` puts the model
in train mode, and `check_checkpointing` fails loudly if a model is about to train without it.

## Estimating peak memory before loading anything

`estimate_memory` predicts `torch.cuda.max_memory_allocated` of one training step of a Llama-shaped model
(tunekit's step: bf16 weights, bf16 autocast, SDPA, `logits.float()` then cross-entropy, AdamW), in bytes:

- weights: 2 bytes a parameter in bf16. QLoRA: NF4 is 4 bits a weight plus double-quantized constants
  (an 8-bit absmax per 64 weights and an fp32 one per 256 of those: ~0.127 bits), on the decoder's linear
  layers only; bitsandbytes leaves the embeddings, LM head and norms in bf16.
- lora: the adapters, fp32 (peft's default): r * (in + out) per adapted linear.
- optimizer: AdamW keeps 2 states per trainable parameter *in the parameter's dtype* — fp32 for LoRA, bf16
  for full fine-tuning, since our loop trains bf16 weights directly (no fp32 master copy).
- gradients: one per trainable parameter, in its dtype.
- activations: what autograd saves for backward, counted tensor by tensor from the code path and checked
  exactly against `saved_tensors_hooks` on a tiny model (tests/test_memory.py). Per decoder layer, with
  B*S tokens, width H, MLP width I: each RMSNorm saves its fp32 upcast (4 B*S*H) and rstd; q, k, v after
  RoPE, the SDPA output and its fp32 logsumexp; SwiGLU saves gate, up and silu(gate) (3 x 2 B*S*I) and the
  down projection's input. Full fine-tuning adds the linear inputs and the bf16 normalized inputs that the
  trainable weights need. LoRA adds, per adapted linear, a bf16 copy of its input (peft casts the input to
  the fp32 adapter dtype and autocast casts it back, making a new tensor that lora_A saves), the rank-r
  intermediate and bf16 copies of the adapter weights. With checkpointing a layer keeps only its bf16
  input (2 B*S*H); backward recomputes one layer at a time, so one layer's activations come back.
- logits: the loss path peaks in the backward of log_softmax at 14 bytes per logit: the bf16 logits
  (micro_step holds them), the saved fp32 log_softmax output, the fp32 gradient from nll_loss and the fp32
  gradient log_softmax produces (B*S*V elements each).
- overhead: cuBLAS workspaces, the bnb dequantization buffer and other transients the allocator sees;
  a 0.25 GB constant. The CUDA context (~0.5-1 GB on an H200) is outside `max_memory_allocated`; it is
  returned as `cuda_context` and added only in `device_total` (closer to what nvidia-smi shows, less
  allocator fragmentation: compare `peak_reserved_gb`).

The peak is the largest of three moments: the loss backward (all saved activations + logits), the first
recomputed layer under checkpointing (saved inputs + one layer + gradients), and the end of backward (all
gradients; matters only for full fine-tuning). Against the H200 results in notebooks/results it is within
about 1% (tests/test_memory.py checks 15%).
"""

from __future__ import annotations

import torch


def apply_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Turn on non-reentrant checkpointing of every decoder block, and switch the model to train mode."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # the transformers >= 5.2x name
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    base.config.use_cache = False  # a KV cache is useless in training and clashes with recomputation
    model.train()


def checkpointing_active(model: torch.nn.Module) -> bool:
    """True when checkpointing is on *and* will actually run (the blocks are in train mode)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    flag = getattr(base, "is_activation_checkpointing", None)  # transformers >= 5.x name
    if flag is None:
        flag = getattr(base, "is_gradient_checkpointing", False)
    return bool(flag) and base.training


def check_checkpointing(model: torch.nn.Module, wanted: bool) -> None:
    if wanted and not checkpointing_active(model):
        raise RuntimeError("gradient checkpointing was asked for but is not active: the model is in eval mode "
                           "(from_pretrained returns eval mode) or checkpointing was never enabled. "
                           "Call model.train() after apply_gradient_checkpointing(model).")


def reset_peak_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gb(device: str) -> tuple[float, float]:
    """(peak allocated, peak reserved) in GB (1e9 bytes) since the last reset.

    On CPU both are the process's peak resident set size since it started (the OS keeps no resettable
    peak), which includes Python and the libraries: an upper bound, not the model's share."""
    if device != "cuda":
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB
        return rss, rss
    return torch.cuda.max_memory_allocated() / 1e9, torch.cuda.max_memory_reserved() / 1e9


# ---- estimating peak memory -------------------------------------------------------------------------

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NF4_BYTES = 0.5 + 0.127 / 8  # 4 bits a weight + double-quantized absmax constants (QLoRA paper, sec. 3)
OVERHEAD_BYTES = int(0.25e9)  # cuBLAS workspaces, bnb dequant buffer, small transients
CUDA_CONTEXT_BYTES = int(0.75e9)  # driver context + kernels; not in max_memory_allocated


def _lora_modules(method: str, lora_targets: str) -> tuple[str, ...]:
    if method == "full":
        return ()
    if lora_targets == "all-linear":
        return LINEARS
    names = tuple(t.strip() for t in lora_targets.split(",") if t.strip())
    unknown = [n for n in names if n not in LINEARS]
    if unknown:
        raise ValueError(f"lora_targets: unknown module(s) {unknown}; use 'all-linear' or some of {LINEARS}")
    return names


def _linear_shapes(hidden: int, heads: int, kv_heads: int, intermediate: int) -> dict[str, tuple[int, int]]:
    kv = hidden // heads * kv_heads
    return {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
            "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden)}


def estimate_layer_activations(hidden: int, heads: int, kv_heads: int, intermediate: int, tokens: int,
                               method: str, lora_r: int = 16, lora_targets: str = "all-linear",
                               input_needs_grad: bool = True) -> int:
    """Bytes autograd saves for backward in one Llama decoder layer under bf16 autocast with SDPA.

    `tokens` is batch * seq. `input_needs_grad=False` is the first layer of a LoRA model without
    checkpointing: the frozen embedding's output needs no gradient, so its input norm saves nothing."""
    T, H, I = tokens, hidden, intermediate
    kv = H // heads * kv_heads
    full = method == "full"
    adapted = _lora_modules(method, lora_targets)
    shapes = _linear_shapes(H, heads, kv_heads, I)
    norm = 4 * T * H + 4 * T + (2 * T * H if full else 0)  # fp32 upcast + rstd (+ bf16 normalized for the weight)
    b = norm if input_needs_grad or full else 0  # input_layernorm
    b += norm  # post_attention_layernorm
    if full:
        b += 2 * T * H * 2  # the inputs of q/k/v (one shared tensor) and of gate/up
        b += 2 * T * I  # down_proj's input (o_proj's input is the SDPA output itself, stored (B, S, h, d))
    b += 2 * T * (H + 2 * kv) + 2 * T * H + 4 * T * heads  # q, k, v after RoPE; SDPA output; logsumexp
    b += 3 * 2 * T * I  # SwiGLU: gate (silu's input), silu(gate) and up (the product's operands)
    for name in adapted:
        fan_in, fan_out = shapes[name]
        b += 2 * T * fan_in + 2 * T * lora_r + 2 * lora_r * (fan_in + fan_out)  # input copy, x@A, bf16 A and B
    return b


def estimate_saved_activations(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                               vocab: int, seq: int, batch: int, method: str, lora_r: int = 16,
                               lora_targets: str = "all-linear", grad_ckpt: bool = False) -> dict:
    """Bytes held for backward at the end of the forward pass: `layers` (decoder layers, or their saved
    inputs under checkpointing), `rest` (embedding, final norm, LM head, RoPE tables, labels) and
    `log_softmax` (its fp32 output), plus `total`."""
    T = batch * seq
    full = method == "full"
    if grad_ckpt:
        per_layer = [2 * T * hidden] * layers  # each block's bf16 input
    else:
        per_layer = [estimate_layer_activations(hidden, heads, kv_heads, intermediate, T, method, lora_r,
                                                lora_targets, input_needs_grad=full or i > 0)
                     for i in range(layers)]
    rest = 4 * T * hidden + 4 * T  # final norm: fp32 upcast + rstd
    if full:
        rest += 2 * T * hidden * 2 + 8 * T  # bf16 normalized (for the norm weight), LM head input, token ids
    if not grad_ckpt:
        rest += 2 * 2 * seq * (hidden // heads)  # RoPE cos and sin (bf16), shared by all layers
    rest += 8 * T  # the labels cross-entropy keeps
    out = {"layers": sum(per_layer), "rest": rest, "log_softmax": 4 * T * vocab}
    out["total"] = sum(out.values())
    return out


def estimate_memory(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                    seq: int, batch: int, method: str, lora_r: int = 16, lora_targets: str = "all-linear",
                    grad_ckpt: bool = False, weight_dtype_bytes: int = 2, optimizer: str = "adamw",
                    overhead_bytes: int = OVERHEAD_BYTES) -> dict:
    """Predict the peak GPU memory (bytes, as `torch.cuda.max_memory_allocated` reports it) of one training
    step of a Llama-shaped model with tunekit's loop, before loading anything. See the module docstring.

    Returns the named parts, `total` (the predicted peak), `peak_at` (which moment of the step it is),
    `cuda_context` and `device_total` (= total + cuda_context)."""
    if method not in ("full", "lora", "qlora"):
        raise ValueError(f"method: {method!r}; use 'full', 'lora' or 'qlora'")
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer: {optimizer!r}; the estimator knows 'adamw' (2 states) and 'sgd' (none)")
    T = batch * seq
    shapes = _linear_shapes(hidden, heads, kv_heads, intermediate)
    linear = layers * sum(i * o for i, o in shapes.values())
    other = 2 * vocab * hidden + (2 * layers + 1) * hidden  # embeddings, LM head (untied), norms
    adapted = _lora_modules(method, lora_targets)
    lora = layers * sum(lora_r * sum(shapes[n]) for n in adapted)
    if method == "qlora":
        weights = int(linear * NF4_BYTES) + 2 * other
    else:
        weights = weight_dtype_bytes * (linear + other)
    trainable, train_bytes = (linear + other, weight_dtype_bytes) if method == "full" else (lora, 4)
    parts = {
        "weights": weights,
        "lora": 4 * lora,
        "optimizer": (2 if optimizer == "adamw" else 0) * train_bytes * trainable,
        "gradients": train_bytes * trainable,
    }
    saved = estimate_saved_activations(hidden, layers, heads, kv_heads, intermediate, vocab, seq, batch,
                                       method, lora_r, lora_targets, grad_ckpt)
    parts["activations"] = saved["layers"] + saved["rest"]
    parts["recompute"] = (estimate_layer_activations(hidden, heads, kv_heads, intermediate, T, method, lora_r,
                                                     lora_targets) if grad_ckpt else 0)
    # log_softmax backward: bf16 logits + saved fp32 output + fp32 grad in + fp32 grad out
    parts["logits"] = (2 + 4 + 4 + 4) * T * vocab
    parts["overhead"] = overhead_bytes
    static = parts["weights"] + parts["lora"] + parts["optimizer"] + parts["overhead"]
    moments = {
        "loss backward": parts["activations"] + parts["logits"],
        "first recomputed layer": parts["activations"] + parts["recompute"] + parts["gradients"],
        "end of backward": parts["gradients"],
    }
    peak_at = max(moments, key=moments.get)
    parts["total"] = static + moments[peak_at]
    parts["peak_at"] = peak_at
    parts["cuda_context"] = CUDA_CONTEXT_BYTES
    parts["device_total"] = parts["total"] + CUDA_CONTEXT_BYTES
    return parts


def estimate_memory_for(hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int,
                        vocab_size: int, max_length: int, batch_size: int, method: str, num_kv_heads: int = 0,
                        lora_r: int = 16, lora_targets: str = "all-linear", grad_ckpt: bool = False,
                        **_ignored) -> dict:
    """`estimate_memory` from TuneConfig field names, so `estimate_memory_for(**config_dict(cfg))` works
    (other fields are ignored; `vocab_size` must be set: a tokenizer's size is unknown before loading)."""
    if not vocab_size:
        raise ValueError("vocab_size is 0 (the tokenizer's size); pass the vocabulary size explicitly")
    return estimate_memory(hidden_size, num_layers, num_heads, num_kv_heads or num_heads, intermediate_size,
                           vocab_size, max_length, batch_size, method, lora_r, lora_targets, grad_ckpt)


def format_estimate(est: dict) -> str:
    """One line: the parts in GB and the predicted peak."""
    keys = ("weights", "lora", "optimizer", "gradients", "activations", "recompute", "logits", "overhead")
    body = ", ".join(f"{k} {est[k] / 1e9:.2f}" for k in keys if est[k])
    return f"{body} -> peak {est['total'] / 1e9:.2f} GB at {est['peak_at']}"
