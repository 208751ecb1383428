"""Memory: gradient checkpointing, host offload of the embeddings, and measuring and capping GPU memory.

Gradient checkpointing keeps only each decoder block's input in forward and recomputes the block in
backward (https://arxiv.org/abs/1604.06174). It saves most activation memory and costs one extra forward,
about a third more compute. We use PyTorch's non-reentrant implementation, which works with frozen inputs
(LoRA) and with torch.compile.

A trap: transformers applies checkpointing only in train mode, and `from_pretrained` returns a model in
eval mode — so "checkpointing on" can silently do nothing. `apply_gradient_checkpointing` puts the model
in train mode, and `check_checkpointing` fails loudly if a model is about to train without it.

`memory_cap(gb)` makes a large GPU behave like a smaller one for the length of a `with` block (the caching
allocator raises out-of-memory past the cap) and puts the previous cap back after it, to answer "would
this fit a 24 GB card?" by running it. The cap applies to *reserved* memory, fragmentation included, not to
the allocated memory `peak_memory_gb` reports first. Predicting the peak before loading anything is
`tunekit/estimate.py`.
"""

from __future__ import annotations

import contextlib
import math
import os
import weakref
from collections.abc import Iterator

import torch

from tunekit.model import base_model


def apply_gradient_checkpointing(model: torch.nn.Module, offload: bool = False) -> None:
    """Turn on non-reentrant checkpointing of every decoder block, and switch the model to train mode.

    `offload=True` moves what checkpointing keeps — each block's input — to pinned CPU memory in forward
    and back in backward (`HostOffload` around each block's checkpoint): layers x tokens x hidden x 2 bytes
    less GPU memory, for a device-to-host and a host-to-device copy of each, both queued without waiting."""
    from torch.utils.checkpoint import checkpoint

    base = base_model(model)
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # the transformers >= 5.2x name
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if offload:
        streamed = StreamedOffload() if os.environ.get("TUNEKIT_OFFLOAD_STREAM") == "1" else None

        def offloaded(function, *args, **kw):
            # The checkpoint saves its inputs through the hooks active outside it (these); what the block
            # saves inside is dropped by the checkpoint's own hooks and recomputed.
            with streamed.block() if streamed else HostOffload():
                return checkpoint(function, *args, use_reentrant=False, **kw)

        for module in base.modules():
            if getattr(module, "gradient_checkpointing", False):
                module._gradient_checkpointing_func = offloaded
    base.config.use_cache = False  # a KV cache is useless in training and clashes with recomputation
    model.train()


OFFLOAD_MIN_BYTES = 1 << 20  # smaller saved tensors stay on the GPU (the rotary tables every block shares)


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved GPU tensors go to pinned CPU memory when saved and come back when the backward needs them.

    PyTorch's `save_on_cpu(pin_memory=True)` does the same, but its device-to-host copy blocks the host until
    the GPU has finished everything queued before it, once for every tensor saved: the GPU then idles while the
    host launches the next kernels (the whole step at batch 1 is that short). Here both copies are queued on
    the current stream and nobody waits: the stream orders the copy after the kernel that wrote the tensor and
    before any later reuse of its memory, and PyTorch's pinned-memory cache keeps a host buffer until the
    copies that use it have run. Tensors under `OFFLOAD_MIN_BYTES`, and tensors not on a CUDA device, stay
    where they are."""

    def __init__(self):
        super().__init__(_pack_to_host, _unpack_from_host)


def _pack_to_host(t: torch.Tensor):
    if t.device.type != "cuda" or t.numel() * t.element_size() < OFFLOAD_MIN_BYTES:
        return None, t
    host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return t.device, host


def _unpack_from_host(packed):
    device, t = packed
    return t if device is None else t.to(device, non_blocking=True)


class StreamedOffload:
    """`HostOffload` with its copies off the compute stream, for one model's blocks together. An experiment that
    lost: `TUNEKIT_OFFLOAD_STREAM=1` ran the QLoRA step at 9,700 tok/s with steps spread ±46% on an H100, where
    `HostOffload` ran it at 13,464 ±0.7% (`s30_qlora_fp8_offload_stream`, `s30_qlora_fp8_offload_plain`), so it
    stays off. In forward each block's saved input goes to pinned CPU memory on a side stream, so the copy
    overlaps the next blocks' compute (`record_stream` keeps its GPU memory until the copy has read it). In
    backward, when a block's saved inputs are first needed, they come back on the side stream (unless already
    there) and the block before it is prefetched, so its copy overlaps this block's recomputation and backward:
    two blocks' inputs at most are on the GPU at a time. Tensors under `OFFLOAD_MIN_BYTES` and tensors not on a
    CUDA device stay where they are, as in `HostOffload`."""

    device_type, pin = "cuda", True  # what is offloaded, and into pinned memory (a CPU test changes both)

    def __init__(self):
        self._streams: dict = {}
        self._blocks: list = []  # weak references to each block's saved entries, in forward order

    @contextlib.contextmanager
    def block(self) -> Iterator[None]:
        """The hooks for one block's checkpoint: what it saves is one group, fetched back together."""
        group = _Group()
        self._blocks = [ref for ref in self._blocks if ref() is not None] + [weakref.ref(group)]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(group, t), self._unpack):
            yield

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _pack(self, group: _Group, t: torch.Tensor):
        if t.device.type != self.device_type or t.numel() * t.element_size() < OFFLOAD_MIN_BYTES:
            return None, t
        side = self._side(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))  # after the kernel that wrote t
        with torch.cuda.stream(side):
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=self.pin)
            host.copy_(t, non_blocking=True)
        t.record_stream(side)  # its memory is not reused before the copy has read it
        entry = _Entry(t.device, host, group)
        group.entries.append(entry)
        return entry, None

    def _fetch(self, entries: list[_Entry]) -> None:
        """Start copying saved tensors back to the GPU on the side stream (those not there already)."""
        for e in entries:
            if e.gpu is None:
                side = self._side(e.device)
                with torch.cuda.stream(side):  # after its own copy to the host: the same stream
                    e.gpu = e.host.to(e.device, non_blocking=True)
                    e.ready = torch.cuda.Event()
                    e.ready.record(side)

    def _fetch_group(self, group: _Group) -> None:
        if not group.fetched:
            group.fetched = True
            self._fetch(group.entries)

    def _unpack(self, packed):
        entry, kept = packed
        if entry is None:
            return kept
        if not entry.group.fetched:  # the block's backward begins: its inputs, and the next block's, come back
            groups = [g for ref in self._blocks if (g := ref()) is not None]
            self._fetch_group(entry.group)
            at = next((i for i, g in enumerate(groups) if g is entry.group), 0)
            if at > 0:
                self._fetch_group(groups[at - 1])  # the block whose backward comes next
        self._fetch([entry])  # a tensor unpacked a second time comes back again from the host
        current = torch.cuda.current_stream(entry.device)
        current.wait_event(entry.ready)
        gpu, entry.gpu = entry.gpu, None  # the host copy stays while the graph holds the entry
        gpu.record_stream(current)
        return gpu


class _Group:
    def __init__(self):
        self.entries: list[_Entry] = []
        self.fetched = False


class _Entry:
    def __init__(self, device: torch.device, host: torch.Tensor, group: _Group):
        self.device, self.host, self.group = device, host, group
        self.gpu: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None


class HostEmbedding(torch.nn.Module):
    """A frozen input-embedding table kept in CPU memory: the lookup runs on the CPU and only the B x S x H
    rows it returns travel to the GPU. Token ids on the host (`step.to_device(..., host_ids=True)`, which the
    training loop and the bench pass for a model with this table, `host_embedded`) are looked up at once; ids on
    the GPU first come back to the host, which waits for everything queued before them (the last step's work)."""

    def __init__(self, embedding: torch.nn.Embedding, device: torch.device | str):
        super().__init__()
        self.weight = torch.nn.Parameter(_pinned(embedding.weight), requires_grad=False)
        self.padding_idx = embedding.padding_idx
        self.device = torch.device(device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = torch.nn.functional.embedding(input_ids.to("cpu"), self.weight, self.padding_idx)
        if self.device.type == "cuda":
            rows = rows.pin_memory()
        return rows.to(self.device, non_blocking=True)


class HostLinear(torch.nn.Module):
    """A frozen, bias-free linear layer (the LM head) kept in pinned CPU memory and copied to the GPU each
    time it is used. The chunked loss uses the copy for the loss alone and drops it before the backward."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = torch.nn.Parameter(_pinned(linear.weight), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.to(x.device, non_blocking=True))


def _pinned(weight: torch.Tensor) -> torch.Tensor:
    w = weight.detach().to("cpu")
    return w.pin_memory() if torch.cuda.is_available() else w


def host_embedded(model: torch.nn.Module) -> bool:
    """Whether `model`'s input embeddings live in CPU memory (`offload_embeddings`): its token ids are best kept
    on the host."""
    return isinstance(base_model(model).get_input_embeddings(), HostEmbedding)


def offload_embeddings(model: torch.nn.Module) -> None:
    """Move the frozen input-embedding table and LM head to CPU memory (see `HostEmbedding`, `HostLinear`):
    for LoRA/QLoRA, where neither trains, 2 x 2 x vocab x hidden bytes of GPU memory (0.52 GB for
    Llama-2-7B; during the loss the head is back for a moment), for a copy of the head each micro-step
    (0.26 GB, ~10 ms over PCIe); the token ids stay on the host for the lookup (`host_embedded`)."""
    base = base_model(model)
    table, head = base.get_input_embeddings(), base.get_output_embeddings()
    if table.weight.requires_grad or (head is not None and head.weight.requires_grad):
        raise ValueError("embed_offload: the embeddings train (full fine-tuning); only frozen tables can "
                         "live on the CPU. Use it with --method lora or qlora.")
    base.set_input_embeddings(HostEmbedding(table, table.weight.device))
    tied = head is not None and head.weight is table.weight
    if isinstance(head, torch.nn.Linear) and head.bias is None and not tied:
        base.set_output_embeddings(HostLinear(head))


def checkpointing_active(model: torch.nn.Module) -> bool:
    """True when checkpointing is on *and* will actually run (the blocks are in train mode)."""
    base = base_model(model)
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


# ---- capping GPU memory --------------------------------------------------------------------------------

_fractions: dict[int, float] = {}  # what memory_cap last set, per device, for torch without the getter


def _fraction(index: int) -> float:
    # Recent torch reads the allocator's fraction back; an older one knows only what memory_cap set.
    if hasattr(torch.cuda, "get_per_process_memory_fraction"):
        return torch.cuda.get_per_process_memory_fraction(index)
    return _fractions.get(index, 1.0)


def _set_fraction(fraction: float, index: int) -> None:
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    _fractions[index] = fraction


@contextlib.contextmanager
def memory_cap(gb: float | None, device: int | None = None) -> Iterator[None]:
    """Cap what this process's CUDA caching allocator may reserve on `device` (the current one by default)
    at `gb` GB (1e9 bytes) for the block, and restore the previous cap on exit, exception or not. 0 or None:
    no cap of its own (an outer one stays). Past the cap an allocation raises `torch.OutOfMemoryError`, as
    on a GPU that size; see `allocatable_bytes`."""
    if not gb:
        yield
        return
    if not torch.cuda.is_available():
        raise RuntimeError(f"memory_cap({gb:g}) caps the CUDA caching allocator: it needs a CUDA GPU "
                           "(CPU memory has no such cap).")
    index = torch.cuda.current_device() if device is None else device
    previous = _fraction(index)
    _set_fraction(min(1.0, gb * 1e9 / torch.cuda.get_device_properties(index).total_memory), index)
    try:
        yield
    finally:
        _set_fraction(previous, index)


def allocatable_bytes(device: str | torch.device = "cuda") -> float:
    """What the caching allocator may hand out on `device`: the GPU's memory times the cap in force
    (`memory_cap`). `math.inf` on CPU, or where no CUDA GPU is visible: nothing caps it there."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return math.inf
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.get_device_properties(index).total_memory * _fraction(index)
