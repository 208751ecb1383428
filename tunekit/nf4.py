"""bitsandbytes' 4-bit weights read in plain torch, for the fused LoRA over a QLoRA base (`fastlora`).

QLoRA keeps each frozen weight [out, in] as 4-bit codes, two a byte (the first of each pair in the high half),
row after row; a block of `blocksize` (64) consecutive values shares one scale, its largest magnitude (`absmax`):

    W.flat[i] = table[code i] * absmax[i // blocksize]          # table: the 16 NF4 levels, -1 .. 1

With double quantization (`bnb_4bit_use_double_quant`) the absmaxes are themselves stored in 8 bits, blocks of 256
sharing an fp32 scale, around an offset:

    absmax[j] = table2[absmax8[j]] * absmax2[j // 256] + offset

bitsandbytes computes this in its own kernels, one call per use, into a full bf16 copy of the weight. Written
here as torch operations, `torch.compile` fuses the lookups into whatever reads the weight next: with FP8
(`fastlora`, `attach(fp8=True)`) the row's largest value and the FP8 copy are computed straight from the codes,
the bf16 copy never written. The arithmetic is bitsandbytes' own (fp32 products, then the cast), so the values
are the same to the bit: tests/unit/test_nf4.py checks it against `bitsandbytes.functional.dequantize_4bit`.
"""

from __future__ import annotations

import torch


def is_4bit(layer) -> bool:
    """Whether `layer` is a bitsandbytes 4-bit linear layer holding quantized weights (not yet on a device, a
    `Linear4bit` still holds its float weights)."""
    weight = getattr(layer, "weight", None)
    return type(layer).__name__ == "Linear4bit" and getattr(weight, "quant_state", None) is not None


def why_not(layer) -> str:
    """'' when `is_4bit(layer)` weights can be read here, else why not."""
    qs = layer.weight.quant_state
    if qs.quant_type != "nf4":
        return f"its 4-bit type is {qs.quant_type}; only nf4 is read here (bnb_4bit_quant_type='nf4')"
    if len(qs.shape) != 2 or qs.shape[0] * qs.shape[1] % qs.blocksize:
        return f"its weight {tuple(qs.shape)} is not whole blocks of {qs.blocksize} values"
    return ""


def tensors(layer) -> tuple[torch.Tensor, ...]:
    """(codes, table, absmax, table2, absmax2, offset): what `dequantize` reads, as tensors (views of the layer's
    own, no copies); for a layer without double quantization absmax is fp32 and table2, absmax2, offset are
    empty."""
    qs = layer.weight.quant_state
    codes = layer.weight.data.reshape(-1).view(torch.uint8)  # a bf16 quant_storage (FSDP) holds the same bytes
    if qs.nested:
        offset = qs.offset if torch.is_tensor(qs.offset) else torch.tensor(float(qs.offset))
        return (codes, qs.code, qs.absmax, qs.state2.code, qs.state2.absmax,
                offset.to(device=codes.device, dtype=torch.float32).reshape(1))
    empty = codes.new_empty(0, dtype=torch.float32)
    return codes, qs.code, qs.absmax, empty, empty, empty


def shape_of(layer) -> tuple[int, int, int, int]:
    """(out, in, blocksize, nested block size or 0)."""
    qs = layer.weight.quant_state
    return int(qs.shape[0]), int(qs.shape[1]), int(qs.blocksize), int(qs.state2.blocksize) if qs.nested else 0


def tied_to(dy: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`tensors` (of `tensors(layer)`) with the same values, computed from one element of `dy` too. In a compiled
    backward the weight read from them then depends on the backward's input, so compile's partitioner cannot move
    that read into the forward and keep a part of it (the codes unpacked, a byte a weight; the scales) until the
    backward, as it does with what depends on the forward's inputs alone. A NaN in `dy` zeroes them (the gradient
    is NaN anyway)."""
    first = dy[(0,) * dy.dim()]  # a view of one element, whatever dy's strides (a reshape could copy all of dy)
    nan = (first != first).reshape(1)  # False: nothing a compiler can fold away
    return tuple(t.masked_fill(nan, 0) for t in tensors)


def dequantize(codes, table, absmax, table2, absmax2, offset, out_f: int, in_f: int, blocksize: int,
               blocksize2: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out_f, in_f] in `dtype` from the tensors of `tensors(layer)` (shapes from `shape_of`): as torch
    operations while `torch.compile` traces (they fuse into what reads the weight), else on a GPU by
    bitsandbytes' own kernel (one launch, where the operations would be several)."""
    if blocksize2:  # double quantization: the absmaxes from their 8-bit codes, in fp32 as bitsandbytes
        block = torch.arange(absmax.numel(), device=absmax.device) // blocksize2
        scales = table2[absmax.long()] * absmax2[block] + offset
    else:
        scales = absmax.float()
    if codes.is_cuda and not torch.compiler.is_compiling():
        return torch.ops.bitsandbytes.dequantize_4bit.default(codes.view(-1, 1), scales, blocksize, "nf4",
                                                               [out_f, in_f], dtype)
    pairs = torch.stack((codes >> 4, codes & 15), dim=-1).reshape(-1, blocksize).long()
    values = table.float()[pairs] * scales.reshape(-1, 1)
    return values.to(dtype).reshape(out_f, in_f)
