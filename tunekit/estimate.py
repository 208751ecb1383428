"""The peak-memory estimator: how much GPU memory a training step takes, before loading anything.

`estimate_memory` predicts the peak of one training step of a Llama-shaped model from its shape and the
config (method, checkpointing, loss, optimizer, offloads), counting the weights, adapters, optimizer states,
gradients, the activations autograd saves and the loss's logits; the shape is read from the model's config, a hub
model's or the one random init builds (`model.config_shape`: wide heads, a tied table and a family's extra block
weights count as built; the activations are Llama's). `estimate_max_batch` turns it into the largest micro-batch
that fits a GPU, `cannot_fit_message` into what to change when nothing does.

How it was checked: the activation model against the tensors autograd really saves on a tiny model, to the
byte; the whole peak against every published H200 step result (tests/unit/test_memory.py, both).

## The parts

`estimate_memory` predicts `torch.cuda.max_memory_allocated` of one training step of a Llama-shaped model
(tunekit's step: bf16 weights, bf16 autocast, SDPA, AdamW, the chunked or the plain loss), in bytes:

- weights: 2 bytes a parameter in bf16. QLoRA: NF4 is 4 bits a weight plus double-quantized constants
  (an 8-bit absmax per 64 weights and an fp32 one per 256 of those: ~0.127 bits), on the decoder's linear
  layers only; bitsandbytes leaves the embeddings, LM head and norms in bf16 (fp32 after peft's
  `prepare_model_for_kbit_training`; none of them with `embed_offload`).
- lora: the adapters, fp32 (peft's default): r * (in + out) per adapted linear.
- optimizer: AdamW keeps 2 states per trainable parameter *in the parameter's dtype* — fp32 for LoRA, bf16
  for full fine-tuning, since our loop trains bf16 weights directly (no fp32 master copy); 8-bit AdamW two
  bytes in all.
- gradients: one per trainable parameter, in its dtype.
- activations: what autograd saves for backward, counted tensor by tensor (`tunekit.activations`): op by
  op in PyTorch's own kernels, or fused, as a compiled step and Liger's kernels save them.
- logits: the plain loss peaks in the backward of log_softmax at 14 bytes per logit: the bf16 logits
  (micro_step holds them), the saved fp32 log_softmax output, the fp32 gradient from nll_loss and the fp32
  gradient log_softmax produces (B*S*V elements each). The chunked loss holds one chunk's logits (bf16,
  fp32 and the bf16 gradient: 8 bytes each) and the hidden states' gradient.
- overhead: cuBLAS workspaces, the bnb dequantization buffer and other transients the allocator sees;
  a 0.25 GB constant. The CUDA context (~0.5-1 GB on an H200) is outside `max_memory_allocated`; it is
  returned as `cuda_context` and added only in `device_total` (closer to what nvidia-smi shows, less
  allocator fragmentation: compare `peak_reserved_gb`).

The peak is the largest of three moments: the loss (all saved activations + the loss's own), the first
recomputed layer under checkpointing (saved inputs + one layer + gradients), and the end of backward (all
gradients; matters only for full fine-tuning). tests/unit/test_memory.py checks it against every published
bf16 step result in notebooks/results, eager, compiled, Liger and FP8, on every family measured: all within 15%,
most within 4%; full fine-tuning is the worst (+13%, an overestimate; compiled, 18-21% over and not checked),
checkpointed QLoRA steps are up to 11% under (Qwen2.5-7B's shape).

## Allocated is not reserved: what fits under a cap

A GPU's memory, or `memory.memory_cap`, limits what the caching allocator *reserves*: the blocks it holds
from the driver, allocated or cached, fragmentation included. The estimate is of what is *allocated*. The
published steps reserve 1.0-1.25x what they allocate (more at large batches and with big transient
tensors: 1.77x for the plain loss at batch 8), so "the estimate fits" is not "the step fits": under a
23 GB cap the estimate alone says micro-batch 19 for QLoRA at 2048 tokens; the H200 ran 14
(notebooks/results/l2_4090_fit.json). `estimate_max_batch` therefore fits `RESERVE_FACTOR` x the estimate
under the budget (see `reserve_factor_of` for how the factor is taken from the result files).
"""

from __future__ import annotations

import dataclasses
import functools

from tunekit import model as mdl
from tunekit.activations import (
    estimate_layer_activations,
    estimate_saved_activations,
    linear_shapes,
    lora_modules,
)
from tunekit.config import TuneConfig
from tunekit.distributed import choose_parallel
from tunekit.loss import chunk_tokens
from tunekit.optim import state_bytes_per_param
from tunekit.validation import OPTIMIZERS

# ---- the parts of the peak ----------------------------------------------------------------------------

NF4_BYTES = 0.5 + 0.127 / 8  # 4 bits a weight + double-quantized absmax constants (QLoRA paper, sec. 3)
OVERHEAD_BYTES = int(0.25e9)  # cuBLAS workspaces, bnb dequant buffer, small transients
CUDA_CONTEXT_BYTES = int(0.75e9)  # driver context + kernels; not in max_memory_allocated


def base_parameters(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                    head_dim: int = 0, tie_embeddings: bool = False, layer_extras: int = 0) -> tuple[int, int]:
    """(the decoder blocks' projection weights, everything else: embeddings, LM head unless tied, norms, the
    family's `layer_extras` a block). QLoRA quantizes the first; the second stays bf16."""
    linear = layers * sum(i * o for i, o in linear_shapes(hidden, heads, kv_heads, intermediate, head_dim).values())
    tables = 1 if tie_embeddings else 2  # a tied LM head is the embedding table itself
    return linear, tables * vocab * hidden + (2 * layers + 1) * hidden + layers * layer_extras


def estimate_memory(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                    seq: int, batch: int, method: str, lora_r: int = 16, lora_targets: str = "all-linear",
                    grad_ckpt: bool = False, weight_dtype_bytes: int = 2, optimizer: str = "adamw",
                    overhead_bytes: int = OVERHEAD_BYTES, loss: str = "chunked", lora_input_cast: bool = False,
                    offload: bool = False, kbit_prepare: bool = False, embed_offload: bool = False,
                    attention_scores: bool = False, world_size: int = 1, parallel: str = "ddp",
                    fsdp_reshard: bool = True, head_dim: int = 0, tie_embeddings: bool = False,
                    layer_extras: int = 0, fused: bool = False, fp8_weights: bool = False,
                    recompute: bool = False) -> dict:
    """Predict the peak GPU memory (bytes, as `torch.cuda.max_memory_allocated` reports it) of one training
    step of a Llama-shaped model with tunekit's loop, before loading anything. See the module docstring.

    On `world_size` GPUs (per GPU; `batch` is per GPU): DDP adds its gradient buckets (a second copy of the
    trainable gradients); FSDP2 divides weights, adapters, optimizer state and gradients by the world size and
    adds what is gathered at a time: two decoder blocks' weights (the one running and the one prefetched) and,
    for full fine-tuning, one block's fp32 gradients before their reduce-scatter; with `fsdp_reshard=False`
    every block's gathered weights stay from its forward to its backward.

    `head_dim` (0: hidden / heads), `tie_embeddings` (one table for the embeddings and the LM head) and
    `layer_extras` (a block's weights beyond its seven projections and two norms) are as the model's config has
    them (`model.config_shape`). `fused`: the activations a compiled step or Liger's kernels save
    (`tunekit.activations`); `recompute`, what it keeps when it recomputes the matmuls' elementwise inputs (config
    `compile_recompute`). `fp8_weights`: the fused LoRA's FP8 base weights (`fastlora.attach(fp8=True)`), two
    copies of a byte a weight beside the bf16 ones.

    Returns the named parts, `total` (the predicted peak), `peak_at` (which moment of the step it is),
    `cuda_context` and `device_total` (= total + cuda_context)."""
    if method not in ("full", "lora", "qlora"):
        raise ValueError(f"method: {method!r}; use 'full', 'lora' or 'qlora'")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: {optimizer!r}; use one of {', '.join(OPTIMIZERS)} (validation.OPTIMIZERS)")
    if loss not in ("chunked", "plain"):
        raise ValueError(f"loss: {loss!r}; use 'chunked' or 'plain'")
    T = batch * seq
    shapes = linear_shapes(hidden, heads, kv_heads, intermediate, head_dim)
    linear, other = base_parameters(hidden, layers, heads, kv_heads, intermediate, vocab, head_dim, tie_embeddings,
                                    layer_extras)
    tables = 1 if tie_embeddings else 2  # the embedding table and the LM head, or the one tied table
    adapted = lora_modules(method, lora_targets)
    lora = layers * sum(lora_r * sum(shapes[n]) for n in adapted)
    # peft's k-bit preparation upcasts QLoRA's non-4-bit weights, and with them the residual stream, to fp32
    other_bytes = 4 if kbit_prepare and method == "qlora" else 2
    if method == "qlora":
        weights = int(linear * NF4_BYTES) + other_bytes * other
    else:
        weights = weight_dtype_bytes * (linear + other)
    if fp8_weights:  # per output row for the forward, per input column for the input gradient
        weights += 2 * layers * sum(shapes[n][0] * shapes[n][1] for n in adapted)
    # a tied table stays on the GPU as the LM head (memory.offload_embeddings moves a copy for the lookup only)
    embed_offload = embed_offload and method != "full" and not tie_embeddings
    if embed_offload:  # the input table and the LM head live in CPU memory
        weights -= 2 * other_bytes * vocab * hidden
    trainable, train_bytes = (linear + other, weight_dtype_bytes) if method == "full" else (lora, 4)
    # (8-bit block scales, 1.6%, left out.) Paged states live in CUDA unified memory, outside PyTorch's
    # allocator: they use the GPU while it has room and move to the CPU under pressure, so none count here.
    states = 0 if optimizer.startswith("paged_") else state_bytes_per_param(optimizer, train_bytes)
    parts = {
        "weights": weights,
        "lora": 4 * lora,
        "optimizer": states * trainable,
        "gradients": train_bytes * trainable,
    }
    scores = heads * seq if attention_scores else 0
    saved = estimate_saved_activations(hidden, layers, heads, kv_heads, intermediate, vocab, seq, batch,
                                       method, lora_r, lora_targets, grad_ckpt, lora_input_cast, loss, offload,
                                       stream_bytes=other_bytes, scores_per_token=scores, head_dim=head_dim,
                                       fused=fused, recompute=recompute)
    parts["activations"] = saved["layers"] + saved["rest"]
    # the block backward recomputes keeps what an eager one saves, compiled or not (on the H200 a checkpointed
    # QLoRA step peaks higher compiled than eager: 12.69 against 12.36 GB)
    parts["recompute"] = (estimate_layer_activations(hidden, heads, kv_heads, intermediate, T, method, lora_r,
                                                     lora_targets, lora_input_cast=lora_input_cast,
                                                     scores_per_token=scores, head_dim=head_dim)
                          + (2 * T * hidden if offload else 0)  # the block input, back from the CPU
                          + 8 * T * scores  # materialized scores' backward: fp32 gradient in and out
                          if grad_ckpt else 0)
    if loss == "plain":  # log_softmax backward: bf16 logits + saved fp32 output + fp32 grad in + fp32 grad out
        parts["logits"] = (2 + 4 + 4 + 4) * T * vocab
    else:  # one chunk: bf16 logits + their fp32 upcast + the bf16 gradient; the hidden states' gradient
        chunk = min(T, chunk_tokens(vocab))
        parts["logits"] = (2 + 4 + 2) * chunk * vocab + 2 * T * hidden
        if embed_offload:  # the head's bf16 copy, on the GPU for the loss only
            parts["logits"] += 2 * vocab * hidden
        if method == "full":  # the LM head's gradient, summed in fp32, and one chunk's bf16 share of it
            parts["logits"] += (4 + 2) * vocab * hidden
    parts["overhead"] = overhead_bytes
    parts["parallel"] = 0
    if world_size > 1 and parallel == "fsdp":
        for k in ("weights", "lora", "optimizer", "gradients"):
            parts[k] //= world_size
        block = (weights - tables * other_bytes * vocab * hidden) // layers  # one decoder block's stored weights
        gathered = 2 * block if fsdp_reshard else layers * block
        parts["parallel"] = gathered + (4 * linear // layers if method == "full" else 0)
    elif world_size > 1:  # DDP: the buckets the gradients are all-reduced from
        parts["parallel"] = parts["gradients"]
    static = parts["weights"] + parts["lora"] + parts["optimizer"] + parts["overhead"] + parts["parallel"]
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


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a step's memory depends on, in TuneConfig's field names: the model's shape, the micro-batch, the
    method and the options that change memory, and the GPUs of a torchrun launch. `Setup.of(cfg)` takes them
    from a config (or a result file's config dict); a misspelled name is an error, never dropped."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    max_length: int
    batch_size: int
    method: str
    num_kv_heads: int = 0
    lora_r: int = 16
    lora_targets: str = "all-linear"
    grad_ckpt: bool = False
    loss: str = "chunked"
    lora_input_cast: bool = False
    grad_ckpt_offload: bool = False
    optimizer: str = "adamw"
    peft_kbit_prepare: bool = False
    embed_offload: bool = False
    attention: str = "auto"
    sdpa_backend: str = "auto"
    world_size: int = 1
    parallel: str = "auto"
    fsdp_reshard: bool = True
    dtype: str = "auto"
    head_dim: int = 0
    tie_embeddings: bool = False
    compile: str = "none"
    compile_recompute: bool = False
    kernels: str = "none"
    fp8: bool = False
    fast_lora: bool = False
    layer_extras: int = 0  # from the model's config (`model.config_shape`), not a TuneConfig field

    @classmethod
    def of(cls, cfg, world_size: int = 1, **changes) -> Setup:
        """The setup of a `TuneConfig` or of a config dict (a result file's): its fields of these names, on
        `world_size` GPUs, with `changes`. The shape is read from a model config either way: with `model` set, that
        model's (`model_shape`), not the config's shape fields; else the one random init builds of them (as
        `build.run_arch`; a field a result file's config lacks is TuneConfig's default: no `arch`, a Llama), its
        `vocab_size` kept (0: the tokenizer's, unknown before loading)."""
        source = cfg if isinstance(cfg, dict) else dataclasses.asdict(cfg)
        names = {f.name for f in dataclasses.fields(cls)} - {"world_size", "layer_extras"}
        if source.get("model"):
            shape = model_shape(source["model"], bool(source.get("trust_remote_code")))
        else:
            f = {n: source.get(n, d.default) for n, d in TuneConfig.__dataclass_fields__.items()}
            config = mdl.family_config(f["arch"], f["hidden_size"], f["num_layers"], f["num_heads"],
                                       f["intermediate_size"], f["vocab_size"] or 1, f["num_kv_heads"], f["head_dim"],
                                       f["tie_embeddings"])
            shape = {**mdl.config_shape(config, f"a random-init {f['arch']} model"), "vocab_size": f["vocab_size"]}
        return cls(**{**{n: source[n] for n in names if n in source}, **shape, "world_size": world_size,
                      **changes})

    def but(self, **changes) -> Setup:
        """This setup with `changes` (`setup.but(batch_size=1)`)."""
        return dataclasses.replace(self, **changes)


def estimate_memory_for(setup: Setup | None = None, /, *args, **fields) -> dict:
    """`estimate_memory` of a `Setup` (`estimate_memory_for(Setup.of(cfg))`), or of a setup given by its fields
    (`estimate_memory_for(4096, 32, 32, 11008, 32000, 2048, 4, "lora", grad_ckpt=True)`), with `fields` changed.
    `vocab_size` must be set: a tokenizer's size is unknown before loading. `world_size`: the GPUs of a torchrun
    launch (`parallel` auto resolves as training does). The estimate is of a GPU step in bf16 (or fp16): an fp32
    one is refused, not guessed."""
    if isinstance(setup, Setup):
        s = setup.but(**fields) if fields else setup
    else:
        s = Setup(*((setup, *args) if setup is not None else args), **fields)
    if not s.vocab_size:
        raise ValueError("vocab_size is 0 (the tokenizer's size); pass the vocabulary size explicitly")
    if s.dtype == "fp32":
        raise ValueError("dtype fp32: the estimator models bf16/fp16 steps (weights and activations of 2 bytes); "
                         "measure an fp32 step with `tunekit bench` instead")
    return estimate_memory(s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads or s.num_heads, s.intermediate_size,
                           s.vocab_size, s.max_length, s.batch_size, s.method, s.lora_r, s.lora_targets, s.grad_ckpt,
                           optimizer=s.optimizer,
                           loss="chunked" if s.loss == "liger" else s.loss,  # Liger's fused loss: in chunks too
                           lora_input_cast=s.lora_input_cast,
                           offload=s.grad_ckpt_offload, kbit_prepare=s.peft_kbit_prepare,
                           embed_offload=s.embed_offload,
                           attention_scores=s.attention == "eager" or s.sdpa_backend.split(",")[0].strip() == "math",
                           world_size=s.world_size, parallel=choose_parallel(s.parallel, s.method),
                           fsdp_reshard=s.fsdp_reshard, head_dim=s.head_dim, tie_embeddings=s.tie_embeddings,
                           layer_extras=s.layer_extras, fused=s.compile != "none" or s.kernels == "liger",
                           fp8_weights=s.fp8 and s.fast_lora and s.method != "qlora",  # 4-bit: read at each use
                           recompute=s.compile_recompute and s.compile != "none")


def parameter_count(setup: Setup) -> int:
    """The base model's parameters, as `estimate_memory` counts its weights (`base_parameters`)."""
    s = setup
    return sum(base_parameters(s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads or s.num_heads,
                               s.intermediate_size, s.vocab_size, s.head_dim, s.tie_embeddings, s.layer_extras))


def format_estimate(est: dict) -> str:
    """One line: the parts in GB and the predicted peak."""
    keys = ("weights", "lora", "optimizer", "gradients", "parallel", "activations", "recompute", "logits", "overhead")
    body = ", ".join(f"{k} {est[k] / 1e9:.2f}" for k in keys if est[k])
    return f"{body} -> peak {est['total'] / 1e9:.2f} GB at {est['peak_at']}"



@functools.cache
def model_shape(name_or_path: str, trust_remote_code: bool = False) -> dict:
    """The `Setup` shape fields of a model (a local folder's config.json, or the hub's config), as `config_shape`
    reads them. A config that cannot be read is an error: the estimate is never of another shape than the
    model's."""
    from transformers import AutoConfig

    from tunekit.hub import load_pretrained

    try:
        config = load_pretrained(AutoConfig, name_or_path, "model", trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"estimating {name_or_path!r}: its config is unreadable ({e}); the estimate needs the "
                         "model's shape (a local folder with config.json, or a reachable hub)") from None
    return mdl.config_shape(config, repr(name_or_path))
