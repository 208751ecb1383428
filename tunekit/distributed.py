"""Several GPUs, with PyTorch's own engine: torchrun starts one process per GPU, NCCL (gloo on CPU) moves the
tensors, DDP or FSDP2 wraps the model. Nothing here is home-made parallelism.

A run is distributed when it is launched that way: `torchrun --nproc_per_node 2 -m tunekit.cli train ...`
(or `accelerate launch`, which sets the same variables). `init` reads RANK, WORLD_SIZE and LOCAL_RANK from
the environment, starts the process group and pins each process to its GPU; without them everything below
is a no-op, so one code path serves one GPU and many.

`parallelize` is the one place where a model becomes parallel, in a fixed order (as torchtitan's
`parallelize` does): the model code stays single-device, and `build.apply_techniques` calls this once, last.

- **DDP** (`parallel=ddp`): every rank holds the whole model; gradients are all-reduced in buckets while
  backward runs. Right when the model, its gradients and optimizer state fit one GPU — LoRA and QLoRA 7B.
- **FSDP2** (`parallel=fsdp`, `torch.distributed.fsdp.fully_shard`): each decoder block, then the root, is
  sharded across ranks; a block's weights are all-gathered just before it runs and freed after, gradients are
  reduce-scattered. bf16 compute with fp32 gradient reduction (`MixedPrecisionPolicy`), no CPU offload.
  Right when the model does not fit one GPU with its optimizer state — full fine-tuning 7B.

What a step does differently under either (tunekit/step.py):
- The loss is divided by the target tokens of the whole step on *all* ranks (`all_reduce_sum`, once per
  step, before any backward). DDP and FSDP average gradients over ranks, so each rank's loss is also
  multiplied by the world size: the gradients are then those of one process on the global batch, whatever
  each rank's token count. (`loss / grad_accum`, the usual recipe, is wrong when micro-batches differ.)
- Gradients are synchronised on the last micro-step only (`no_sync` for DDP, `set_requires_gradient_sync`
  for FSDP2): accumulating 4 micro-batches costs one all-reduce, not 4.
- Each rank reads its own disjoint share of every global batch (`batching.EpochSampler(rank=, world=)`),
  so packing, length grouping and `--resume` stay exact.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist

from tunekit.doctor import check_socket_ifname, network_interfaces
from tunekit.io import CheckpointError
from tunekit.model import decoder_layers
from tunekit.speedups import compile_step
from tunekit.validation import PARALLEL


def world_size() -> int:
    """Processes in the running process group (1 before `init` or without one)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def print0(*args, **kwargs) -> None:
    """print, on rank 0 only."""
    if is_main():
        print(*args, **kwargs)


def launched() -> bool:
    """Whether torchrun (or accelerate launch) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(device: str, timeout_s: float = 600) -> None:
    """Start the process group for a launched run, and make GPU LOCAL_RANK this process's `cuda` device. A
    no-op when the process was not launched as one of several. `timeout_s` bounds how long a collective waits
    for a rank that died: the others then fail with an error instead of hanging."""
    global _gloo_started
    if not launched():
        return

    for var in ("NCCL_SOCKET_IFNAME",) if device == "cuda" else ("GLOO_SOCKET_IFNAME",):  # else: deep in NCCL
        if problem := check_socket_ifname(os.environ.get(var, ""), network_interfaces(), var):
            raise RuntimeError(problem)
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            if local_rank() >= torch.cuda.device_count():
                raise RuntimeError(f"LOCAL_RANK {local_rank()} but only {torch.cuda.device_count()} GPUs are "
                                   "visible: launch at most that many processes per node (--nproc_per_node)")
            torch.cuda.set_device(local_rank())
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=torch.device("cuda", local_rank()) if device == "cuda" else None)
        _gloo_started = _gloo_started or backend == "gloo"


_gloo_started = False  # this process started a gloo group (`started_gloo`)


def started_gloo() -> bool:
    """Whether this process has run a gloo process group (a launch on CPUs), torn down or not."""
    return _gloo_started


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(value: float | torch.Tensor):
    """The sum of `value` over all ranks (itself when not distributed); returns the type it was given. A
    tensor stays on its device (NCCL reduces GPU tensors, gloo CPU ones)."""
    if not dist.is_initialized():
        return value
    nccl = dist.get_backend() == "nccl"
    if torch.is_tensor(value):
        t = value.detach().clone() if (value.is_cuda == nccl) else value.detach().to("cuda" if nccl else "cpu")
        dist.all_reduce(t)
        return t.to(value.device)
    t = torch.tensor(value, dtype=torch.float64, device="cuda" if nccl else "cpu")
    dist.all_reduce(t)
    return type(value)(t.item())


def main_first(fn):
    """`fn()` on rank 0, then on the other ranks: for work whose result rank 0 writes and the others read
    (the prepared data). An error on rank 0 stops the other ranks with an error, not a hang."""
    if not dist.is_initialized():
        return fn()
    failure, out = None, None
    if is_main():
        try:
            out = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after telling the other ranks
            failure = e
    failed = all_reduce_sum(0 if failure is None else 1)  # every rank waits here for rank 0
    if failure is not None:
        raise failure
    if failed:
        raise RuntimeError("rank 0 failed (its error is above); this rank stops too")
    return out if is_main() else fn()


def choose_parallel(requested: str, method: str) -> str:
    """`auto`: FSDP2 for full fine-tuning (weights, gradients and AdamW states of every parameter: the memory
    that sharding divides), DDP for LoRA and QLoRA (the frozen base fits one GPU; only the adapters' small
    gradients travel)."""
    if requested != "auto":
        return requested
    return "fsdp" if method == "full" else "ddp"


def parallelize(step_module: torch.nn.Module, model, parallel: str, device: str, dtype: torch.dtype,
                reshard: bool = True, compile: str = "none", dynamic: bool | None = None, recompute: bool = False):
    """Compile and wrap `step_module` (the model and its loss, `train.StepModule`) for the launched world: the
    one place where compilation and parallelism are applied, in torchtitan's order — checkpointing (already in
    the model), then `compile` (`speedups.compile_step`: `regional` or `model`), then DDP or FSDP2. `reshard`:
    FSDP2 frees each block's gathered weights after its forward (config `fsdp_reshard`); `dynamic`, torch.compile's
    (`speedups.compile_dynamic`), and `recompute`, its partitioner's (config `compile_recompute`). Returns what to call:
    `step_module` itself, compiled or not, when not distributed."""
    sharded = parallel == "fsdp" and dist.is_initialized() and dist.get_world_size() > 1
    if compile == "model" and sharded:
        raise ValueError("config field 'compile' = 'model': under FSDP2 each decoder block's hooks gather its "
                         "weights, which one whole-model graph cannot hold; use --compile regional")
    step_module = compile_step(step_module, model, compile, dynamic, recompute)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return step_module
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [torch.cuda.current_device()] if device == "cuda" else None
        return DDP(step_module, device_ids=ids)
    if parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 \
            else MixedPrecisionPolicy()
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(step_module, mp_policy=mp)  # the root: embeddings, final norm, LM head, the loss
        return step_module
    raise ValueError(f"unknown parallel {parallel!r}; choose one of {', '.join(PARALLEL)}")


@contextlib.contextmanager
def gradient_sync(module, enabled: bool):
    """Inside, backward passes synchronise gradients across ranks only if `enabled` (the last micro-step of
    an optimizer step): `no_sync` for DDP, `set_requires_gradient_sync` for FSDP2; nothing otherwise."""
    if enabled or not dist.is_initialized():
        yield
        return
    if hasattr(module, "no_sync"):  # DDP
        with module.no_sync():
            yield
        return
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
        return
    yield


def is_sharded(model) -> bool:
    """Whether FSDP2 sharded `model`'s parameters (they are then DTensors, each rank holding a slice)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_trainable(model) -> dict:
    """The trainable weights as whole CPU tensors keyed by parameter name, on rank 0 (the other ranks get an
    empty dict): each sharded (FSDP2) one is gathered in turn, so the frozen base — 4-bit under QLoRA — is
    never touched. A collective: every rank must call it. For the final adapter or model folder."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            whole = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
            if is_main():
                out[name] = whole.cpu()
    return out


def _sharded_state(model, optimizer) -> dict:
    """The trainable weights and the optimizer state as this rank's shards (DTensors), keyed by name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    weights = {n: t for n, t in get_model_state_dict(model).items() if n in trainable}
    return {"model": weights, "optim": get_optimizer_state_dict(model, optimizer)}


def save_sharded(model, optimizer, folder) -> None:
    """Every rank writes its own shards of the trainable weights and the optimizer state into `folder`
    (`torch.distributed.checkpoint`: one file per rank and a metadata file; nothing is gathered). Collective."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_state(model, optimizer), checkpoint_id=str(folder))


# What a `torch.distributed.checkpoint` metadata file may name: the dataclasses and enums of its metadata
# module, the filesystem's record of where each item lies, torch's dtypes, layouts, memory formats and Size,
# paths. torch unpickles it with plain `pickle.load`, which runs whatever a crafted file names.
DCP_METADATA = "torch.distributed.checkpoint.metadata"
DCP_STORAGE_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")


def _dcp_global(module: str, name: str):
    """The object `module.name` if a dcp metadata file may name it, else None."""
    import importlib
    import pathlib

    if module == DCP_METADATA or (module, name) == DCP_STORAGE_INFO:
        obj = getattr(importlib.import_module(module), name, None)
        return obj if isinstance(obj, type) and obj.__module__ == module else None
    if module == "torch":
        obj = getattr(torch, name, None)
        return obj if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) else None
    if (module, name) == ("torch.serialization", "_get_layout"):  # as torch's weights-only load allows
        return torch.serialization._get_layout
    if module == "pathlib" and name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        return getattr(pathlib, name)
    if (module, name) == ("collections", "OrderedDict"):
        import collections

        return collections.OrderedDict
    return None


def check_dcp_metadata(folder) -> None:
    """Read every `*.metadata` file of a `torch.distributed.checkpoint` folder with an unpickler that builds
    only what such a file holds (`_dcp_global`), before torch unpickles it freely; a CheckpointError naming the
    file for anything else."""
    import io
    import pickle
    from pathlib import Path

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if (obj := _dcp_global(module, name)) is None:
                raise pickle.UnpicklingError(f"it names {module}.{name}")
            return obj

    for f in sorted(p for p in Path(folder).iterdir() if p.name.endswith(".metadata")):
        try:
            Restricted(io.BytesIO(f.read_bytes())).load()
        except Exception as e:  # noqa: BLE001 - a crafted or damaged pickle fails in many ways
            raise CheckpointError(f"refusing checkpoint file {f}: it is not the metadata torch.distributed.checkpoint "
                                  f"writes, and unpickling it could run code ({e}). Resume from a checkpoint you "
                                  "trust, or start over with --overwrite.") from None


def load_dcp(state: dict, folder) -> None:
    """`torch.distributed.checkpoint.load(state, folder)` that runs no code from the folder: its metadata is
    checked first (`check_dcp_metadata`), and each non-tensor value (optimizer hyperparameters), which dcp's
    planner unpickles with `weights_only=False`, must load with `weights_only=True` first. Collective."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class PlainValues(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raw = value.read()
            try:
                torch.load(io.BytesIO(raw), weights_only=True)
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"refusing {read_item.dest_index.fqn} of the checkpoint in {folder}: it "
                                      "is not a plain value, and loading it could run code "
                                      f"({type(e).__name__})") from None
            super().load_bytes(read_item, io.BytesIO(raw))

    check_dcp_metadata(folder)
    try:
        dcp.load(state, checkpoint_id=str(folder), planner=PlainValues())
    except CheckpointException as e:  # each rank's failure, wrapped with its traceback: ours said in one line
        for failure in e.failures.values():
            if isinstance(exc := failure[0] if isinstance(failure, tuple) else failure, CheckpointError):
                raise exc from None
        raise


def load_sharded(model, optimizer, folder) -> None:
    """Read what `save_sharded` wrote back into the sharded model and optimizer, each rank its own shards.
    Collective."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = _sharded_state(model, optimizer)
    load_dcp(state, folder)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    set_optimizer_state_dict(model, optimizer, state["optim"])


# ---- the all-reduce itself: what the interconnect delivers -----------------------------------------------
