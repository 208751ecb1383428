"""What autograd saves for backward in a Llama-shaped decoder layer, tensor by tensor: the activations part of the
peak-memory estimate (tunekit/estimate.py), and the projections' shapes it and the weights are counted from.

Op by op (PyTorch's own kernels), counted tensor by tensor from the code path and checked exactly against `saved_tensors_hooks` on a tiny model (tests/unit/test_memory.py). Per decoder layer, with
B*S tokens, width H, MLP width I: each RMSNorm saves its fp32 upcast (4 B*S*H) and rstd; q, k, v after
RoPE, the attention output and a fused kernel's fp32 logsumexp (eager attention and SDPA's math kernel
instead keep every score twice, fp32 and bf16: 6 B*heads*S*S bytes); SwiGLU saves gate, up and silu(gate)
(3 x 2 B*S*I) and the down projection's input. Full fine-tuning adds the linear inputs and the bf16
normalized inputs that the trainable weights need. LoRA adds, per adapted linear, the rank-r intermediate
and bf16 copies of the adapter weights, and whatever input lora_A must keep: with peft's input cast a
bf16 copy per adapted linear, without it only the tensors no frozen layer kept already (8 B*S*H bytes a
layer less). With checkpointing a layer keeps only its bf16 input (2 B*S*H; nothing on the GPU when
offloaded); backward recomputes one layer at a time, so one layer's activations come back.

Fused (`fused=True`): a compiled step (regional or whole-model: inductor's partitioner) and Liger's kernels keep
less. Each RMSNorm saves its bf16 input and rstd rather than its fp32 upcast (2 B*S*H instead of 4), and SwiGLU
saves gate and up, recomputing silu(gate) in backward (2 x 2 B*S*I instead of 3 x). Fitted on the H200's
compiled and Liger steps of the Llama-2-7B shape and checked on the Llama-3.1-8B and Qwen2.5-7B shapes (each
within 3% of its measured peak: tests/unit/test_memory.py). A compiled *full* fine-tune keeps less again (on the
H200's two such steps the fused estimate is 18-21% high): an overestimate, left as it is and not checked.

Recomputed (`recompute=True`, config `compile_recompute`): a compiled step that recomputes what a matmul reads in
the backward keeps neither norm's output nor SwiGLU's for the adapters' A, nor the adapters' bf16 copies (counted
exactly on a tiny compiled model on CPU, tests/unit/test_memory.py; not measured on a GPU).
"""

from __future__ import annotations

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_modules(method: str, lora_targets: str) -> tuple[str, ...]:
    if method == "full":
        return ()
    if lora_targets == "all-linear":
        return LINEARS
    names = tuple(t.strip() for t in lora_targets.split(",") if t.strip())
    unknown = [n for n in names if n not in LINEARS]
    if unknown:
        raise ValueError(f"lora_targets: unknown module(s) {unknown}; use 'all-linear' or some of {LINEARS}")
    return names


def head_widths(hidden: int, heads: int, kv_heads: int, head_dim: int = 0) -> tuple[int, int]:
    d = head_dim or hidden // heads  # (q width, k/v width); head_dim 0: hidden / heads
    return heads * d, kv_heads * d


def linear_shapes(hidden: int, heads: int, kv_heads: int, intermediate: int,
                   head_dim: int = 0) -> dict[str, tuple[int, int]]:
    q, kv = head_widths(hidden, heads, kv_heads, head_dim)
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden)}


def estimate_layer_activations(hidden: int, heads: int, kv_heads: int, intermediate: int, tokens: int,
                               method: str, lora_r: int = 16, lora_targets: str = "all-linear",
                               input_needs_grad: bool = True, lora_input_cast: bool = True,
                               scores_per_token: int = 0, head_dim: int = 0, fused: bool = False,
                               recompute: bool = False) -> int:
    """Bytes autograd saves for backward in one Llama decoder layer under bf16 autocast with SDPA (`fused`: as a
    compiled step or Liger's kernels save them, see the module's docstring).

    `tokens` is batch * seq. `input_needs_grad=False` is the first layer of a LoRA model without
    checkpointing: the frozen embedding's output needs no gradient, so its input norm saves nothing.
    `lora_input_cast` is peft's default fp32 cast of each adapter's input (see `model.apply_lora`).
    `scores_per_token` (heads x seq) is set for attention that materializes its scores (eager, SDPA's math
    kernel): each score is kept twice, as the fp32 softmax output and its bf16 copy. `head_dim` 0: hidden / heads;
    else q, k, v and the attention output are heads (kv heads) x head_dim wide."""
    T, H, I = tokens, hidden, intermediate
    q, kv = head_widths(H, heads, kv_heads, head_dim)
    full = method == "full"
    adapted = lora_modules(method, lora_targets)
    shapes = linear_shapes(H, heads, kv_heads, I, head_dim)
    # fp32 upcast (fused: the bf16 input) + rstd (+ bf16 normalized for the weight)
    norm = (2 if fused else 4) * T * H + 4 * T + (2 * T * H if full else 0)
    b = norm if input_needs_grad or full else 0  # input_layernorm
    b += norm  # post_attention_layernorm
    if full:
        b += 2 * T * H * 2  # the inputs of q/k/v (one shared tensor) and of gate/up
        b += 2 * T * I  # down_proj's input (o_proj's input is the SDPA output itself, stored (B, S, h, d))
    b += 2 * T * (q + 2 * kv) + 2 * T * q  # q, k, v after RoPE; the attention output
    b += 6 * T * scores_per_token if scores_per_token else 4 * T * heads  # the scores, or a fused kernel's logsumexp
    b += (2 if fused else 3) * 2 * T * I  # SwiGLU: gate (silu's input), up, and silu(gate) unless recomputed
    for name in adapted:
        fan_in, fan_out = shapes[name]
        b += 2 * T * lora_r + (0 if fused and recompute else 2 * lora_r * (fan_in + fan_out))  # x@A; A, B in bf16
        b += 2 * T * fan_in if lora_input_cast else 0  # the cast makes each adapter's input its own tensor
    if not lora_input_cast and not (fused and recompute):  # lora_A keeps its input: what no frozen layer kept
        b += 2 * T * H * (bool({"q_proj", "k_proj", "v_proj"} & set(adapted)) +  # the attention norm's output
                          bool({"gate_proj", "up_proj"} & set(adapted)))  # the MLP norm's output
        b += 2 * T * I * ("down_proj" in adapted)  # silu(gate) * up; o_proj's input is attention's saved output
    return b


def estimate_saved_activations(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                               vocab: int, seq: int, batch: int, method: str, lora_r: int = 16,
                               lora_targets: str = "all-linear", grad_ckpt: bool = False,
                               lora_input_cast: bool = True, loss: str = "plain", offload: bool = False,
                               stream_bytes: int = 2, scores_per_token: int = 0, head_dim: int = 0,
                               fused: bool = False, recompute: bool = False) -> dict:
    """Bytes held for backward on the GPU at the end of the forward pass: `layers` (decoder layers, or their
    saved inputs under checkpointing, none when offloaded), `rest` (embedding, final norm, LM head, RoPE
    tables, labels) and `log_softmax` (its fp32 output; the chunked loss keeps none), plus `total`.
    `stream_bytes` is the residual stream's dtype size (4 when peft's k-bit preparation upcast it);
    `scores_per_token`, `head_dim`, `fused` and `recompute` are as in `estimate_layer_activations`."""
    T = batch * seq
    full = method == "full"
    if grad_ckpt:
        per_layer = [0 if offload else stream_bytes * T * hidden] * layers  # each block's input
    else:
        per_layer = [estimate_layer_activations(hidden, heads, kv_heads, intermediate, T, method, lora_r,
                                                lora_targets, input_needs_grad=full or i > 0,
                                                lora_input_cast=lora_input_cast, scores_per_token=scores_per_token,
                                                head_dim=head_dim, fused=fused, recompute=recompute)
                     for i in range(layers)]
    rest = 4 * T * hidden + 4 * T  # final norm: fp32 upcast + rstd
    if full:
        rest += 2 * T * hidden * 2 + 8 * T  # bf16 normalized (for the norm weight), LM head input, token ids
    if not grad_ckpt:
        rest += 2 * 2 * seq * (head_dim or hidden // heads)  # RoPE cos and sin (bf16), shared by all layers
    plain = loss == "plain"
    rest += 8 * T if plain else 0  # the labels cross-entropy keeps
    out = {"layers": sum(per_layer), "rest": rest, "log_softmax": 4 * T * vocab if plain else 0}
    out["total"] = sum(out.values())
    return out
