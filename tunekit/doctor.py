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


def print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main(distributed: bool = False) -> int:
    """`tunekit doctor`; with `distributed`, `tunekit doctor --distributed`."""
    print_rows(distributed_report() if distributed else report())
    return 0


# ---- `tunekit doctor --distributed`: the network NCCL will use, and what to set --------------------------

NCCL_DEBUG_VARS = {  # variable: why set it while debugging a hang (none changes speed)
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "the flight recorder: the last N collectives of each rank, dumped on a "
                                    "timeout, show which rank stopped where (e.g. 2000)",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "write that record when a collective times out (1)",
    "NCCL_DEBUG": "INFO prints the transport NCCL picked for each peer (NVLink P2P, SHM, IB, socket)",
    "TORCH_DISTRIBUTED_DEBUG": "DETAIL checks that every rank calls the same collectives with the same shapes",
}


def infiniband_devices(root: str = "/sys/class/infiniband") -> list[str]:
    """InfiniBand (or RoCE) adapters the kernel knows, with each port's state, e.g. `mlx5_0 port 1: ACTIVE`."""
    from pathlib import Path

    found = []
    for dev in sorted(Path(root).glob("*")) if Path(root).is_dir() else []:
        for port in sorted((dev / "ports").glob("*")):
            state = (port / "state").read_text().strip() if (port / "state").exists() else "unknown"
            found.append(f"{dev.name} port {port.name}: {state.split(':')[-1].strip()}")
    return found


def network_interfaces(root: str = "/sys/class/net") -> dict[str, str]:
    """{interface: operstate} of the network interfaces (loopback included), from sysfs."""
    from pathlib import Path

    out = {}
    for dev in sorted(Path(root).glob("*")) if Path(root).is_dir() else []:
        state = dev / "operstate"
        out[dev.name] = state.read_text().strip() if state.exists() else "unknown"
    return out


def check_socket_ifname(value: str, interfaces: dict[str, str], var: str = "NCCL_SOCKET_IFNAME") -> str | None:
    """Why `var`=`value` matches no interface here, or None when it does. NCCL (and gloo) read it as a
    comma-separated list of name prefixes; `^` excludes them, `=` asks for exact names."""
    if not value or value.startswith("^"):
        return None
    exact = value.startswith("=")
    names = [n for n in value.lstrip("=").split(",") if n]
    if any(i == n or (not exact and i.startswith(n)) for n in names for i in interfaces):
        return None
    return (f"{var}={value} matches none of this machine's interfaces ({', '.join(interfaces) or 'none'})"
            f": the process group cannot open its sockets. Unset it, or name one that exists, e.g. "
            f"{next((i for i in interfaces if i != 'lo'), 'lo')}")


def distributed_report(environ: dict | None = None, ib_root: str = "/sys/class/infiniband",
                       net_root: str = "/sys/class/net") -> list[tuple[str, str]]:
    """What NCCL will find and what is set: InfiniBand, interfaces, GPU peer access, the NCCL variables the
    article names, and the debugging variables. Each problem comes with the variable to set and why."""
    import os

    env = dict(os.environ if environ is None else environ)
    rows = []
    ib = infiniband_devices(ib_root)
    rows.append(("InfiniBand", ", ".join(ib) if ib else "none: NCCL falls back to sockets between nodes "
                 "(within one node GPUs talk over NVLink/PCIe, which IB does not affect)"))
    if env.get("NCCL_IB_DISABLE") == "1" and any("ACTIVE" in d for d in ib):
        rows.append(("NCCL_IB_DISABLE", ("=1 but an InfiniBand port is ACTIVE: multi-node traffic goes over "
                                         "TCP sockets instead, many times slower. Unset it.")))
    elif "NCCL_IB_DISABLE" in env:
        rows.append(("NCCL_IB_DISABLE", f"={env['NCCL_IB_DISABLE']} (harmless here: no active IB port)"))
    interfaces = network_interfaces(net_root)
    rows.append(("interfaces", ", ".join(f"{k} ({v})" for k, v in interfaces.items()) or "none found"))
    if "NCCL_SOCKET_IFNAME" in env:
        problem = check_socket_ifname(env["NCCL_SOCKET_IFNAME"], interfaces)
        rows.append(("NCCL_SOCKET_IFNAME", problem or f"={env['NCCL_SOCKET_IFNAME']} matches an interface"))
    if torch.cuda.device_count() > 1:
        n = torch.cuda.device_count()
        pairs = [(a, b) for a in range(n) for b in range(n) if a != b]
        blocked = [f"{a}->{b}" for a, b in pairs if not torch.cuda.can_device_access_peer(a, b)]
        rows.append(("GPU peer access", "every pair" if not blocked else
                     f"not between {', '.join(blocked)}: NCCL copies through host memory there"))
    if env.get("NCCL_P2P_DISABLE") == "1":
        rows.append(("NCCL_P2P_DISABLE", ("=1: GPUs of one node talk through host memory, not NVLink. Unset it "
                                          "unless P2P is broken on this machine.")))
    nvls = env.get("NCCL_NVLS_ENABLE")
    rows.append(("NCCL_NVLS_ENABLE", f"={nvls}" if nvls is not None else
                 "unset: NCCL uses NVLink SHARP where the NVSwitch offers it; where that misbehaves (multicast "
                 "objects failing to allocate, hangs at start-up) set NCCL_NVLS_ENABLE=0"))
    for var, why in NCCL_DEBUG_VARS.items():
        rows.append((var, f"={env[var]}" if var in env else f"unset; for a hang: {why}"))
    return rows
