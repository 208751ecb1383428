"""What a config may hold, checked as a whole: each field's type, the choices of each choice field, and the rules
that tie fields together (QLoRA's base layers are 4-bit, so no FP8; offload needs checkpointing; ...). Every
failure is a `ConfigError` naming the field, its value and what to do. `TuneConfig.validate` runs `check`.
"""

from __future__ import annotations

import dataclasses
import math
import typing

from tunekit.data.layouts import DataError, parse_fields

METHODS = ("full", "lora", "qlora")
DTYPES = ("auto", "bf16", "fp16", "fp32")
ATTENTION = ("auto", "sdpa", "eager", "flash_attention_2", "flex_attention")
PACKING = ("auto", "pad", "group", "pack")
DEVICES = ("auto", "cpu", "cuda")
LOSSES = ("chunked", "plain", "liger")
# optim.OPTIMIZER_NOTES says what each is
OPTIMIZERS = ("adamw", "adamw_foreach", "adamw8bit", "paged_adamw", "paged_adamw8bit", "lion", "lion_pytorch",
              "lion8bit")
COMPILE = ("none", "regional", "model")
KERNELS = ("none", "liger")
SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")
PARALLEL = ("auto", "ddp", "fsdp")
TOKENIZE = ("offline", "in_loop")
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")


class ConfigError(ValueError):
    """A config value is wrong; the message names the field and what to do."""


TYPE_WORDS = {int: "int (a whole number, e.g. 8)", float: "float (a number, e.g. 3e-4)", bool: "bool (true or false)",
              str: "str (text)"}


def types_of(cls: type) -> dict[str, type]:
    """{field: its type} of the dataclass `cls`, in the fields' order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def check(cfg) -> None:
    """Raise `ConfigError` on the first thing wrong with `cfg` (a `TuneConfig`): the types first, so the rules
    after them compare like with like; an int given for a float field is made a float."""
    def need(cond: bool, fieldname: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"config field '{fieldname}' = {getattr(cfg, fieldname)!r}: {msg}")

    for name, typ in types_of(type(cfg)).items():  # first the types, so the checks below compare like with like
        value = getattr(cfg, name)
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            setattr(cfg, name, float(value))  # 1 is 1.0
        elif not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            hint = "; pass records with finetune(cfg, data=...)" if name == "data" else ""
            raise ConfigError(f"config field '{name}' = {value!r}: expected {TYPE_WORDS[typ]}{hint}")

    for name, choices in (("method", METHODS), ("arch", ARCHS), ("dtype", DTYPES), ("attention", ATTENTION),
                          ("device", DEVICES), ("packing", PACKING), ("loss", LOSSES), ("optimizer", OPTIMIZERS),
                          ("parallel", PARALLEL), ("compile", COMPILE), ("tokenize", TOKENIZE),
                          ("kernels", KERNELS)):
        need(getattr(cfg, name) in choices, name, f"choose one of {', '.join(choices)}")
    need(cfg.tokenize == "offline" or cfg.packing == "pad", "tokenize",
         "in_loop tokenizes each batch as it is read, so its lengths are unknown before: use --packing pad")
    names = [b.strip() for b in cfg.sdpa_backend.split(",")]
    need(cfg.sdpa_backend == "auto" or (all(names) and set(names) <= set(SDPA_BACKENDS)), "sdpa_backend",
         f"use auto or a comma-separated list of {', '.join(SDPA_BACKENDS)}")
    need(cfg.compile != "none" or not cfg.compile_recompute, "compile_recompute",
         "tells the compiler what to recompute: add --compile regional (or model)")
    need(cfg.grad_ckpt or not cfg.grad_ckpt_offload, "grad_ckpt_offload",
         "offloads what checkpointing saves; turn on --grad-ckpt too")
    need(cfg.method != "full" or not cfg.embed_offload, "embed_offload",
         "only a frozen embedding table can live on the CPU; use it with --method lora or qlora")
    need(cfg.method != "qlora" or not cfg.fp8 or cfg.fast_lora, "fp8", "QLoRA's 4-bit base layers go to FP8 "
         "only through the fused LoRA, which reads their codes into FP8 at each use: add --fast-lora")
    need(cfg.method in ("lora", "qlora") or not cfg.fast_lora, "fast_lora", "fuses LoRA with its frozen base "
         "weight; use it with --method lora or qlora")
    need(cfg.lora_dropout == 0 or not cfg.fast_lora, "fast_lora", "has no LoRA dropout; set --lora-dropout 0")
    need(cfg.method == "qlora" or not cfg.peft_kbit_prepare, "peft_kbit_prepare",
         "applies to 4-bit models only; use it with --method qlora")
    need(cfg.prefetch_factor > 0, "prefetch_factor", "must be a positive integer")
    if cfg.fields:
        try:
            parse_fields(cfg.fields)
        except DataError as e:
            raise ConfigError(f"config field 'fields' = {cfg.fields!r}: {e}") from None
    need(bool(cfg.response_template) or not cfg.instruction_template, "instruction_template",
         "marks where each user turn starts, for response_template; set --response-template too")
    need(bool(cfg.chat_template.strip()), "chat_template",
         "use auto, builtin, tokenizer, chatml or a Jinja template file")
    need(cfg.bench_max_steps >= cfg.bench_steps, "bench_max_steps", "must be at least bench_steps")
    need(0 <= cfg.bench_target_error < 1, "bench_target_error", "must be in [0, 1)")
    for name in ("batch_size", "grad_accum", "max_length", "max_steps", "log_every",
                 "bench_steps", "hidden_size", "num_layers", "num_heads", "intermediate_size"):
        need(getattr(cfg, name) > 0, name, "must be a positive integer")
    for name in ("num_workers", "save_every", "warmup_steps", "bench_warmup", "num_kv_heads", "vocab_size",
                 "cpu_threads", "global_batch", "head_dim"):
        need(getattr(cfg, name) >= 0, name, "must be zero or positive")
    need(cfg.lr > 0, "lr", "must be positive")
    need(math.isfinite(cfg.epochs) and cfg.epochs >= 0, "epochs", "must be zero (use max_steps) or a positive number")
    need(math.isfinite(cfg.lr), "lr", "must be a finite number")
    need(0 <= cfg.eval_split < 1, "eval_split", "a fraction of the rows: at least 0, below 1")
    need(cfg.eval_every >= 0 or (cfg.eval_every == -1 and cfg.epochs > 0), "eval_every",
         "must be zero (at the end only), positive (steps), or -1 (each epoch) with --epochs")
    need(cfg.eval_split > 0 or bool(cfg.eval_data) or not cfg.eval_every, "eval_every",
         "evaluates held-out rows: set --eval-split or --eval-data too")
    need(not (cfg.eval_split and cfg.eval_data), "eval_data", "holds out its own rows: drop --eval-split")
    need(cfg.keep_checkpoints >= 1, "keep_checkpoints", "must be at least 1")
    need(0 <= cfg.min_lr_ratio <= 1, "min_lr_ratio", "must be between 0 and 1")
    need(0 <= cfg.lora_dropout < 1, "lora_dropout", "must be in [0, 1)")
    if cfg.method != "full":
        need(cfg.lora_r > 0, "lora_r", "LoRA/QLoRA need a positive rank")
        need(cfg.lora_alpha > 0, "lora_alpha", "the update is scaled by lora_alpha / lora_r, so a scale of "
             "0 or less trains nothing useful; use a positive value (commonly 2 * lora_r)")
    need(cfg.head_dim or not cfg.hidden_size % cfg.num_heads, "hidden_size", "must be divisible by num_heads")
    if cfg.num_kv_heads:
        need(cfg.num_heads % cfg.num_kv_heads == 0, "num_kv_heads", "must divide num_heads")
    need(cfg.tokenizer_vocab >= 256 + 8, "tokenizer_vocab", "a byte-level BPE needs at least 264 entries")
