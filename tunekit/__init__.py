"""tunekit: fine-tune ~7B language models fast on rented GPUs, with every speed-up measured.

One module per concern: `config` (TuneConfig and presets), `data` (records, offline tokenization), `batching`
(padding, grouping, packing, the DataLoader), `model`, `attention`, `loss`, `memory` (checkpointing, offload,
peak memory), `estimate` (the memory estimator), `checkpoint`, `prepared` (the prepared-data cache and the
run's record of its data), `runlock` (one writer per run folder), `train`, `export` (a finished run merged, or
generating), `bench` (timing the step), `databench` (lesson 1's data measurements), `speedups` (lesson 4's
switches), `distributed` (several GPUs), `results` (result files and their provenance), `claims` (the article's
claims judged from results), `doctor`, `cli`, and `notebook` (helpers the course notebooks share).
"""

__version__ = "0.1.0"

# The public surface a script needs. The functions import their modules on first call, so `import tunekit`
# stays cheap. (`tunekit.train` is the training-loop module; its entry point is `finetune` here.)
from tunekit.config import ConfigError, TuneConfig, get_preset, load_config  # noqa: E402


def finetune(cfg: TuneConfig, resume: bool = False, overwrite: bool = False,
             allow_config_change: bool = False) -> dict:
    """Run a training run as `tunekit train` does; returns its summary (steps, losses, final_loss, run_dir).
    `resume`, `overwrite` and `allow_config_change` are the command's `--resume`, `--overwrite` and
    `--allow-config-change`: a folder that holds another run is refused without one of them."""
    from tunekit.train import train

    cfg.validate()
    return train(cfg, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change)


def benchmark(cfg: TuneConfig, name: str = "") -> dict:
    """Time the training step of `cfg` as `tunekit bench` does; returns the result dict (not saved)."""
    from tunekit.bench import run_bench

    cfg.validate()
    return run_bench(cfg, name)


def estimate_memory(cfg: TuneConfig) -> dict:
    """Predict the peak GPU memory of one training step of `cfg`, in bytes by part, loading nothing."""
    from tunekit.config import config_dict
    from tunekit.estimate import estimate_memory_for

    cfg.validate()
    if not cfg.vocab_size:
        raise ConfigError("estimate_memory needs vocab_size (the tokenizer is not loaded): set it in the config")
    return estimate_memory_for(**config_dict(cfg))


__all__ = ["TuneConfig", "ConfigError", "get_preset", "load_config", "finetune", "benchmark", "estimate_memory"]
