"""tunekit's speed-ups for a model and a training loop you built: `speed_up` and `PackingCollator`.

Most fine-tuning scripts already exist: a `transformers` model, perhaps a peft LoRA adapter, and a
`transformers.Trainer` or TRL's `SFTTrainer`. `speed_up(model)` applies to that model what `tunekit train` applies
to its own (`build.apply_techniques`), in the same order, and returns the same object:

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, device_map="cuda")
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    model = tunekit.speed_up(model, compile="regional")
    trainer = SFTTrainer(model=model, args=SFTConfig(..., gradient_checkpointing=False),
                         data_collator=tunekit.PackingCollator(tokenizer.pad_token_id, max_length=2048), ...)

Each switch is named as in `TuneConfig`. `"auto"` (the default of the first two) applies it where it can and says
why not where it cannot; asking for it outright (`fast_lora=True`, `loss="chunked"`) makes a model it does not
suit an error that says why:

- `fast_lora`: each peft LoRA linear layer as one autograd function (`fastlora.attach`); `fp8`: its frozen base
  weight in FP8, quantized once (a GPU of compute capability 8.9+; call after the model is on it), or for a
  4-bit (QLoRA) model read from its codes into FP8 at each use. `"auto"` leaves a 4-bit model on peft's path
  unless `fp8` is asked for.
- `loss`: `chunked` computes the LM head and the cross-entropy a chunk of tokens at a time without holding the
  logits (`loss.chunked_lm_loss`), inside `model(input_ids, labels=...)` as `Trainer` calls it, `num_items_in_batch`
  included. `liger` is Liger's kernel for the same. Only in training: in eval mode, or without labels, the model's
  own forward runs and returns logits, which metrics and `generate` need. (TRL's `SFTTrainer` computes its own
  chunked loss through the backbone, so there this switch changes nothing.)
- `compile="regional"`: each decoder block compiled, one graph shared by all (`speedups.compile_step`).
- `grad_ckpt`, `grad_ckpt_offload`: checkpointing of each block, what it keeps held in CPU memory with offload
  (`memory.apply_gradient_checkpointing`). Leave the trainer's own `gradient_checkpointing` off then: it would
  enable transformers' checkpointing again, without the offload.
- `attention`: the attention implementation (`attention.choose_attention`; `auto` with `packed=True` picks the
  kernel that skips what a document mask rules out).
- `kernels="liger"`: Liger's RMSNorm, RoPE and SwiGLU.

`PackingCollator` is tunekit's packing as a `data_collator`: the samples of a batch packed into rows of
`max_length` tokens, position ids restarting at each sample and no attention mask, so that transformers gives each
sample attention only to itself: the same loss as unpadded samples (tests/unit/test_hf.py).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from tunekit import fastlora, memory, nf4, speedups
from tunekit import loss as loss_fn
from tunekit.attention import choose_attention
from tunekit.data.batching import IGNORE, Collator, plan_packing
from tunekit.model import base_model, decoder_layers

LOSSES = ("auto", "chunked", "liger", "plain")
COMPILES = ("none", "regional")


def speed_up(model, *, fast_lora: bool | str = "auto", fp8: bool = False, loss: str = "auto",
             compile: str = "none", compile_recompute: bool = False, grad_ckpt: bool = False,
             grad_ckpt_offload: bool = False, attention: str | None = None, packed: bool = False,
             kernels: str = "none", verbose: bool = True):
    """Apply tunekit's speed-ups to `model` (a transformers causal LM, with or without a peft adapter), in place,
    and return it. What was applied, and what was not and why, is printed (`verbose`) and kept as
    `model.tunekit_speed_ups` ({switch: what happened}). `compile_recompute` (with `compile`): the compiled
    blocks recompute what the adapters read instead of keeping it (`speedups.compile_step`)."""
    _check_choices(fast_lora, loss, compile, kernels)
    if compile_recompute and compile == "none":
        raise ValueError("speed_up(compile_recompute=True) changes what compiled blocks keep: set compile='regional'")
    base, done = base_model(model), {}
    if attention is not None:
        name, why = choose_attention(attention, _device_kind(model), packed=packed, model_class=type(base))
        base.set_attn_implementation(name)
        done["attention"] = why
    if kernels == "liger":
        done["kernels"] = ", ".join(speedups.apply_liger(base))
    done["fast_lora"] = _fast_lora(model, fast_lora, fp8)
    if grad_ckpt or grad_ckpt_offload:
        memory.apply_gradient_checkpointing(model, offload=grad_ckpt_offload)
        memory.check_checkpointing(model, True)
        done["grad_ckpt"] = "each decoder block" + (", what it keeps offloaded to CPU" if grad_ckpt_offload else "")
    done["loss"] = _loss(model, loss)
    if compile == "regional":
        # A trainer's batches change shape (rows of packed samples, widths of padded ones): each block compiled
        # once for every shape, not again at the second one (a 7B block's compile is tens of seconds)
        speedups.compile_step(model, model, "regional", dynamic=True, recompute=compile_recompute)
        done["compile"] = (f"regional: {len(decoder_layers(model))} decoder blocks, dynamic shapes"
                           + (", recomputing what the adapters read" if compile_recompute else ""))
    model.tunekit_speed_ups = done
    if verbose:
        print("tunekit.speed_up: " + "; ".join(f"{k} {v}" for k, v in done.items()))
    return model


def _check_choices(fast_lora, loss: str, compile: str, kernels: str) -> None:
    if fast_lora not in (True, False, "auto"):
        raise ValueError(f"speed_up(fast_lora={fast_lora!r}): choose True, False or 'auto'")
    if loss not in LOSSES:
        raise ValueError(f"speed_up(loss={loss!r}): choose one of {', '.join(LOSSES)}")
    if compile == "model":
        raise ValueError("speed_up(compile='model'): whole-model compile is tunekit's own step (decoder, head and "
                         "loss as one graph); for a Trainer use compile='regional', or the trainer's own "
                         "torch_compile=True")
    if compile not in COMPILES:
        raise ValueError(f"speed_up(compile={compile!r}): choose one of {', '.join(COMPILES)}")
    if kernels not in ("none", "liger"):
        raise ValueError(f"speed_up(kernels={kernels!r}): choose 'none' or 'liger'")


def _device_kind(model) -> str:
    return next(model.parameters()).device.type


def _fast_lora(model, wanted, fp8: bool) -> str:
    """fastlora.attach where it applies: what it did, or why it was not applied (`wanted="auto"`); an error
    when asked for outright and it cannot (and always for `fp8`, which needs it). `attach` checks every layer
    before it changes any, so a refusal leaves the model as it was."""
    if wanted is False:
        if fp8:
            raise ValueError("speed_up(fp8=True): FP8 base weights are part of the fused LoRA; set fast_lora=True")
        return "off"
    if wanted == "auto" and not fp8 and any(nf4.is_4bit(m) for m in model.modules()):
        return ("not applied (4-bit base layers: the fused LoRA over them in bf16 measured level with peft's path, "
                "0.8 GB less memory at batch 8, s30_qlora_fast; fast_lora=True applies it, fp8=True reads them into FP8)")
    try:
        return fastlora.attach(model, fp8=fp8)
    except ValueError as e:
        why = str(e).removeprefix("fast_lora: ")
        if wanted is True or fp8:
            raise ValueError(f"speed_up(fast_lora{'=True' if wanted is True else ', fp8=True'}): {why}") from None
        return f"not applied ({why})"
    except RuntimeError as e:  # FP8 without a GPU that has FP8 matmuls
        raise RuntimeError(f"speed_up(fp8=True): {e}") from None


def _loss(model, wanted: str) -> str:
    """Swap in the chunked (or Liger's) loss where `wanted` asks and the head allows: what was done, or why not."""
    if wanted == "plain":
        return "plain (the model's own)"
    blocker = loss_fn.fused_loss_blocker(model)
    if blocker and wanted != "auto":
        raise ValueError(f"speed_up(loss={wanted!r}): {blocker}; use loss='plain' for this model")
    if blocker:
        return f"plain: the chunked loss does not apply ({blocker})"
    if wanted == "liger" and (why := speedups.liger_available() or (
            loss_fn.softcap_of(model) and "the model soft-caps its logits, which tunekit's Liger path does not")):
        raise RuntimeError(f"speed_up(loss='liger'): {why}; use loss='chunked' (tunekit's own fused loss)")
    kind = "liger" if wanted == "liger" else "chunked"
    base = base_model(model)
    if not hasattr(base, "_tk_forward"):  # a second speed_up keeps the model's own forward underneath
        base._tk_forward = base.forward
    base._tk_loss = kind
    # The model's own signature, seen through: Trainer keeps the dataset columns its forward names
    base.forward = types.MethodType(functools.wraps(type(base).forward)(_forward), base)
    return f"{kind}: the LM head and cross-entropy together, without the logits, when training with labels"


def _forward(self, *args, labels=None, num_items_in_batch=None, **kwargs):
    """A causal LM's forward whose loss never holds the logits (`speed_up(loss=...)`): with labels, in training,
    the decoder's hidden states go to the chunked loss; the loss is the mean over target tokens, or their sum
    over `num_items_in_batch` when the trainer passes it (its gradient accumulation). Otherwise the model's own
    forward, with the logits."""
    if labels is None or not self.training or not torch.is_grad_enabled():
        given = {"labels": labels, "num_items_in_batch": num_items_in_batch}
        return self._tk_forward(*args, **kwargs, **{k: v for k, v in given.items() if v is not None})
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if args:  # input_ids, as peft and plain calls pass it
        kwargs["input_ids"], *rest = args
        if rest:
            raise TypeError("speed_up's forward takes input_ids positionally and the rest by name")
    for k in ("use_cache", "logits_to_keep", "past_key_values"):
        kwargs.pop(k, None)
    out = self.model(**kwargs, use_cache=False)
    hidden, head = out.last_hidden_state, self.get_output_embeddings().weight
    if torch.is_autocast_enabled(hidden.device.type):  # the head's matmul runs in the autocast dtype, as inside
        hidden = hidden.to(torch.get_autocast_dtype(hidden.device.type))
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE).to(hidden.device)  # shifted, as the model's own loss
    if self._tk_loss == "liger":
        total = speedups.liger_loss(hidden, head.to(hidden.dtype), targets, 1.0)
    else:
        total = loss_fn.chunked_lm_loss(hidden, head, targets, softcap=loss_fn.softcap_of(self),
                                        compiled=loss_fn.compiled_for(self))
    count = num_items_in_batch if num_items_in_batch is not None else (targets != IGNORE).sum().clamp(min=1)
    if torch.is_tensor(count):
        count = count.to(total.device)
    return CausalLMOutputWithPast(loss=total / count, logits=None, hidden_states=out.hidden_states,
                                  attentions=out.attentions)


class PackingCollator:
    """A `data_collator` for `Trainer`/`SFTTrainer` that packs each batch's samples into rows of `max_length`
    tokens (best-fit decreasing: `batching.plan_packing`), every row padded to `max_length` (one shape, for
    `compile`), with `position_ids` restarting at 0 at each sample and no `attention_mask`: transformers then
    masks attention per sample (its `find_packed_sequence_indices`), so each sample sees only itself, at the
    positions it would have alone. The first token of each sample gets the label -100: no sample is trained to
    predict the next. A sample longer than `max_length` is cut to it.

    A sample is a dict with `input_ids` and, optionally, `labels` (otherwise the inputs themselves) and TRL's
    `completion_mask` or `assistant_masks` (with `completion_only`, tokens outside it are not trained on). Rows
    packed already (with `position_ids`, from `data.pack_dataset`) are only padded.

    transformers masks per sample only when the forward runs without a KV cache (with one, samples attend
    across each other): `speed_up`'s loss and TRL run without; a plain `Trainer` on a model of your own needs
    `model.config.use_cache = False`.

    Rows per batch vary with the samples' lengths: set the trainer's batch size to about the samples a row holds
    times the rows you want (GSM8K with a Llama tokenizer: about 14 samples to a row of 2,048)."""

    def __init__(self, pad_id: int, max_length: int = 2048, completion_only: bool = True):
        if pad_id is None:
            raise ValueError("PackingCollator(pad_id=None): the tokenizer has no pad token; pass "
                             "tokenizer.pad_token_id or tokenizer.eos_token_id")
        if max_length < 2:
            raise ValueError(f"PackingCollator(max_length={max_length}): a row needs at least 2 tokens")
        self.max_length, self.completion_only = max_length, completion_only
        self.collate = Collator(pad_id, pad_to_multiple_of=8, pad_to=max_length)

    def sample(self, feature: dict, index: int = 0) -> dict:
        """(input_ids, labels) of one sample, its labels masked outside the completion, cut to `max_length`."""
        if "input_ids" not in feature:
            raise ValueError(f"PackingCollator: sample {index} has no 'input_ids' (its fields: "
                             f"{', '.join(feature)}); tokenize the data first")
        ids = [int(t) for t in feature["input_ids"]][:self.max_length]
        labels = [int(t) for t in feature["labels"]][:self.max_length] if "labels" in feature else list(ids)
        mask = next((feature[k] for k in ("completion_mask", "assistant_masks") if k in feature), None)
        if self.completion_only and mask is not None and "labels" not in feature:
            labels = [t if m else IGNORE for t, m in zip(labels, mask)]
        if len(labels) != len(ids):
            raise ValueError(f"PackingCollator: sample {index} has {len(ids)} input_ids but {len(labels)} labels")
        return {"input_ids": ids, "labels": labels}

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        if features and all("position_ids" in f for f in features):
            rows = [{k: list(f[k])[:self.max_length] for k in ("input_ids", "labels", "position_ids")}
                    for f in features]
        else:
            samples = [s for i, f in enumerate(features) if (s := self.sample(f, i))["input_ids"]]
            rows = [self._row([samples[i] for i in row])
                    for row in plan_packing([len(s["input_ids"]) for s in samples], self.max_length)]
        batch = self.collate(rows)
        batch.pop("attention_mask")
        return batch

    @staticmethod
    def _row(samples: list[dict]) -> dict:
        ids, labels, positions = [], [], []
        for s in samples:
            n = len(s["input_ids"])
            ids += s["input_ids"]
            labels += [IGNORE, *s["labels"][1:]]  # nothing trains across a sample boundary
            positions += range(n)
        return {"input_ids": ids, "labels": labels, "position_ids": positions}
