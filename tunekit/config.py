"""One typed config for every run: every field with its doc, checked as a whole (`validate`: the choices and
rules are `tunekit/validation.py`'s).

Only the builders (`build`, `prepare`) and the entry points (`train`, `bench`, `export`, `cli`) take a
`TuneConfig`; everything below them takes plain arguments, so a notebook can call any piece alone. Presets and
command-line overrides are `tunekit/presets.py`. The resolved config is saved beside every run's outputs
(`save_config`), so a result can always be traced back to the settings that produced it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tunekit.io import REPO_ROOT, atomic_write_text  # noqa: F401  (config.REPO_ROOT: the checkout, as before)
from tunekit.validation import ConfigError, check, types_of


@dataclass
class TuneConfig:
    # ---- run -------------------------------------------------------------------------------------
    preset: str = "tiny"
    """Name of the preset this config started from (recorded in results; not a switch)."""
    out_dir: str = ""
    """Where checkpoints, metrics and the resolved config go. Empty: `runs/<preset>`."""
    seed: int = 0
    """Seeds model init, LoRA init, data order and dropout, so two runs with one seed match."""
    device: str = "auto"
    """`auto` (CUDA when present, else CPU), `cpu` or `cuda`."""
    cpu_threads: int = 0
    """PyTorch CPU threads when training on the CPU. 0 (auto): $OMP_NUM_THREADS if set, else 1 for small
    models (hidden size <= 1024), whose operations are too short to gain from threads and which slowed
    several-fold with PyTorch's default on a busy 2-core machine; larger models keep PyTorch's default."""

    # ---- model -----------------------------------------------------------------------------------
    model: str = ""
    """Hub name or local path of a causal LM. Empty: build a random-init model of `arch` from the arch fields."""
    arch: str = "llama"
    """Arch (random init only): the family, as transformers names it (llama, mistral, qwen2, qwen3, gemma2, phi3;
    gemma3: its text model). What a family fixes (Gemma 2's soft-capping) is its real model's: model.FAMILY_EXTRAS."""
    hidden_size: int = 128
    """Arch (random init only): model width."""
    num_layers: int = 4
    """Arch (random init only): decoder blocks."""
    num_heads: int = 4
    """Arch (random init only): attention heads."""
    num_kv_heads: int = 0
    """Arch (random init only): key/value heads for GQA. 0 means equal to `num_heads`."""
    head_dim: int = 0
    """Arch (random init only): attention head width. 0 means hidden_size / num_heads (Gemma-2-9B's is 256, not 224)."""
    intermediate_size: int = 352
    """Arch (random init only): MLP width."""
    vocab_size: int = 0
    """Arch (random init only): embedding rows. 0 means the tokenizer's vocabulary size."""
    tie_embeddings: bool = False
    """Arch (random init only): the LM head is the input embedding table, as in Gemma (false: two tables)."""
    tokenizer: str = ""
    """Hub name or local path of a tokenizer. Empty: `model`'s, or (random init) a byte-level BPE trained offline."""
    tokenizer_vocab: int = 1024
    """Vocabulary size of the offline-trained BPE tokenizer (when `tokenizer` and `model` are empty)."""
    trust_remote_code: bool = False
    """Run the Python code a model or tokenizer brings with it (named in its config's `auto_map`), as
    transformers' `trust_remote_code=True` does. Off, such a model is refused with a one-line error: nothing
    from a downloaded folder runs unless this is set (read the code first)."""
    method: str = "lora"
    """`full` (every weight trains), `lora` (bf16/fp32 base + adapters) or `qlora` (4-bit NF4 base)."""
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: int = 32
    """LoRA scale numerator: the update is scaled by alpha / r."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input. 0 keeps the step deterministic and lets peft skip a copy."""
    lora_targets: str = "all-linear"
    """Modules that get adapters: `all-linear` or a comma-separated list such as `q_proj,v_proj`."""
    dtype: str = "auto"
    """Weights and compute: `auto` is bf16 on a GPU that supports it, fp32 on CPU."""
    attention: str = "auto"
    """Attention kernel: `auto`, `sdpa`, `eager`, `flash_attention_2` or `flex_attention`."""
    sdpa_backend: str = "auto"
    """SDPA kernels in priority order: `auto` (cuDNN first on Hopper GPUs, else PyTorch's order), one of
    `cudnn`, `flash`, `efficient`, `math`, or a comma-separated list such as `cudnn,flash`."""
    grad_ckpt: bool = False
    """Gradient checkpointing: recompute activations in backward. Most activation memory, for ~1/3 more compute."""
    grad_ckpt_offload: bool = False
    """With `grad_ckpt`: keep each block's saved input in pinned CPU memory instead of on the GPU
    (layers x tokens x hidden x 2 bytes freed, for a copy each way)."""
    embed_offload: bool = False
    """LoRA/QLoRA: keep the frozen input-embedding table and LM head in CPU memory: tokens are looked up
    there, and the head comes to the GPU for the loss only (frees 0.52 GB for Llama-2-7B)."""
    lora_input_cast: bool = False
    """peft's default: cast each LoRA input to the fp32 adapter dtype. Under autocast it is cast straight
    back to bf16, so the numbers are the same, but each adapted linear then saves its own bf16 copy of its
    input (8 bytes a token per hidden unit per layer). Off: the copies are skipped."""
    peft_kbit_prepare: bool = False
    """QLoRA only: call peft's `prepare_model_for_kbit_training`, as peft's guides do. It upcasts every
    weight that is not 4-bit (embeddings, LM head, norms) to fp32. Off: tunekit keeps them bf16."""

    # ---- data ------------------------------------------------------------------------------------
    data: str = "data/arith/train.jsonl"
    """Training data: a JSONL/JSON/parquet/text file, a `save_to_disk` folder, or a hub dataset name."""
    fields: str = ""
    """Which of the data's fields play which part, as LAYOUT_FIELD=YOUR_FIELD pairs naming one whole layout:
    `prompt=question,response=answer`, `instruction=task,input=context,output=solution`, `messages=conversations`,
    `text=content`, `instruction=definition,instances=examples`. Empty: detected from the field names. The
    layouts are listed in the README, "Your own data"."""
    response_template: str = ""
    """Single-text records (`text`): train only on what follows this marker, e.g. `### Assistant:`; the text up
    to and including it is masked, as TRL's completion-only collator does (the last marker, unless
    `instruction_template` is set). A record without the marker is an error that names it."""
    instruction_template: str = ""
    """With `response_template`, for multi-turn texts: the marker that starts a user turn, e.g. `### Human:`.
    Each span from a response marker to the next instruction marker is trained."""
    chat_template: str = "auto"
    """How `messages` records are rendered: `auto` (the tokenizer's chat template if it has one, else tunekit's
    built-in `<|role|>` one), `builtin`, `tokenizer` (its template, or an error), `chatml`, or a Jinja
    template file."""
    max_length: int = 256
    """Tokens per sample; longer samples are truncated (and counted)."""
    packing: str = "auto"
    """How samples become batches of `batch_size` rows: `pack` (concatenate samples into rows of `max_length`;
    each attends only to itself, through position_ids: no padding at all), `group` (batches of similar length,
    little padding), `pad` (shuffle, pad to the batch's longest) or `auto`: `pack` when the samples are short
    against `max_length` (their mean at most half of it), else `group`. What `auto` chose is printed and
    recorded in the run's config.json. A step then holds as many samples as fit, not `batch_size`: every
    metrics row counts the samples and real tokens seen so far."""
    tokenize: str = "offline"
    """`offline`: tokenize the whole dataset once before training, into the run folder (reused by later runs).
    `in_loop`: tokenize each sample as the DataLoader reads it, every epoch — the article's "before", kept
    to measure it (lesson 1, claim C1; lesson 5's "before" run). Padded batches only (packing and grouping
    need every length first)."""
    num_workers: int = 0
    """DataLoader worker processes. 0 collates in the training process."""
    pin_memory: bool = True
    """Page-locked host batches (used only when CUDA is present): faster, asynchronous host-to-GPU copies."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead (only with `num_workers` > 0)."""
    persistent_workers: bool = True
    """Keep workers alive between epochs instead of restarting them (only with `num_workers` > 0)."""

    # ---- several GPUs (under torchrun) --------------------------------------------------------------
    parallel: str = "auto"
    """How a run launched on several processes (`torchrun --nproc_per_node N -m tunekit.cli train ...`) splits
    the work: `ddp` (each GPU holds the model; gradients are all-reduced), `fsdp` (FSDP2: weights, gradients
    and optimizer state sharded across GPUs) or `auto` (fsdp for full fine-tuning, ddp for LoRA and QLoRA).
    Ignored in a single process. See tunekit/distributed.py."""
    fsdp_reshard: bool = True
    """FSDP2: free each decoder block's gathered weights after its forward and gather them again for its
    backward (least memory), or keep them until backward (false: one all-gather per block a step instead of
    two, for one block's full weights held per layer)."""

    # ---- optimisation ----------------------------------------------------------------------------
    loss: str = "chunked"
    """`chunked`: LM head and cross-entropy fused, 1k tokens at a time, never holding the logits (see
    tunekit/loss.py). `plain`: `model(...).logits` then `F.cross_entropy`, the reference. `liger`: Liger's
    fused linear cross-entropy (Triton; GPU only)."""
    optimizer: str = "adamw"
    """`adamw` (states in the parameter's dtype: fp32 for fp32 adapters; fused kernel on CUDA), `adamw_foreach`
    (torch's multi-tensor kernels), `adamw8bit` (bitsandbytes block-wise 8-bit states: 2 bytes a parameter
    instead of 8; CUDA only), `paged_adamw` / `paged_adamw8bit` (bitsandbytes, states in CUDA unified memory
    that pages to the CPU under memory pressure), `lion` (tunekit's: one state a parameter; give it about a
    tenth of AdamW's --lr and ten times its --weight-decay: speedups.lion_settings), `lion_pytorch` (the
    lion-pytorch package's) or `lion8bit` (bitsandbytes). Lesson 4 measures them."""
    batch_size: int = 16
    """Micro-batch: samples per forward/backward."""
    grad_accum: int = 1
    """Micro-batches per optimizer step. Global batch = batch_size * grad_accum (* world size)."""
    global_batch: int = 0
    """Rows per optimizer step over all GPUs; 0: batch_size x grad_accum x GPUs. When set, `grad_accum` is
    computed from it at start (global_batch / (batch_size x GPUs), which must be whole), so one config keeps
    its optimizer step on 1, 2 or 8 GPUs."""
    lr: float = 3e-3
    """Peak learning rate, reached after `warmup_steps` and decayed along a cosine to `min_lr_ratio`."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of `lr`."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    max_steps: int = 150
    """Optimizer steps to run (the cosine schedule spans them). Ignored when `epochs` is set."""
    epochs: float = 0.0
    """When above 0, the run length in passes over the data (1.5 is allowed): `max_steps` is computed from the
    prepared data (rows, or packed rows, per optimizer step) and recorded in the run's config.json."""

    # ---- speed-ups (lesson 4: tunekit/speedups.py) ------------------------------------------------
    tf32: bool = True
    """Let fp32 matmuls and convolutions use TF32 tensor cores on Ampere and later GPUs (10-bit mantissa).
    Under bf16 autocast only what stays fp32 is touched. No effect on CPU."""
    compile: str = "none"
    """`torch.compile`: `regional` (each decoder block; they share one compiled graph, so it compiles in
    seconds), `model` (the whole step, model and loss: longer to compile; not under FSDP2) or `none`. Padded
    batches are rounded up to a multiple of 64 tokens when compiling, so a run sees few shapes."""
    compile_recompute: bool = False
    """With --compile: recompute in the backward the elementwise outputs a matmul reads there (each RMSNorm's
    output and SwiGLU's, the inputs of the adapters' A) instead of keeping them from the forward (compile's
    partitioner, told not to keep what it would have to materialize again anyway: `speedups.compile_step`). On
    an H100 the 7B LoRA step at batch 4 without checkpointing kept 9.9 GB less for 2.2% of its speed
    (s31_lora_group_b4_recompute), the QLoRA + FP8 one 9.7 GB less for about 1%."""
    kernels: str = "none"
    """`liger`: Liger's fused Triton kernels for RMSNorm, RoPE and SwiGLU (GPU only; pair with --loss liger
    for its fused linear cross-entropy). `none`: the model's own."""
    gc_freeze: bool = True
    """Freeze what the run built out of Python's full garbage collections (tunekit/speedups.py `frozen_heap`)."""
    fp8: bool = False
    """torchao float8 training (rowwise scales) for the large linear layers: FP8 tensor-core matmuls on
    Hopper/Ada GPUs, weights kept bf16. Pays off with --compile (the casts fuse); GPU only. With --fast-lora,
    tunekit's own FP8 instead: each frozen base weight quantized once, not every step; with --method qlora
    (which takes FP8 only with --fast-lora) the 4-bit codes read into FP8 at each use, nothing more stored."""
    fast_lora: bool = False
    """LoRA and QLoRA: each adapted linear layer as one autograd function (tunekit/fastlora.py) instead of
    peft's four modules — the frozen weight's gradient never formed; with --fp8 the frozen weights are quantized
    to FP8 once (QLoRA's 4-bit weights: read into FP8 at each use, tunekit/nf4.py). Same parameters and saved
    adapter as peft's."""
    fast_lora_group: bool = True
    """With --fast-lora: the layers that read one input (q/k/v, gate/up) as one matmul over their concatenated
    weights, each way (never under FSDP2, whose sharding would split the concatenated weight; 4-bit layers stay
    apart). On by default since v got storage of its own (fastlora.KEPT_APART): on an H100 the 7B bf16 step ran
    17,625 tok/s grouped against 17,095 (each ±1.4%) at 49.5 GB either way (s35_lora_group_b4, s35_lora_fast_b4,
    one machine), and the grouped FP8 step held 62.4 GB instead of 66.7 (s34_lora_fp8_b4, s31_lora_fp8_b4).
    Before that, v as a view kept the whole q/k/v output alive (+4.3 GB on the H200, s14_lora_group*)."""

    # ---- held-out loss ------------------------------------------------------------------------------
    eval_split: float = 0.0
    """Hold out this fraction of the prepared rows (samples, or packed rows), chosen by `seed`, and report
    the mean token loss on them: every `eval_every` steps and at the end, in the metrics rows (`eval_loss`)
    and summary.json. 0: train on everything, no held-out loss."""
    eval_data: str = ""
    """A held-out dataset (file or name, e.g. `gsm8k-test`), tokenized like `data`, for the same held-out loss;
    instead of `eval_split`."""
    eval_every: int = 0
    """Steps between held-out evaluations (0: at the end only; -1: after each epoch, with `epochs`). Needs
    `eval_split` or `eval_data`."""

    # ---- logging and checkpoints -----------------------------------------------------------------
    log_every: int = 1
    """Write a metrics row every this many steps."""
    save_every: int = 0
    """Checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Checkpoints kept in the run folder: the newest this many; older ones are deleted as new ones are
    written. Keep at least 2 so a resume can fall back when the newest turns out to be damaged."""

    # ---- benchmark -------------------------------------------------------------------------------
    bench_warmup: int = 3
    """Steps run before timing starts (allocator, kernels and autotuning settle)."""
    bench_steps: int = 5
    """Timed steps at least; the median step time is reported."""
    bench_max_steps: int = 40
    """Timed steps at most: past `bench_steps`, timing goes on while the median's relative standard error
    is above `bench_target_error` (a launch-bound batch-1 step scatters far more than a large one)."""
    bench_target_error: float = 0.01
    """Stop timing once the median step time is known to this relative standard error (0: time exactly
    `bench_steps`)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check(self)

    # ---- derived values ------------------------------------------------------------------------------
    def run_dir(self) -> Path:
        return Path(self.out_dir or f"runs/{self.preset}")

    def tokens_per_step(self, world_size: int = 1) -> int:
        """Token slots (padding included) per optimizer step."""
        return self.batch_size * self.grad_accum * self.max_length * world_size


# Fields a resumed run may change (`tunekit train --resume --allow-config-change`): none touches the weights, the
# data order or the optimizer state. A new `max_steps` recomputes the cosine schedule for the new length (as a
# new `epochs` does), so the learning rate jumps at the resumed step; training reads no benchmark field.
RESUME_SAFE_FIELDS = ("max_steps", "epochs", "save_every", "log_every", "keep_checkpoints", "num_workers", "pin_memory",
                      "compile", "compile_recompute", "tf32", "gc_freeze", "eval_every", "prefetch_factor",
                      "persistent_workers", "cpu_threads", "bench_warmup", "bench_steps", "bench_max_steps",
                      "bench_target_error")

@functools.cache
def field_types() -> dict[str, type]:
    return types_of(TuneConfig)


def config_dict(cfg: TuneConfig) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: TuneConfig, path: str | os.PathLike) -> None:
    atomic_write_text(path, json.dumps(config_dict(cfg), indent=2) + "\n")


def load_config(path: str | os.PathLike) -> TuneConfig:
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config file there") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a JSON object of config fields")
    if unknown := set(raw) - set(field_types()):
        raise ConfigError(f"{path}: unknown config fields {sorted(unknown)}")
    try:  # each value's type is checked by the config itself
        return TuneConfig(**raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


__all__ = ["RESUME_SAFE_FIELDS", "ConfigError", "TuneConfig", "config_dict", "field_types", "load_config", "save_config"]
