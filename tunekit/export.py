"""What a finished run leaves, made usable: its adapter merged into a plain bf16 model (checked against the
unmerged one), and text generated with it.

A LoRA/QLoRA run saves a PEFT adapter in `<run>/adapter`; `merge_run` rebuilds the run's base model in bf16
(the hub or local model it named, or its random-init weights, rebuilt from the seed on the device it trained
on), attaches the adapter, folds it into the weights (`model.merge_adapter`), saves the result where
`from_pretrained` reads it, reloads it and compares its logits with the unmerged model's. A QLoRA adapter
merges into the bf16 weights the 4-bit ones were quantized from. `generate` answers prompts with the run's
model, greedily.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tunekit import data
from tunekit import model as mdl
from tunekit.config import TuneConfig, load_config


def run_config(run_dir: str | Path) -> TuneConfig:
    return load_config(Path(run_dir) / "config.json")


def run_tokenizer(cfg: TuneConfig, run_dir: str | Path):
    """The tokenizer the run trained with: saved with its prepared data, or made again as training made it."""
    from tunekit.train import build_tokenizer

    saved = Path(run_dir) / "prepared" / "tokenizer"
    return mdl.load_tokenizer(str(saved)) if saved.exists() else build_tokenizer(cfg)


def base_model_of(cfg: TuneConfig, vocab_size: int, device: str, dtype: torch.dtype = torch.bfloat16):
    """The run's base model in `dtype`, never 4-bit: the model it named, or its random-init weights (QLoRA: the
    saved random-init checkpoint its 4-bit load read; LoRA: rebuilt from the seed, as training built it)."""
    from tunekit.train import run_arch

    arch = run_arch(cfg, vocab_size)
    if cfg.model:
        return mdl.build_model(None, cfg.model, dtype, device)
    if cfg.method == "qlora":
        return mdl.build_model(None, str(mdl.save_random_init(arch, torch.bfloat16, cfg.seed)), dtype, device)
    # Random init draws differ by device and dtype: draw as training did (its config.json has both resolved)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{cfg.out_dir} trained a random-init model on a GPU: its base weights can only be "
                           "drawn again there (CUDA's random numbers); run this on a CUDA machine")
    trained = mdl.build_model(arch, "", mdl.resolve_dtype(cfg.dtype, cfg.device), cfg.device, seed=cfg.seed)
    return mdl.cast_weights(trained.to(device), dtype)


def load_run(run_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.bfloat16):
    """(the run's model — base in `dtype` with its adapter attached, in eval mode — its tokenizer, its config).
    A full fine-tune's saved model is loaded as it is."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    tokenizer = run_tokenizer(cfg, run_dir)
    if cfg.method == "full":
        if not (run_dir / "model" / "config.json").exists():
            raise FileNotFoundError(f"{run_dir}/model: no saved model; the run has not finished (resume it)")
        return mdl.build_model(None, str(run_dir / "model"), dtype, device).eval(), tokenizer, cfg
    if not (run_dir / "adapter" / "adapter_config.json").exists():
        raise FileNotFoundError(f"{run_dir}/adapter: no saved adapter; the run has not finished (resume it)")
    base = base_model_of(cfg, len(tokenizer), device, dtype)
    return mdl.load_adapter(base, run_dir / "adapter").eval(), tokenizer, cfg


@torch.no_grad()
def merge_run(run_dir: str | Path, out_dir: str | Path | None = None, device: str = "cpu",
              dtype: torch.dtype = torch.bfloat16, tokens: int = 128, seed: int = 0) -> dict:
    """Merge the run's adapter into its base in `dtype`, save it to `out_dir` (default `<run>/merged`), reload
    it with `from_pretrained`, and compare the logits of 2 x `tokens` random tokens: unmerged, merged, reloaded.
    Returns the folder and the largest logit differences (relative to the largest logit): in bf16 the merge
    rounds W + BA into bf16 once where the unmerged model adds two matmuls' results, so the two differ by
    bf16's rounding (about 1e-2 on a tiny model; more through 32 random-init layers, which amplify it); the
    reloaded model is the merged one exactly. Below fp32, both are also compared with the same weights and
    adapter computed in fp32 (`adapter_vs_fp32`, `merged_vs_fp32`): how much of the fine-tune each keeps."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    if cfg.method == "full":
        raise ValueError(f"{run_dir} is a full fine-tune: its model folder is already the whole model")

    def random_ids(tokenizer) -> torch.Tensor:  # the same tokens for every model compared
        return torch.randint(0, len(tokenizer), (2, tokens), generator=torch.Generator().manual_seed(seed)).to(device)

    reference = None
    if dtype != torch.float32:  # the same weights and adapter computed in fp32: what both bf16 models approximate
        model, tokenizer, _ = load_run(run_dir, device, torch.float32)
        reference = model(input_ids=random_ids(tokenizer)).logits.float()
        del model  # freed before the model in `dtype` is built
        if device == "cuda":
            torch.cuda.empty_cache()
    model, tokenizer, _ = load_run(run_dir, device, dtype)
    ids = random_ids(tokenizer)
    out = Path(out_dir) if out_dir else run_dir / "merged"
    want = model(input_ids=ids).logits.float()
    merged = mdl.merge_adapter(model, out, dtype)
    tokenizer.save_pretrained(str(out))
    got = merged(input_ids=ids).logits.float()
    reloaded = mdl.build_model(None, str(out), dtype, device).eval()(input_ids=ids).logits.float()
    scale = want.abs().max().item()

    def apart(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a - b).abs().max().item() / scale

    r = {"merged_dir": str(out), "dtype": str(dtype).removeprefix("torch."),
         "merged_vs_adapter": apart(got, want), "reloaded_vs_merged": apart(reloaded, got)}
    if reference is not None:
        r.update(adapter_vs_fp32=apart(want, reference), merged_vs_fp32=apart(got, reference))
    return r


@torch.no_grad()
def generate(run_dir: str | Path, prompts: list[str], max_new_tokens: int = 64, device: str = "cpu",
             dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Greedy continuations of `prompts` by the run's model (its BOS first, as in training), one at a time."""
    model, tokenizer, _ = load_run(run_dir, device, dtype)
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        if tokenizer.bos_token_id is not None:
            ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), ids], dim=1)
        ids = ids.to(device)
        new = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:]
        out.append(tokenizer.decode(new, skip_special_tokens=True))
    return out


def prompts_from(source: str, n: int = 3, fields: str = "") -> list[tuple[str, str]]:
    """(prompt, reference answer) of the first `n` records of a dataset, the prompt as training renders it."""
    records = data.load_records(source, fields=fields)
    prompt_fields, response_field = data.detect_layout(records.column_names, source)
    return [(data.format_prompt(records[i], prompt_fields), records[i][response_field]) for i in range(min(n, len(records)))]
