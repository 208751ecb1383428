"""A LoRA linear layer as one autograd function, with the frozen base weight in bf16 or in FP8 (issue 14).

peft computes `base(x) + lora_B(lora_A(x)) * scale` as four modules, `FrozenLoRA` as one autograd function, the
scale applied where the tensors are small ([tokens, r]):

    forward   xs = (x A^T) s                             # [tokens, r]: the only thing kept besides x
              y  = x W^T + xs B^T
    backward  m  = (dy B) s                              # [tokens, r]
              dx = dy W + m A
              dA = m^T x,  dB = dy^T xs

The additions stay plain adds: under `torch.compile` each fuses into the elementwise kernel that follows (`addmm`
was slower on the H200: cuBLAS first copies the full-size addend to the output, 19 ms a 7B step, `s14_profile_fast`).

The base weight is frozen, so its own gradient is never computed. That also makes FP8 cheaper than torchao's
`Float8Linear` (`speedups.apply_fp8`), which quantizes each weight to FP8 again at every forward and backward,
as it must for weights that train: here each frozen weight is quantized once, when the adapters are attached
(`attach(model, fp8=True)`), in the two layouts the two matmuls need — scaled per output row for the forward,
per input column for the input gradient. Activations (x, dy) are scaled per token. Scales are powers of two
and the FP8 format is e4m3, as torchao's rowwise recipe. The LoRA branch stays in bf16. The cost: both FP8 copies
stay in memory beside the bf16 weights (one byte a weight each), which merging and export still use.

Sibling layers that read the same input (q/k/v of attention, gate/up of the MLP: `GROUPS`) are computed as one
(`GroupLoRA`): their frozen weights concatenated (the members' weights become views of it, no copy), so the input
is read, and in FP8 quantized, once, one matmul produces all the outputs and, in the backward, one matmul whose
inner dimension runs over every output sums their input gradients (no separate adds). The adapters' A matrices
are stacked and the B matrices form one block-diagonal matrix, so the LoRA branch is one matmul each way too.
The model's code is unchanged: the first member called computes the group and leaves its siblings' outputs for
their own calls with the same input tensor; a sibling called with another input computes alone. v has storage of
its own (`KEPT_APART`; as a view it kept the whole q/k/v output, +4.3 GB on the H200, `s14_lora_group*`). On an H100
the grouped 7B step was 1.03x at the same memory (`s35_lora_group_b4` vs `s35_lora_fast_b4`): `tunekit train`
groups by default (`--fast-lora-group`), `attach` when asked (`group=True`).

A QLoRA base (bitsandbytes' 4-bit `Linear4bit`) keeps its 4-bit codes and nothing else: `FrozenLoRA4bit` reads them
(`nf4.dequantize`) where each matmul needs the weight, and with FP8 into FP8 straight away, so QLoRA's memory gets
FP8's matmuls. 4-bit layers are not grouped.

`attach` swaps the forward of each peft LoRA `Linear` (a plain `nn.Linear` or 4-bit base, frozen with its bias if
it has one, one adapter, no dropout) for this one; the parameters, the saved adapter and `merge_and_unload` are
peft's, unchanged. A merged or disabled adapter goes back to peft's forward. tests/unit/test_fastlora.py checks the
loss and gradients against peft's path: equal in fp32, within FP8's rounding with FP8.
"""

from __future__ import annotations

import types

import torch

from tunekit import nf4

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in FP8 e4m3, the fp32 factor that undoes it) with one scale per slice along `dim` (the amax is taken
    over `dim`): `dim=-1` scales each row. The scale is a power of two, so applying and undoing it is exact."""
    amax = t.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    q = (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale.reciprocal()


def fp8_matmul_available(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def mm8(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype,
        fast_accum: bool) -> torch.Tensor:
    """(a * a_inv) @ (b * b_inv) for FP8 `a` [M, K] scaled per row ([M, 1]) and `b` [K, N] scaled per column
    ([1, N]), in `out_dtype`. On a GPU with FP8 tensor cores one `torch._scaled_mm` (`b` column-major); elsewhere
    the same numbers dequantized and multiplied in fp32 (CPU tests check the arithmetic with it)."""
    if fp8_matmul_available(a.device):
        return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype, use_fast_accum=fast_accum)
    return ((a.float() * a_inv) @ (b.float() * b_inv)).to(out_dtype)


# With FP8 base weights the LoRA products are batch-of-one `bmm`s: inductor folds the addition after an `mm` into
# `addmm` where a user of the sum is not elementwise (attention's inputs, views before RoPE), and cuBLAS's `addmm`
# first copies the full-size addend to its output; after a `bmm` the addition stays elementwise and fuses. Same
# numbers. False: plain `mm` (the command line sets it from TUNEKIT_LORA_BMM=0; a script sets it here).
LORA_BMM = True
# With bf16 weights the base product is an `mm` too, so the fold only moves onto it (11.6 ms of copies in the
# H100's 466 ms grouped 7B step, `s31_profile_lora_group`); True (TUNEKIT_BF16_BMM=1): base and LoRA products
# both as `bmm`, leaving no `mm` to fold into. Same numbers; off until timed on a GPU.
BF16_BMM = False
# FP8 input gradients accumulate fast, as the forward's: 1.02-1.04x the 7B step, whole runs inside bf16's band
# (`l5c_fp8fast_s*`); False (TUNEKIT_FP8_FAST_ACCUM=0): full precision, as torchao's rowwise (`l5c_fp8_s*`).
FAST_ACCUM_BACKWARD = True


def _mm(a: torch.Tensor, b: torch.Tensor, bmm: bool) -> torch.Tensor:
    """a @ b, as a batch-of-one `bmm` where `bmm` (`LORA_BMM`, `BF16_BMM`)."""
    return torch.bmm(a.unsqueeze(0), b.unsqueeze(0)).squeeze(0) if bmm else a @ b


def _lora_forward(ctx, x, weight, w8, w8_inv, a, b, scale: float):
    """`x W^T + (x A^T) s B^T` for `FrozenLoRA` and `GroupLoRA` (`a`, `b` already in x's dtype): (the output,
    x as [tokens, in], xs = (x A^T) s), the shapes kept on `ctx`; each function saves what its backward needs."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if w8 is not None:
        xq, x_inv = quantize(x2, -1)
        out = mm8(xq, x_inv, w8.t(), w8_inv, x.dtype, fast_accum=True)
    else:
        out = _mm(x2, weight.to(x.dtype).t(), BF16_BMM)
    xs = (x2 @ a.t()) * scale  # [tokens, r]: scaled here, where it is small
    out = out + _mm(xs, b.t(), LORA_BMM if w8 is not None else BF16_BMM)  # under compile: fused into the next kernel
    ctx.scale, ctx.shape = scale, shape
    return out.reshape(*shape[:-1], out.shape[-1]), x2, xs


def _lora_backward(ctx, dy, x2, xs, weight, w8t, w8t_inv, a, b):
    """(dx, dA, dB) of `_lora_forward`, in dy's dtype (`a`, `b` in it too)."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    m = (dy2 @ b) * ctx.scale  # [tokens, r]
    if w8t is not None:
        dq, d_inv = quantize(dy2, -1)
        dx = mm8(dq, d_inv, w8t.t(), w8t_inv, dy.dtype, fast_accum=FAST_ACCUM_BACKWARD)
    else:
        dx = _mm(dy2, weight.to(dy.dtype), BF16_BMM)
    dx = dx + _mm(m, a, LORA_BMM if w8t is not None else BF16_BMM)
    return dx.reshape(ctx.shape), m.t() @ x2, dy2.t() @ xs


class FrozenLoRA(torch.autograd.Function):
    """`x W^T + (x A^T) B^T * scale` with W frozen; W in FP8 when `w8` (W scaled per output row, [out, in],
    factors [1, out]) and `w8t` (W scaled per input column, stored transposed, [in, out], factors [1, in]) are
    given."""

    @staticmethod
    def forward(ctx, x, weight, w8, w8_inv, w8t, w8t_inv, lora_a, lora_b, scale: float):
        out, x2, xs = _lora_forward(ctx, x, weight, w8, w8_inv, lora_a.to(x.dtype), lora_b.to(x.dtype), scale)
        ctx.save_for_backward(x2, xs, weight, w8t, w8t_inv, lora_a, lora_b)
        return out

    @staticmethod
    def backward(ctx, dy):
        x2, xs, weight, w8t, w8t_inv, lora_a, lora_b = ctx.saved_tensors
        dx, grad_a, grad_b = _lora_backward(ctx, dy, x2, xs, weight, w8t, w8t_inv, lora_a.to(dy.dtype),
                                            lora_b.to(dy.dtype))
        return dx, None, None, None, None, None, grad_a.to(lora_a.dtype), grad_b.to(lora_b.dtype), None


class FrozenLoRA4bit(torch.autograd.Function):
    """`FrozenLoRA` over a bitsandbytes 4-bit base (QLoRA): W read from its codes (`nf4.dequantize`) where each
    matmul needs it, in the forward and again in the backward, never kept; with `fp8` quantized from there to FP8
    in the layout that matmul needs (per output row forward, per input column backward). `q`: `nf4.tensors(base)`."""

    @staticmethod
    def forward(ctx, x, shape, fp8: bool, scale: float, lora_a, lora_b, *q):
        w = nf4.dequantize(*q, *shape, torch.float32 if fp8 else x.dtype)
        w8, w8_inv = fp8_rows(w) if fp8 else (None, None)
        out, x2, xs = _lora_forward(ctx, x, w, w8, w8_inv, lora_a.to(x.dtype), lora_b.to(x.dtype), scale)
        ctx.save_for_backward(x2, xs, lora_a, lora_b, *q)
        ctx.qshape, ctx.fp8 = shape, fp8
        return out

    @staticmethod
    def backward(ctx, dy):
        x2, xs, lora_a, lora_b, *q = ctx.saved_tensors
        q = nf4.tied_to(dy, *q) if torch.compiler.is_compiling() else q  # read here, not kept from the forward
        w = nf4.dequantize(*q, *ctx.qshape, torch.float32 if ctx.fp8 else dy.dtype)
        w8t, w8t_inv = fp8_columns(w) if ctx.fp8 else (None, None)
        dx, grad_a, grad_b = _lora_backward(ctx, dy, x2, xs, w, w8t, w8t_inv, lora_a.to(dy.dtype),
                                            lora_b.to(dy.dtype))
        return (dx, None, None, None, grad_a.to(lora_a.dtype), grad_b.to(lora_b.dtype)) + (None,) * len(q)


class GroupLoRA(torch.autograd.Function):
    """Several LoRA linears over one input as one: `x W^T + (x A^T) s B^T` with W the members' frozen weights
    concatenated by rows ([sum out, in]), A their adapters' A stacked ([sum r, in]) and B theirs as one
    block-diagonal matrix ([sum out, sum r]); one output [..., sum out]. FP8 as `FrozenLoRA` (`w8`, `w8t` are the
    concatenated weight's two quantized layouts). `loras` is (A1, B1, A2, B2, ...). In the backward the input
    gradients of all members are summed inside one matmul, and block-diagonal B keeps each member's rows apart."""

    @staticmethod
    def forward(ctx, x, weight, w8, w8_inv, w8t, w8t_inv, scale: float, *loras):
        a = torch.cat([t.to(x.dtype) for t in loras[0::2]])  # [sum r, in]
        b = torch.block_diag(*[t.to(x.dtype) for t in loras[1::2]])  # [sum out, sum r]
        out, x2, xs = _lora_forward(ctx, x, weight, w8, w8_inv, a, b, scale)
        ctx.save_for_backward(x2, xs, weight, w8t, w8t_inv, a, b, *loras)
        return out

    @staticmethod
    def backward(ctx, dy):
        x2, xs, weight, w8t, w8t_inv, a, b, *loras = ctx.saved_tensors
        dx, grad_a, grad_b = _lora_backward(ctx, dy, x2, xs, weight, w8t, w8t_inv, a, b)
        grads, row, col = [], 0, 0  # grad_b [sum out, sum r]: only its diagonal blocks are the members'
        for lora_a, lora_b in zip(loras[0::2], loras[1::2]):
            out_f, r = lora_b.shape
            grads += [grad_a[col:col + r].to(lora_a.dtype), grad_b[row:row + out_f, col:col + r].to(lora_b.dtype)]
            row, col = row + out_f, col + r
        return dx, None, None, None, None, None, None, *grads


def _autocast_input(x: torch.Tensor) -> torch.Tensor:
    """What autocast would have made of a linear layer's input."""
    return x.to(torch.get_autocast_dtype(x.device.type)) if torch.is_autocast_enabled(x.device.type) else x


class Group:
    """Sibling LoRA linears of one module that read the same input (`GROUPS`), computed by `GroupLoRA`. Not a
    module (the members are already the parent's); its tensors are non-persistent buffers of the parent."""

    def __init__(self, parent, names: tuple[str, ...]):
        self.parent = parent
        self.members = [getattr(parent, n) for n in names]
        self.sizes, self.apart = [m.base_layer.out_features for m in self.members], [n in KEPT_APART for n in names]
        self.pending: dict | None = None  # {member index: output} left by the first member's call, and "x"

    def usable(self) -> bool:
        return all(not m.disable_adapters and not m.merged and m.active_adapters == self.members[0].active_adapters
                   for m in self.members) and len(self.members[0].active_adapters) == 1

    def output(self, member, x):
        """`member`'s output for `x`: left by a sibling's call with this very tensor, else the group computed now
        (its siblings' outputs kept for their calls)."""
        i = self.members.index(member)
        pending = self.pending
        if pending is not None and pending["x"] is x and i in pending:
            out = pending.pop(i)
            if len(pending) == 1:
                self.pending = None
            return out
        name = self.members[0].active_adapters[0]
        p = self.parent
        loras = [t for m in self.members for t in (m.lora_A[name].weight, m.lora_B[name].weight)]
        w8 = [getattr(p, f"tk_group_{t}", None) for t in FP8_BUFFERS]  # None for bf16 weights
        out = GroupLoRA.apply(_autocast_input(x), p.tk_group_w, *w8, self.members[0].scaling[name], *loras)
        if (bias := getattr(p, "tk_group_b", None)) is not None:
            out = out + bias.to(out.dtype)
        outs = [o.contiguous() if apart else o for o, apart in zip(out.split(self.sizes, dim=-1), self.apart)]
        self.pending = {"x": x, **{j: o for j, o in enumerate(outs) if j != i}}
        return outs[i]


def _forward(self, x, *args, **kwargs):
    """A peft LoRA Linear's forward through `FrozenLoRA`; peft's own when merged, disabled or not this case."""
    if self.disable_adapters or self.merged or args or kwargs or len(self.active_adapters) != 1:
        return self._peft_forward(x, *args, **kwargs)
    group = getattr(self, "tk_group", None)
    if group is not None and group.usable():
        return group.output(self, x)
    name = self.active_adapters[0]
    base = self.base_layer
    if (shape := getattr(base, "tk_nf4_shape", None)) is not None:  # a 4-bit base
        q = [getattr(base, f"tk_nf4_{t}") for t in NF4_TENSORS]
        out = FrozenLoRA4bit.apply(_autocast_input(x), shape, base.tk_nf4_fp8, self.scaling[name],
                                   self.lora_A[name].weight, self.lora_B[name].weight, *q)
    else:
        w8 = [getattr(base, f"tk_{t}", None) for t in FP8_BUFFERS]
        out = FrozenLoRA.apply(_autocast_input(x), base.weight, *w8, self.lora_A[name].weight,
                               self.lora_B[name].weight, self.scaling[name])
    # A frozen base bias (Qwen2's q/k/v) is added outside: it needs no gradient, and under compile the add fuses
    return out if base.bias is None else out + base.bias.to(out.dtype)


def why_not(module) -> str:
    """'' when `module` (a peft LoRA Linear) can take the fused forward, else why not."""
    if nf4.is_4bit(module.base_layer):
        if why := nf4.why_not(module.base_layer):
            return why
    elif type(module.base_layer) is not torch.nn.Linear:
        return f"its base is {type(module.base_layer).__name__}, not a plain nn.Linear or a 4-bit Linear4bit"
    if module.base_layer.bias is not None and module.base_layer.bias.requires_grad:
        return "its base bias trains (peft's bias='all' or 'lora_only'; set bias='none')"
    if module.base_layer.weight.requires_grad:
        return "its base weight trains"
    if len(module.lora_A) != 1 or module.lora_variant:
        return "it holds several adapters or a LoRA variant (DoRA)"
    if not isinstance(next(iter(module.lora_dropout.values())), torch.nn.Identity):
        return "it has LoRA dropout (set lora_dropout 0)"
    return ""


GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # siblings that read one input
KEPT_APART = ("v_proj",)  # kept as it is for attention's backward: its own storage, not a view of all q/k/v
NF4_TENSORS = ("codes", "table", "absmax", "table2", "absmax2", "offset")  # nf4.tensors, as buffers of the base
FP8_BUFFERS = ("w8", "w8_inv", "w8t", "w8t_inv")  # `_register_fp8`'s, after a prefix


def _groups(model, layers) -> list[Group]:
    """The `GROUPS` found among `layers`: siblings of one parent, all fused, with one input size, dtype and
    device, the same adapter and the same scale."""
    fused = {id(m) for _, m in layers if not nf4.is_4bit(m.base_layer)}  # 4-bit layers stay apart
    out = []
    for parent in model.modules():
        for names in GROUPS:
            members = [getattr(parent, n, None) for n in names]
            if not all(id(m) in fused for m in members):
                continue
            w = [m.base_layer.weight for m in members]
            if len({m.base_layer.bias is None for m in members}) == 1 and len(
                    {(t.shape[1], t.dtype, t.device) for t in w}) == 1 and len(
                    {(tuple(m.active_adapters), m.scaling.get(m.active_adapters[0])) for m in members}) == 1:
                out.append(Group(parent, names))
    return out


@torch.no_grad()
def attach(model, fp8: bool = False, group: bool = False) -> str:
    """Give every peft LoRA Linear of `model` the fused forward (in place); with `fp8`, quantize each frozen
    base weight to FP8 once, in both layouts (non-persistent buffers: not saved); with `group`, compute the
    `GROUPS` of siblings as one (their weights concatenated, the members' weights views of it: `detach` before
    saving a merged model, as `model.merge_adapter` does). Attach after the model is on its device and before
    FSDP2 shards it (with FSDP2, pass group=False). Returns what it did. A layer that cannot take it is an
    error naming it and why."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.lora.layer import LoraLayer

    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLinear) or (
        isinstance(m, LoraLayer) and nf4.is_4bit(getattr(m, "base_layer", None)))]  # peft's lora.bnb.Linear4bit
    if not layers:
        raise ValueError("fast_lora: the model has no peft LoRA linear layers (method lora attaches them)")
    for name, m in layers:
        if why := why_not(m):
            raise ValueError(f"fast_lora: layer {name}: {why}")
    if fp8 and not fp8_matmul_available(layers[0][1].base_layer.weight.device):
        raise RuntimeError("fast_lora with fp8: FP8 matmuls need a CUDA GPU of compute capability 8.9+ (Ada, Hopper)")
    if fp8:
        for name, m in layers:
            base = m.base_layer
            if base.in_features % 16 or base.out_features % 16:
                base_model = model.get_base_model() if hasattr(model, "get_base_model") else model
                raise ValueError(f"fp8: layer {name} of {type(base_model).__name__} is {base.in_features} -> "
                                 f"{base.out_features}, and FP8 matmuls need both dimensions multiples of 16: "
                                 "train this model without fp8 (the fused LoRA in bf16), or leave the layer out "
                                 "of the LoRA targets (--lora-targets)")
    groups = _groups(model, layers) if group else []
    grouped = {id(m) for g in groups for m in g.members}
    for g in groups:
        weight = torch.cat([m.base_layer.weight for m in g.members])  # [sum out, in]
        g.parent.register_buffer("tk_group_w", weight, persistent=False)
        if g.members[0].base_layer.bias is not None:  # Qwen2's q/k/v: the members' biases, concatenated
            g.parent.register_buffer("tk_group_b", torch.cat([m.base_layer.bias for m in g.members]),
                                     persistent=False)
        row = 0
        for m in g.members:  # the members' weights become views of the concatenated one: no second copy
            w = m.base_layer.weight
            m.base_layer.weight = torch.nn.Parameter(weight[row:row + w.shape[0]], requires_grad=False)
            row += w.shape[0]
            m.tk_group = g
        if fp8:
            _register_fp8(g.parent, weight, "tk_group_")
    for _, m in layers:
        if nf4.is_4bit(base := m.base_layer):  # read from its codes at each use (in FP8 too): nothing stored
            for t, tensor in zip(NF4_TENSORS, nf4.tensors(base)):
                base.register_buffer(f"tk_nf4_{t}", tensor, persistent=False)
            base.tk_nf4_shape, base.tk_nf4_fp8 = nf4.shape_of(base), fp8
        elif fp8 and id(m) not in grouped:
            _register_fp8(m.base_layer, m.base_layer.weight, "tk_")
        m._peft_forward = m.forward
        m.forward = types.MethodType(_forward, m)
    if any(nf4.is_4bit(m.base_layer) for _, m in layers):
        kind = "4-bit NF4, read " + ("into FP8 (e4m3, per-row scales) at each use" if fp8 else "at each use")
    else:
        kind = "FP8 (e4m3, per-row scales, quantized once)" if fp8 else str(layers[0][1].base_layer.weight.dtype)[6:]
    grouped_note = f", {len(groups)} groups of siblings computed as one" if groups else ""
    return f"fused LoRA in {len(layers)} linear layers{grouped_note}, frozen base weights {kind}"


def _register_fp8(module, weight, prefix: str) -> None:
    """`weight` in FP8 on `module` in both layouts (`fp8_rows`, `fp8_columns`), as non-persistent buffers."""
    for name, t in zip(FP8_BUFFERS, (*fp8_rows(weight), *fp8_columns(weight))):
        module.register_buffer(prefix + name, t, persistent=False)


def fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [out, in] in FP8 as the forward's matmul reads it: scaled per output row, factors [1, out]."""
    w8, inv = quantize(weight, -1)
    return w8, inv.t().contiguous()


def fp8_columns(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [out, in] in FP8 as the input gradient's matmul reads it: scaled per input column and stored
    transposed, [in, out], factors [1, in]."""
    w8t, inv = quantize(weight, 0)
    return w8t.t().contiguous(), inv


@torch.no_grad()
def detach(model) -> int:
    """Undo `attach`: peft's forward back on every layer, each grouped member's weight its own tensor again (a
    merged model saves each weight once), the FP8 and concatenated buffers freed. Returns the layers restored."""
    n = 0
    for module in model.modules():
        for name in [b for b, _ in module.named_buffers(recurse=False) if b.startswith("tk_")]:
            delattr(module, name)
        for name in ("tk_nf4_shape", "tk_nf4_fp8"):
            vars(module).pop(name, None)
        if "_peft_forward" in vars(module):
            del module.forward, module._peft_forward  # the class's forward again
            n += 1
        if "tk_group" in vars(module):
            del module.tk_group
            w = module.base_layer.weight
            module.base_layer.weight = torch.nn.Parameter(w.detach().clone(), requires_grad=w.requires_grad)
    return n
