"""`tunekit doctor`: what this machine has for fine-tuning, and one line of advice for each gap."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform

import torch


def _try_import(name: str) -> tuple[bool, str]:
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # a broken install raises more than ImportError (missing CUDA libs, ABI errors)
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    try:
        return True, importlib.metadata.version(name.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return True, getattr(mod, "__version__", "installed")


def bitsandbytes_status() -> tuple[bool, str]:
    ok, info = _try_import("bitsandbytes")
    if not ok:
        return False, info
    if not torch.cuda.is_available():
        return False, f"{info}, but no CUDA GPU: its 4-bit kernels need one"
    try:  # quantize one small tensor: proves the CUDA library loaded, not just the Python package
        import bitsandbytes.functional as bnbf

        bnbf.quantize_4bit(torch.randn(64, 64, device="cuda", dtype=torch.bfloat16), quant_type="nf4")
        return True, f"{info}, CUDA 4-bit kernels work"
    except Exception as e:
        return False, f"{info}, but its CUDA library failed: {str(e).splitlines()[0][:120]}"


ADVICE = {
    # Never `pip install tunekit[...]`: PyPI's `tunekit` is another project. Extras come from the clone.
    "bitsandbytes": "needed for QLoRA and 8-bit optimizers: pip install -e '.[gpu]' in your clone of tunekit",
    "flash_attn": "optional: PyTorch SDPA is used instead. Where a wheel exists: pip install flash-attn --no-build-isolation",
    "liger_kernel": "optional fused kernels (RMSNorm, RoPE, SwiGLU, fused cross-entropy): pip install liger-kernel",
}


def report() -> list[tuple[str, str]]:
    rows = [("python", platform.python_version()), ("torch", torch.__version__),
            ("CUDA (torch build)", str(torch.version.cuda))]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append((f"GPU {i}", f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}"))
        rows.append(("bf16", "yes" if torch.cuda.is_bf16_supported() else "no: use fp16 with loss scaling or fp32"))
    else:
        rows.append(("GPU", "none visible: only the tiny preset runs here (tunekit train --preset tiny)"))
    for name in ("transformers", "peft", "accelerate", "datasets"):
        ok, info = _try_import(name)
        rows.append((name, info if ok else f"MISSING ({info}): pip install -e ."))
    checks = {"bitsandbytes": bitsandbytes_status(), "flash_attn": _try_import("flash_attn"),
              "liger_kernel": _try_import("liger_kernel")}
    for name, (ok, info) in checks.items():
        rows.append((name, info if ok else f"not usable ({info}) -> {ADVICE[name]}"))
    return rows


def main() -> int:
    rows = report()
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
