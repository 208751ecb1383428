"""All-reduce bandwidth between the processes of a torchrun launch (`tunekit commbench`), with the NCCL
variables it ran under.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tunekit.distributed import init, is_main, world_size
from tunekit.model import resolve_device
from tunekit.results import new_result


def allreduce_bandwidth(sizes_mb=(1, 16, 64, 256), iters: int = 20, warmup: int = 5,
                        dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Time `dist.all_reduce` of each size (MB) on every rank; returns rows with the median seconds and the
    bandwidths nccl-tests reports: `algbw` (bytes / time) and `busbw` (algbw x 2(n-1)/n, the traffic each
    link carries in a ring; comparable across GPU counts and with the link's rated speed). Collective: every
    rank calls it."""
    import statistics
    import time

    n = world_size()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    rows = []
    for mb in sizes_mb:
        x = torch.ones(int(mb * 2**20) // torch.tensor([], dtype=dtype).element_size(), dtype=dtype, device=device)
        times = []
        for i in range(warmup + iters):
            if device == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        size = x.numel() * x.element_size()
        rows.append({"mb": mb, "seconds": round(t, 6), "algbw_gbps": round(size / t / 1e9, 2),
                     "busbw_gbps": round(size / t / 1e9 * 2 * (n - 1) / n, 2)})
    return rows


NCCL_VARS = ("NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE",
             "NCCL_P2P_LEVEL", "NCCL_ALGO", "NCCL_PROTO")


def run_commbench(name: str, sizes_mb=(1, 16, 64, 256), device: str = "auto") -> dict | None:
    """`tunekit commbench` under torchrun: the all-reduce bandwidth of this launch, with the NCCL variables
    it ran under. Rank 0 returns the result, the others None."""
    init(resolve_device(device))
    if world_size() < 2:
        raise RuntimeError("commbench measures an all-reduce between processes: launch it with torchrun "
                           "--nproc_per_node 2 (or more) -m tunekit.cli commbench")
    rows = allreduce_bandwidth(sizes_mb)
    if not is_main():
        return None
    env = {v: os.environ[v] for v in NCCL_VARS if v in os.environ}
    return new_result(name, None, None, None, call=f"distributed.run_commbench({name!r}, {tuple(sizes_mb)!r})",
                      backend=dist.get_backend(), nccl_env=env, rows=rows,
                      busbw_gbps=max(r["busbw_gbps"] for r in rows))
