"""Lesson 4's switches, each reversible and each with its correctness test (tests/unit/test_speedups.py).

- **TF32** (`tf32`): fp32 matrix multiplies on Ampere and later GPUs run on tensor cores with a 10-bit
  mantissa (`torch.set_float32_matmul_precision("high")`), and so may cuDNN's convolutions
  (`torch.backends.cudnn.allow_tf32`). It touches fp32 work only: under bf16 autocast the matmuls already
  run in bf16, so what is left to change is what stays fp32 (the fp32 LoRA adapters' own small matmuls,
  an fp32 run). The speed-up is measured in notebook 04, not assumed.
- **Compilation** (`compile_step`): `regional` compiles each decoder block (they share one compiled graph, so
  it compiles once), `model` the whole step (model and loss). Applied by `distributed.parallelize`, after
  checkpointing and before DDP/FSDP2 wrap the step, as torchtitan orders them.
- **Fused kernels** (`apply_liger`, loss `liger`): Liger's Triton RMSNorm, RoPE and SwiGLU, and its fused
  linear cross-entropy. GPU only.
- **FP8** (`apply_fp8`): torchao's float8 training (rowwise scaling) for the large linear layers, on GPUs with
  FP8 tensor cores (compute capability 8.9 and up). GPU only.
- **A frozen heap** (`frozen_heap`, `gc_freeze`): what the run built is kept out of Python's full garbage
  collections, which otherwise scan all of it every few dozen steps. CPU and GPU alike; no effect on the numbers.

The optimizers (AdamW, 8-bit, paged, Lion) are `tunekit/optim.py`; the fused LoRA linear `tunekit/fastlora.py`.
Each switch is a config field (`tf32`, `compile`, `kernels`, `loss`, `fp8`, `gc_freeze`), so `tunekit train` and
`tunekit bench` take it as a flag; `build.apply_techniques` applies them (`gc_freeze`: `train.train`, around its
loop).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import time

import torch

from tunekit import loss as loss_fn
from tunekit.model import base_model, decoder_layers
from tunekit.validation import COMPILE


@contextlib.contextmanager
def tf32(enabled: bool = True, device: str = "cuda"):
    """Inside, fp32 matmuls and cuDNN convolutions may use TF32 (`enabled`) or must not; the previous
    settings come back on exit, whatever happens inside. Off CUDA (`device`) there is no TF32: nothing is
    touched."""
    if device != "cuda":
        yield
        return
    old = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old[0])
        torch.backends.cudnn.allow_tf32 = old[1]


@contextlib.contextmanager
def frozen_heap(enabled: bool = True):
    """Inside, Python's cyclic garbage collector leaves alone every object alive on entry: they are collected
    once, then frozen (`gc.freeze`), so a full collection during the loop scans only what the loop made. A
    training process holds hundreds of thousands of tracked objects (modules, parameters, compiled graphs)
    that live as long as it does, and scanning them all is a pause of a step's order every few dozen steps.
    Yields `refreeze()`, which freezes what has been made since (call it after the first step, once compiling
    is done) and returns the seconds it took. Unfrozen on exit. Nothing is done where the process froze objects
    of its own already (their freeze is its business) or with `enabled` False: `refreeze()` then does nothing."""
    if not enabled or gc.get_freeze_count():
        yield lambda: 0.0
        return

    def refreeze() -> float:
        t = time.perf_counter()
        gc.collect()
        gc.freeze()
        return time.perf_counter() - t

    refreeze()
    try:
        yield refreeze
    finally:
        gc.unfreeze()


# ---- the optimizer builder ---------------------------------------------------------------------------------


# ---- compilation -----------------------------------------------------------------------------------------

# torch.compile's `mode` for the compiled step: None, its default. "reduce-overhead" captures each compiled graph
# in a CUDA graph, so a step launch-bound at batch 1 replays its kernels instead of launching each from Python
# (train_step then marks each step's start: `begin_step`). Set by the command line from TUNEKIT_COMPILE_MODE
# (`cli.apply_environment`); an experiment until timed on a GPU.
COMPILE_MODE: str | None = None
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's


def begin_step() -> None:
    """Tell CUDA graphs a new step begins, so the last one's outputs may be overwritten; nothing without them."""
    if COMPILE_MODE == "reduce-overhead":
        torch.compiler.cudagraph_mark_step_begin()


def compile_step(step_module: torch.nn.Module, model, mode: str, dynamic: bool | None = None,
                 recompute: bool = False) -> torch.nn.Module:
    """Compile the step for `mode` and return what to call:

    - `regional`: each decoder block's `forward` goes through `torch.compile` (inductor). The blocks run the
      same code on parameters of the same shapes, so one compiled graph serves them all (a second for the
      first block, whose input does not require grad under LoRA): seconds, not minutes. Hooks stay outside
      the compiled region — checkpointing's and FSDP2's — so the order checkpointing -> compile -> FSDP
      holds whatever wraps the blocks. The chunked loss's elementwise work (`loss._loss_and_grad`) is compiled
      too.
    - `model`: the whole step (decoder, LM head and loss) as one graph: more room to fuse, longer to compile.
      Not under FSDP2 (its per-block hooks would sit inside the graph): use `regional` there. With
      checkpointing this is what `torch.compile(model)` gives in a plain HF script (the article's checklist):
      transformers' input-grad hook breaks the graph at the embedding, the outer forward runs eagerly and the
      checkpointed blocks are compiled one graph for all (lesson 5's checklist: a first step of ~7 minutes on
      the H200 at 7B). Kept as the article's user has it.
    - `none`: eager, as written.

    Shapes: every new sequence length compiles again (`TORCH_LOGS=recompiles` shows each); packed rows are
    one width, padded batches are rounded up to a multiple of `PAD_MULTIPLE` tokens (`compile_pad_multiple`).
    `dynamic=True` compiles for every shape at once (torch.compile's own flag), for batches whose shape a
    trainer of someone else's varies.

    `recompute`: compile's partitioner, choosing what the forward keeps for the backward, keeps by default every
    value the backward would have to write out again (an input of a matmul: each RMSNorm's output and SwiGLU's,
    which the adapters' A read): with `recompute` it recomputes those from what it keeps anyway (less memory,
    more elementwise work). It is a process-wide setting of the partitioner, read when a graph compiles: set
    here at every call, so the last compiled step decides.
    """
    if mode not in COMPILE:
        raise ValueError(f"compile {mode!r}: choose one of {', '.join(COMPILE)}")
    import torch._functorch.config as partitioner

    if hasattr(partitioner, "ban_recompute_materialized_backward"):
        partitioner.ban_recompute_materialized_backward = not recompute
    elif recompute:
        raise RuntimeError(f"compile_recompute: this torch ({torch.__version__}) has no setting for what compile's "
                           "partitioner recomputes; upgrade torch or leave --compile-recompute off")
    if mode == "regional":
        for layer in decoder_layers(model):
            layer.forward = torch.compile(layer.forward, dynamic=dynamic, mode=COMPILE_MODE)
        loss_fn.compile_with(model)  # and the chunked loss's elementwise work, where the step uses it
    elif mode == "model":
        if _checkpointed(model) and hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
            # a block's forward sets a context variable (transformers' `kernels` hub layers do, where
            # installed): dynamo refuses that inside a checkpoint unless told recomputation may skip it
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        step_module.forward = torch.compile(step_module.forward, dynamic=dynamic, mode=COMPILE_MODE)
    return step_module


def _checkpointed(model) -> list[torch.nn.Module]:
    """The modules of `model` whose forward runs under activation checkpointing (transformers' flag)."""
    return [m for m in base_model(model).modules() if getattr(m, "gradient_checkpointing", False)]


PAD_MULTIPLE = 64


def compile_dynamic(mode: str, packing: str) -> bool | None:
    """torch.compile's `dynamic` for a step: True for the whole model on batches whose width changes from step to
    step (padded or length-grouped), so it is compiled once for every width. Left to itself, dynamo compiles the
    whole graph for the first width and again for the second (now dynamic), minutes each at 7B on a GPU (on an
    H200 the article's checklist's first step took about 8 minutes). None (torch's default) elsewhere: packed
    rows are one width, a benchmark's batches too (`packing` not resolved from data: `auto`), and a decoder
    block's graph is small."""
    return True if mode == "model" and packing in ("pad", "group") else None


def compile_pad_multiple(mode: str, packing: str) -> int:
    """Round a padded batch's width up to a multiple of this (0: its longest sample): a compiled step then sees
    max_length / 64 shapes at most instead of one per length. Packed rows are always `max_length` wide."""
    return PAD_MULTIPLE if mode != "none" and packing != "pack" else 0


# ---- fused kernels and FP8 ----------------------------------------------------------------------------------


def liger_available() -> str:
    """'' when Liger's kernels can run here, else why not."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel)"
    if not torch.cuda.is_available():
        return "Liger's kernels are Triton GPU kernels: no CUDA GPU here"
    return ""


def apply_liger(model) -> list[str]:
    """Swap in Liger's fused RMSNorm, RoPE and SwiGLU for this model's own (in place, `model` being a
    transformers model, before LoRA). Its fused linear cross-entropy is the `liger` loss. Returns what it
    swapped.

    Liger also replaces the norm and MLP classes in transformers' modeling module, which would give every
    model built later in this process its kernels: those are put back (this model's modules keep theirs).
    RoPE is a function the attention calls from that module, so Liger's stays for the process."""
    import sys

    if why := liger_available():
        raise RuntimeError(f"kernels=liger: {why}")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    module = sys.modules[type(model).__module__]
    classes = {k: v for k, v in vars(module).items() if isinstance(v, type)}
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    for k, v in classes.items():
        setattr(module, k, v)
    return [f"Liger {model.config.model_type}: RMSNorm, RoPE, SwiGLU"]


def liger_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
    """Liger's fused linear cross-entropy: the LM head and the loss in chunks, summed over target tokens, x
    `scale` (the `chunked` loss's contract, tunekit/loss.py)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    h = hidden.reshape(-1, hidden.shape[-1])
    return liger_fused_linear_cross_entropy(h, weight, labels.reshape(-1), ignore_index=-100,
                                            reduction="sum") * scale


def fp8_available() -> str:
    """'' when torchao's float8 training can run here, else why not."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao)"
    if not torch.cuda.is_available():
        return "float8 matmuls need a CUDA GPU"
    if torch.cuda.get_device_capability() < (8, 9):
        return f"float8 matmuls need compute capability 8.9+ (Ada, Hopper); this GPU is " \
               f"{'.'.join(map(str, torch.cuda.get_device_capability()))}"
    return ""


def fp8_linear_filter(module: torch.nn.Module, fqn: str) -> bool:
    """Which linear layers go to float8: the large ones (both dimensions multiples of 16, as the FP8 kernels
    need), not the LM head (its logits are the loss's input) and not the LoRA adapters (rank 16: too small to
    gain, and their gradients are what trains)."""
    if "lm_head" in fqn or "lora_" in fqn:
        return False
    return type(module) is torch.nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_fp8(model, recipe: str = "rowwise") -> int:
    """Convert the model's large linear layers to torchao's `Float8Linear` (`recipe`: rowwise scaling, one
    scale per row, or tensorwise): each matmul, forward and backward, runs in FP8 with dynamic scales; the
    weights stay bf16. Returns how many layers were converted. torchao's docs: it pays off under
    `torch.compile`, which fuses the casts and scalings."""
    if why := fp8_available():
        raise RuntimeError(f"fp8: {why}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=fp8_linear_filter)
    return sum(isinstance(m, Float8Linear) for m in model.modules())


# ---- convergence: each optimizer at its best learning rate, same data, same seed ----------------------------
