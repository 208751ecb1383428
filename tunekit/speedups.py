"""Lesson 4's switches, each reversible and each with its correctness test (tests/test_speedups.py).

- **TF32** (`tf32`): fp32 matrix multiplies on Ampere and later GPUs run on tensor cores with a 10-bit
  mantissa (`torch.set_float32_matmul_precision("high")`), and so may cuDNN's convolutions
  (`torch.backends.cudnn.allow_tf32`). It touches fp32 work only: under bf16 autocast the matmuls already
  run in bf16, so what is left to change is what stays fp32 (the fp32 LoRA adapters' own small matmuls,
  an fp32 run). The speed-up is measured in notebook 04, not assumed.
- **Lion** (`Lion`): the optimizer of Chen et al. 2023 (https://arxiv.org/abs/2302.06675, Algorithm 2). Its
  update is the sign of an interpolation between the momentum and the gradient, so each parameter moves by
  exactly the learning rate; it keeps one state a parameter (AdamW keeps two). The paper's rule for its
  settings: a learning rate 3-10x smaller than AdamW's and a weight decay 3-10x larger (`lion_settings`).
- **Optimizers** (`build_optimizer`, `OPTIMIZER_NOTES`): torch's AdamW (fused or foreach), bitsandbytes' 8-bit
  and paged AdamW and 8-bit Lion, tunekit's Lion and lion-pytorch's.
- **Compilation** (`compile_step`): `regional` compiles each decoder block (they share one compiled graph, so
  it compiles once), `model` the whole step (model and loss). Applied by `distributed.parallelize`, after
  checkpointing and before DDP/FSDP2 wrap the step, as torchtitan orders them.
- **Fused kernels** (`apply_liger`, loss `liger`): Liger's Triton RMSNorm, RoPE and SwiGLU, and its fused
  linear cross-entropy. GPU only.
- **FP8** (`apply_fp8`): torchao's float8 training (rowwise scaling) for the large linear layers, on GPUs with
  FP8 tensor cores (compute capability 8.9 and up). GPU only.

Each switch is a config field (`tf32`, `optimizer`, `compile`, `kernels`, `loss`, `fp8`), so `tunekit train` and
`tunekit bench` take it as a flag.
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch


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


class Lion(torch.optim.Optimizer):
    """Lion: `w -= lr * (sign(b1 * m + (1 - b1) * g) + weight_decay * w)`, then `m = b2 * m + (1 - b2) * g`.
    One state tensor a parameter, in the parameter's dtype."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr <= 0 or not all(0 <= b < 1 for b in betas) or weight_decay < 0:
            raise ValueError(f"Lion: lr {lr} must be positive, betas {betas} in [0, 1), weight_decay {weight_decay} >= 0")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            for p in params:
                if not self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
            moms = [self.state[p]["exp_avg"] for p in params]
            # The same arithmetic as one tensor at a time, in a few multi-tensor kernels (one launch per op
            # for all parameters: LoRA has hundreds of small ones).
            torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])  # decoupled decay, as AdamW's
            update = torch._foreach_mul(moms, b1)
            torch._foreach_add_(update, grads, alpha=1 - b1)
            torch._foreach_sign_(update)
            torch._foreach_add_(params, update, alpha=-group["lr"])
            torch._foreach_mul_(moms, b2)
            torch._foreach_add_(moms, grads, alpha=1 - b2)
        return loss


def lion_settings(adamw_lr: float, adamw_weight_decay: float, factor: float = 10.0) -> dict:
    """Lion's learning rate and weight decay from AdamW's, by the paper's rule: the rate `factor` times
    smaller and the decay `factor` times larger (their product, the decay per step, stays the same)."""
    return {"lr": adamw_lr / factor, "weight_decay": adamw_weight_decay * factor}


# ---- the optimizer builder ---------------------------------------------------------------------------------

# name: (what it is, optimizer state in bytes per trainable parameter as a function of the parameter's bytes)
OPTIMIZER_NOTES = {
    "adamw": ("torch AdamW, fused into one kernel on CUDA (foreach on CPU)", lambda b: 2 * b),
    "adamw_foreach": ("torch AdamW, multi-tensor (foreach) kernels", lambda b: 2 * b),
    "adamw8bit": ("bitsandbytes AdamW8bit: both states block-wise quantized to 8 bits", lambda b: 2),
    "paged_adamw": ("bitsandbytes PagedAdamW: 32-bit states in CUDA unified memory, paged out under pressure",
                    lambda b: 8),
    "paged_adamw8bit": ("bitsandbytes PagedAdamW8bit: 8-bit states, paged", lambda b: 2),
    "lion": ("tunekit's Lion (speedups.Lion, foreach kernels): one state in the parameter's dtype", lambda b: b),
    "lion_pytorch": ("lion-pytorch's Lion (its Triton update on CUDA): one state", lambda b: b),
    "lion8bit": ("bitsandbytes Lion8bit: one state, 8 bits", lambda b: 1),
}
BNB_OPTIMIZERS = {"adamw8bit": "AdamW8bit", "paged_adamw": "PagedAdamW", "paged_adamw8bit": "PagedAdamW8bit",
                  "lion8bit": "Lion8bit"}


def state_bytes_per_param(name: str, param_bytes: int) -> int:
    """Optimizer state bytes per trainable parameter (the estimator's formula; 8-bit block scales, ~0.1%,
    left out)."""
    return OPTIMIZER_NOTES[name][1](param_bytes)


def build_optimizer(model, lr: float, weight_decay: float, device: str, name: str = "adamw",
                    betas: tuple[float, float] | None = None) -> torch.optim.Optimizer:
    """The optimizer `name` (one of `OPTIMIZER_NOTES`) over the trainable parameters. AdamW's betas default to
    (0.9, 0.95), Lion's to the paper's (0.9, 0.99). Each missing package or device is a clear error."""
    params = [p for p in model.parameters() if p.requires_grad]
    if name not in OPTIMIZER_NOTES:
        raise ValueError(f"optimizer {name!r}: choose one of {', '.join(OPTIMIZER_NOTES)}")
    lion = "lion" in name
    betas = betas or ((0.9, 0.99) if lion else (0.9, 0.95))
    if name in BNB_OPTIMIZERS:
        if device != "cuda":
            raise RuntimeError(f"optimizer={name} needs a CUDA GPU (bitsandbytes' optimizers); use --optimizer "
                               f"{'lion' if lion else 'adamw'} on CPU.")
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise RuntimeError(f"optimizer={name} needs bitsandbytes: pip install bitsandbytes") from None
        return getattr(bnb.optim, BNB_OPTIMIZERS[name])(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if name == "lion":
        return Lion(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if name == "lion_pytorch":
        try:
            from lion_pytorch import Lion as LionPytorch
        except ImportError:
            raise RuntimeError("optimizer=lion_pytorch needs lion-pytorch: pip install lion-pytorch "
                               "(or use --optimizer lion, tunekit's own)") from None
        # decoupled_weight_decay=False: its decay is lr x wd per step, as tunekit's and the paper's
        return LionPytorch(params, lr=lr, betas=betas, weight_decay=weight_decay,
                           use_triton=device == "cuda" and importlib.util.find_spec("triton") is not None)
    fused = name == "adamw" and device == "cuda"  # one kernel for every tensor; on CPU foreach is as good
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused,
                             foreach=None if fused else True)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's state tensors hold, as allocated (the step counters included)."""
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total


# ---- compilation -----------------------------------------------------------------------------------------

def compile_step(step_module: torch.nn.Module, model, mode: str) -> torch.nn.Module:
    """Compile the step for `mode` and return what to call:

    - `regional`: each decoder block's `forward` goes through `torch.compile` (inductor). The blocks run the
      same code on parameters of the same shapes, so one compiled graph serves them all (a second for the
      first block, whose input does not require grad under LoRA): seconds, not minutes. Hooks stay outside
      the compiled region — checkpointing's and FSDP2's — so the order checkpointing -> compile -> FSDP
      holds whatever wraps the blocks.
    - `model`: the whole step (decoder, LM head and loss) as one graph: more room to fuse, longer to compile.
      Not under FSDP2 (its per-block hooks would sit inside the graph): use `regional` there.
    - `none`: eager, as written.

    Shapes: every new sequence length compiles again (`TORCH_LOGS=recompiles` shows each); packed rows are
    one width, padded batches are rounded up to a multiple of `PAD_MULTIPLE` tokens (`compile_pad_multiple`).
    """
    from tunekit.config import COMPILE
    from tunekit.distributed import decoder_layers

    if mode not in COMPILE:
        raise ValueError(f"compile {mode!r}: choose one of {', '.join(COMPILE)}")
    if mode == "regional":
        for layer in decoder_layers(model):
            layer.forward = torch.compile(layer.forward)
    elif mode == "model":
        step_module.forward = torch.compile(step_module.forward)
    return step_module


PAD_MULTIPLE = 64


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


def parse_sweep(text: str) -> dict[str, list[float]]:
    """`"adamw=3e-4,1e-3;lion=3e-5,1e-4"` -> `{"adamw": [3e-4, 1e-3], "lion": [3e-5, 1e-4]}`."""
    from tunekit.config import OPTIMIZERS

    sweep = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, lrs = part.partition("=")
        name = name.strip()
        if name not in OPTIMIZERS or not lrs.strip():
            raise ValueError(f"--sweep {part!r}: expected OPTIMIZER=LR,LR,... with OPTIMIZER one of "
                             f"{', '.join(OPTIMIZERS)}")
        try:
            sweep[name] = [float(x) for x in lrs.split(",")]
        except ValueError:
            raise ValueError(f"--sweep {part!r}: learning rates are numbers such as 3e-4") from None
    if not sweep:
        raise ValueError("--sweep is empty; e.g. 'adamw=3e-4,1e-3;lion=3e-5,1e-4'")
    return sweep


def run_convergence(cfg, sweep: dict[str, list[float]], name: str, verbose: bool = True) -> dict:
    """Train `cfg` once per (optimizer, learning rate) of `sweep` — same data, same seed, same held-out rows
    (`cfg.eval_split`) — and record every run's training and held-out loss curves, its speed and its memory.
    Lion runs take the paper's weight decay rule: 10x the config's (`lion_settings`). Each run is scored by
    the lowest held-out loss along its curve (where early stopping would keep it: a small corpus trained for
    many epochs overfits, and the final loss then rewards whatever learns slowest); the best learning rate of
    each optimizer is the one with the lowest score. One scratch folder serves every run (`--overwrite` keeps
    its tokenized data)."""
    import dataclasses
    import statistics
    import tempfile
    import time
    from pathlib import Path

    from tunekit import train as tr
    from tunekit.results import new_result

    if not cfg.eval_split:
        raise ValueError("run_convergence compares held-out losses: set --eval-split (e.g. 0.05)")
    folder = Path(cfg.out_dir or tempfile.mkdtemp(prefix="tunekit-converge-"))
    runs = []
    for optimizer, lrs in sweep.items():
        for lr in lrs:
            wd = lion_settings(lr, cfg.weight_decay)["weight_decay"] if "lion" in optimizer else cfg.weight_decay
            run = dataclasses.replace(cfg, optimizer=optimizer, lr=lr, weight_decay=wd, out_dir=str(folder))
            t0 = time.perf_counter()
            summary = tr.train(run, progress=False, overwrite=True)
            wall = time.perf_counter() - t0
            rows = tr.read_metrics(folder)
            every = max(1, len(rows) // 200)  # at most ~200 points of the training curve
            low = min(summary["eval_losses"], key=lambda e: e[1])
            runs.append({
                "optimizer": optimizer, "lr": lr, "weight_decay": wd, "best_eval_loss": low[1],
                "best_eval_step": low[0], "final_eval_loss": summary["eval_loss"],
                "final_train_loss": summary["final_loss"], "eval": summary["eval_losses"],
                "train": [[r["step"], r["loss"]] for r in rows[::every]],
                "tok_per_s": statistics.median(r["tok_per_s"] for r in rows[len(rows) // 10:]),
                "peak_memory_gb": rows[-1]["peak_mem_gb"], "wall_s": round(wall, 1)})
            if verbose:
                print(f"{optimizer:<14} lr {lr:<8.2g} wd {wd:<5g} held-out loss: lowest {low[1]:.4f} (step {low[0]}), "
                      f"final {summary['eval_loss']:.4f} (train {summary['final_loss']:.4f}), {wall:.0f} s", flush=True)
    best = {}
    for r in runs:
        if r["optimizer"] not in best or r["best_eval_loss"] < best[r["optimizer"]]["best_eval_loss"]:
            best[r["optimizer"]] = r
    return new_result(name, cfg, None, None, call=f"speedups.run_convergence(TuneConfig(**config), {sweep!r}, "
                      f"{name!r})", runs=runs,
                      best={k: {"lr": v["lr"], "best_eval_loss": v["best_eval_loss"], "best_eval_step": v["best_eval_step"]}
                            for k, v in best.items()},
                      weights="random init, trained from scratch", data=f"{cfg.data}, {cfg.eval_split:g} held out")


def tf32_precision(n: int = 4096, device: str = "cuda", seed: int = 0) -> dict:
    """How far an n x n x n fp32 matmul lands from float64 with TF32 off, with TF32 on, and in bf16 (relative
    Frobenius error): what "almost no precision loss" means in numbers. A result dict (`l4_tf32_precision`)."""
    from tunekit.results import new_result

    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(n, n, device=device, generator=g)
    b = torch.randn(n, n, device=device, generator=g)
    exact = a.double() @ b.double()

    def error(c) -> float:
        return float((c.double() - exact).norm() / exact.norm())

    with tf32(False):
        plain = error(a @ b)
    with tf32(True):
        fast = error(a @ b)
    half = error(a.bfloat16() @ b.bfloat16())
    return new_result("l4_tf32_precision", None, None, None, call=f"speedups.tf32_precision({n})", n=n,
                      fp32_rel_error=plain, tf32_rel_error=fast, bf16_rel_error=half)
