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

from tunekit import checkpoint, runlock
from tunekit import model as mdl
from tunekit.build import run_arch
from tunekit.config import TuneConfig, load_config
from tunekit.data import prepared
from tunekit.data.layouts import detect_layout, format_prompt
from tunekit.data.records import load_records
from tunekit.hub import check_weights
from tunekit.io import atomic_output, atomic_write_json
from tunekit.prepare import build_tokenizer

# Written into every export folder: what a later export may replace without asking.
EXPORT_RECORD = "export.json"


class Finished(dict):
    """What `tunekit.finetune` returns: the run's summary (a dict, as `summary.json` holds it) and what a script needs
    next, `load()`: the trained model and its tokenizer, read back from the run folder."""

    def load(self, device: str = "cpu", dtype: torch.dtype | None = None):
        """(model, tokenizer) of the finished run: the base with its adapter attached (LoRA, QLoRA) or the whole
        trained model (full), in eval mode, on `device` in `dtype` (default bf16 on a GPU, fp32 on the CPU)."""
        dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
        model, tokenizer, _ = load_run(self["run_dir"], device, dtype)
        return model, tokenizer


def run_config(run_dir: str | Path) -> TuneConfig:
    return load_config(Path(run_dir) / "config.json")


def run_tokenizer(cfg: TuneConfig, run_dir: str | Path):
    """The tokenizer the run trained with: the one saved with its prepared data when its files verify and it
    is the one the run recorded (`data.json`); otherwise made again as training made it, if that gives the
    recorded one (saying so). Another tokenizer would turn the model's ids into other text: refused, naming
    the file."""
    import sys

    run_dir = Path(run_dir)
    want = (prepared.read_record(run_dir) or {}).get("tokenizer_sha256")
    saved = run_dir / "prepared"
    tokenizer, problem = prepared.load_tokenizer(saved, getattr(cfg, "trust_remote_code", False))
    if tokenizer is not None and want not in (None, prepared.tokenizer_digest(tokenizer)):
        tokenizer, problem = None, (f"{saved / 'tokenizer'} is not the tokenizer the run trained with (its digest "
                                    f"differs from the one in {run_dir / prepared.RECORD})")
    if tokenizer is not None:
        return tokenizer
    made = build_tokenizer(cfg)
    if want is None or prepared.tokenizer_digest(made) == want:
        if problem:
            print(f"tokenizer: {problem}; made it again as the run did"
                  f"{', and it is the one the run recorded' if want else ''}", file=sys.stderr)
        return made
    raise ValueError(f"{problem or f'{saved} holds no tokenizer'}, and making it again "
                     f"({cfg.tokenizer or cfg.model or f'trained on {cfg.data}'}) gives another one: the data or the "
                     f"tokenizer changed since the run. Restore {saved / 'tokenizer'} or the data as the run had it.")


def base_model_of(cfg: TuneConfig, vocab_size: int, device: str, dtype: torch.dtype = torch.bfloat16,
                  trust_remote_code: bool = False):
    """The run's base model in `dtype`, never 4-bit: the model it named, or its random-init weights (QLoRA: the
    saved random-init checkpoint its 4-bit load read; LoRA: rebuilt from the seed, as training built it).
    `trust_remote_code` is the caller's, never the run's config.json: a run folder from elsewhere cannot
    switch it on."""
    arch = run_arch(cfg, vocab_size)
    if cfg.model:
        return mdl.build_model(None, cfg.model, dtype, device, trust_remote_code=trust_remote_code)
    if cfg.method == "qlora":
        return mdl.build_model(None, str(mdl.save_random_init(arch, torch.bfloat16, cfg.seed)), dtype, device)
    # Random init draws differ by device and dtype: draw as training did (its config.json has both resolved)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{cfg.out_dir} trained a random-init model on a GPU: its base weights can only be "
                           "drawn again there (CUDA's random numbers); run this on a CUDA machine")
    trained = mdl.build_model(arch, "", mdl.resolve_dtype(cfg.dtype, cfg.device), cfg.device, seed=cfg.seed)
    return mdl.cast_weights(trained.to(device), dtype)


def load_run(run_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
             trust_remote_code: bool = False):
    """(the run's model — base in `dtype` with its adapter attached, in eval mode — its tokenizer, its config).
    A full fine-tune's saved model is loaded as it is. Nothing in the run folder runs code: its weights are
    checked (`model.check_weights`), and `trust_remote_code` comes from the caller, not from the run's config."""
    import dataclasses

    run_dir = Path(run_dir)
    # The caller's flag replaces the one in config.json: a run folder from elsewhere cannot switch it on for
    # the tokenizer or base model it names.
    cfg = dataclasses.replace(run_config(run_dir), trust_remote_code=trust_remote_code)
    tokenizer = run_tokenizer(cfg, run_dir)
    if cfg.method == "full":
        if not (run_dir / "model" / "config.json").exists():
            raise FileNotFoundError(f"{run_dir}/model: no saved model; the run has not finished (resume it)")
        model = mdl.build_model(None, str(run_dir / "model"), dtype, device, trust_remote_code=trust_remote_code)
        return model.eval(), tokenizer, cfg
    if not (run_dir / "adapter" / "adapter_config.json").exists():
        raise FileNotFoundError(f"{run_dir}/adapter: no saved adapter; the run has not finished (resume it)")
    check_weights(run_dir / "adapter")  # before the base model is built: a bad adapter fails at once
    base = base_model_of(cfg, len(tokenizer), device, dtype, trust_remote_code)
    return mdl.load_adapter(base, run_dir / "adapter").eval(), tokenizer, cfg


@torch.no_grad()
def merge_run(run_dir: str | Path, out_dir: str | Path | None = None, device: str = "cpu",
              dtype: torch.dtype = torch.bfloat16, tokens: int = 128, seed: int = 0,
              trust_remote_code: bool = False) -> dict:
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
    out = Path(out_dir) if out_dir else run_dir / "merged"
    check_export_target(run_dir, out)
    # One writer at a time in the run folder (a training run resuming there, another export of it); the merged
    # model appears whole or not at all.
    with runlock.hold(run_dir, "this export"):
        return _merge_run(run_dir, out, device, dtype, tokens, seed, trust_remote_code)


def check_export_target(run_dir: Path, out: Path) -> None:
    """Refuse an export folder whose replacement would lose something: the run itself or a folder holding it,
    a folder inside the run other than its `merged/`, a file, another run, a folder a process is writing, or
    a folder holding anything but an earlier export (whose `export.json` says it is one)."""
    run, target = run_dir.resolve(), out.resolve()
    where = f"--out {out}"
    if target == run or run.is_relative_to(target):
        raise ValueError(f"{where} is the run folder {run_dir} or holds it: an export replaces its folder, so the "
                         "run would be deleted. Choose a new folder (the default is <run>/merged).")
    if target.is_relative_to(run) and target != run / "merged":
        raise ValueError(f"{where} is inside the run folder {run_dir}: an export writes only its default merged/ "
                         "there. Choose a folder outside the run.")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{where} is a file: an export writes a folder. Choose a new folder.")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if runlock.held_by_other(out):
        raise runlock.RunInUseError(f"{where} is being written by another tunekit process "
                                    f"(pid {(runlock.holder(out) or {}).get('pid', '?')}). Choose another folder.")
    if target == run / "merged" or (out / EXPORT_RECORD).is_file():
        return  # the run's own default export, or an earlier export: replaced
    if found := checkpoint.run_contents(out):
        raise ValueError(f"{where} holds a training run ({', '.join(found)}): an export would delete it. "
                         "Choose a new folder.")
    names = sorted(p.name for p in out.iterdir())
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    raise ValueError(f"{where} already holds files that are not a tunekit export ({shown}): an export "
                     "replaces its folder, so they would be deleted. Choose an empty or new folder.")


def _merge_run(run_dir: Path, out: Path, device: str, dtype: torch.dtype, tokens: int, seed: int,
               trust_remote_code: bool) -> dict:

    def random_ids(tokenizer) -> torch.Tensor:  # the same tokens for every model compared
        return torch.randint(0, len(tokenizer), (2, tokens), generator=torch.Generator().manual_seed(seed)).to(device)

    reference = None
    if dtype != torch.float32:  # the same weights and adapter computed in fp32: what both bf16 models approximate
        model, tokenizer, _ = load_run(run_dir, device, torch.float32, trust_remote_code)
        reference = model(input_ids=random_ids(tokenizer)).logits.float()
        del model  # freed before the model in `dtype` is built
        if device == "cuda":
            torch.cuda.empty_cache()
    model, tokenizer, _ = load_run(run_dir, device, dtype, trust_remote_code)
    ids = random_ids(tokenizer)
    want = model(input_ids=ids).logits.float()
    merged = mdl.merge_adapter(model, None, dtype)
    with atomic_output(out) as tmp:  # weights, tokenizer and the record together, or nothing
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(str(tmp))
        atomic_write_json(tmp / EXPORT_RECORD, {"run_dir": str(run_dir.resolve()), "dtype": str(dtype)})
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
             dtype: torch.dtype = torch.bfloat16, trust_remote_code: bool = False, batch_size: int = 1) -> list[str]:
    """Greedy continuations of `prompts` by the run's model (its BOS first, as in training): `generate_texts`."""
    model, tokenizer, _ = load_run(run_dir, device, dtype, trust_remote_code)
    return generate_texts(model, tokenizer, prompts, max_new_tokens, batch_size, device)


def generate_texts(model, tokenizer, prompts: list[str], max_new_tokens: int = 64, batch_size: int = 1,
                   device: str = "cpu") -> list[str]:
    """Greedy continuations of `prompts` by a loaded model (`load_run`): BOS first, as in training; each stops
    at EOS. `batch_size` prompts at a time, left-padded; the attention mask hides the padding, so each answer
    is the one the prompt gets alone (tests/unit/test_evaluate.py checks it)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    out = []
    for i in range(0, len(prompts), batch_size):
        encoded = [bos + ids for ids in tokenizer(prompts[i:i + batch_size], add_special_tokens=False)["input_ids"]]
        width = max(len(ids) for ids in encoded)
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded], device=device)
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
        new = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)[:, width:]
        out += tokenizer.batch_decode(new, skip_special_tokens=True)
    return out


def prompts_from(source: str, n: int = 3, fields: str = "") -> list[tuple[str, str]]:
    """(prompt, reference answer) of the first `n` records of a dataset, the prompt as training renders it."""
    records = load_records(source, fields=fields)
    prompt_fields, response_field = detect_layout(records.column_names, source)
    return [(format_prompt(records[i], prompt_fields), records[i][response_field]) for i in range(min(n, len(records)))]
