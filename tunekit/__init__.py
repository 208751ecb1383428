"""tunekit: fine-tune ~7B language models fast on rented GPUs, with every speed-up measured.

The library, in floors (the README's "The library" lists every module): the ground floor (`io`, `hub`,
`config`, `presets`), the components that import only it and each other (`data`, `model`, `attention`,
`memory`, `loss`, `optim`, `speedups`, `fastlora`, `distributed`, `step`, `checkpoint`, `stopping`, `results`,
`estimate`, `fitting`), the builders (`prepare`, `build`), the run and what times it (`train`, `export`,
`bench`), and the command line (`commands`, `cli`). The course's own code (claims, lesson plans, the notebook
runner, the lessons' experiments) is the separate package `tunekit_course`, which nothing here imports.
"""

__version__ = "0.1.0"

import logging
import warnings

# bitsandbytes' CPU build, on CPUs with bf16 instructions, tries at import to fetch a CPU matmul kernel from the
# hub and logs a warning when it cannot (offline, or no `kernels`). tunekit never runs bitsandbytes' CPU matmul
# (QLoRA trains on a GPU; on CPU only the 4-bit codes are read, tunekit/nf4.py), so the line is noise there.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

# torchao's source holds an invalid escape in a docstring: Python warns once, when it first compiles the module
# (on a fresh install, inside a run or a lesson's output), about torchao's code, not the user's.
warnings.filterwarnings("ignore", category=SyntaxWarning, module=r".*torchao")

# The public surface a script needs. The functions import their modules on first call, so `import tunekit`
# stays cheap. (`tunekit.train` is the training-loop module; its entry point is `finetune` here.)
from tunekit.config import ConfigError, TuneConfig, load_config
from tunekit.presets import get_preset


def finetune(cfg: TuneConfig, data=None, resume: bool = False, overwrite: bool = False,
             allow_config_change: bool = False):
    """Run a training run as `tunekit train` does. `data`: records in memory (a list of dicts, or a
    `datasets.Dataset`) to train on instead of the config's `data` file or name; they are written once to the
    cache, named by their content (`data.records.save_records`), and the run records that file.

    Returns the run's summary (steps, losses, final_loss, run_dir, ...), a dict whose `load()` gives the trained
    model and its tokenizer. `resume`, `overwrite` and `allow_config_change` are the command's `--resume`,
    `--overwrite` and `--allow-config-change`: a folder that holds another run is refused without one of them."""
    import dataclasses

    from tunekit.export import Finished
    from tunekit.train import train

    if data is not None:
        from tunekit.data.records import save_records

        cfg = dataclasses.replace(cfg, data=str(save_records(data)))
    cfg.validate()
    return Finished(train(cfg, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change))


def speed_up(model, **switches):
    """Apply tunekit's speed-ups (fused LoRA, FP8 base weights, the chunked loss, regional compile, checkpointing
    with offload, the attention kernel) to a transformers model you built, with or without a peft adapter; returns
    the same model, ready for `Trainer`, `SFTTrainer` or a loop of your own. See `tunekit.hf.speed_up`."""
    from tunekit.hf import speed_up as apply

    return apply(model, **switches)


def __getattr__(name: str):
    if name == "PackingCollator":  # a class: imported on first use, as the functions' modules are
        from tunekit.hf import PackingCollator

        return PackingCollator
    raise AttributeError(f"module 'tunekit' has no attribute {name!r}")


def benchmark(cfg: TuneConfig, name: str = "") -> dict:
    """Time the training step of `cfg` as `tunekit bench` does; returns the result dict (not saved)."""
    from tunekit.bench.step import run_bench

    cfg.validate()
    return run_bench(cfg, name)


def estimate_memory(cfg: TuneConfig) -> dict:
    """Predict the peak GPU memory of one training step of `cfg`, in bytes by part, loading nothing."""
    from tunekit.estimate import Setup, estimate_memory_for

    cfg.validate()
    if not cfg.vocab_size:
        raise ConfigError("estimate_memory needs vocab_size (the tokenizer is not loaded): set it in the config")
    return estimate_memory_for(Setup.of(cfg))


__all__ = ["ConfigError", "PackingCollator", "TuneConfig", "benchmark", "estimate_memory", "finetune", "get_preset",
           "load_config", "speed_up"]
