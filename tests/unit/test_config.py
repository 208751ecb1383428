"""Config: presets, CLI-style overrides, validation messages, save/load round trip."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tunekit import config
from tunekit.config import ConfigError, TuneConfig
from tunekit.presets import (
    GPU_PRESETS,
    PRESETS,
    get_preset,
    llama7b_qlora_lowmem,
    parse_overrides,
    resolve,
    tiny,
)

FIELDS = [f.name for f in dataclasses.fields(TuneConfig)]


# ---- presets -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_build_and_validate(name):
    cfg = get_preset(name)
    assert isinstance(cfg, TuneConfig)
    assert cfg.preset == name
    cfg.validate()
    assert cfg.hidden_size % cfg.num_heads == 0
    # Each call returns a fresh config: changing one leaves the next untouched.
    cfg.lr = 123.0
    assert get_preset(name).lr != 123.0


@pytest.mark.parametrize("name, method", [("llama7b_lora", "lora"),
                                           ("llama7b_qlora", "qlora")])
def test_gpu_presets_have_the_7b_shape_and_their_method(name, method):
    cfg = get_preset(name)
    assert cfg.method == method
    assert (cfg.hidden_size, cfg.num_layers, cfg.intermediate_size, cfg.num_heads) == (4096, 32, 11008, 32)
    assert cfg.grad_ckpt == (method == "qlora")
    assert name in GPU_PRESETS
    # Keyword overrides win over the preset's own values, even those the preset sets itself.
    assert get_preset(name, batch_size=2, max_length=512).batch_size == 2
    assert get_preset(name, grad_ckpt=False).grad_ckpt is False


def test_preset_overrides_apply():
    cfg = tiny(max_steps=7, lr=1e-4)
    assert (cfg.max_steps, cfg.lr, cfg.preset) == (7, 1e-4, "tiny")


def test_unknown_preset_names_known_ones():
    with pytest.raises(ConfigError) as e:
        get_preset("huge")
    msg = str(e.value)
    assert "huge" in msg
    for name in PRESETS:
        assert name in msg


def test_derived_values():
    cfg = tiny(batch_size=4, grad_accum=3, max_length=64)
    assert cfg.tokens_per_step() == 4 * 3 * 64
    assert cfg.tokens_per_step(world_size=2) == 2 * 4 * 3 * 64
    assert str(tiny().run_dir()) == "runs/tiny"
    assert str(tiny(out_dir="x/y").run_dir()) == "x/y"


# ---- overrides -----------------------------------------------------------------------------------


def test_parse_overrides_forms():
    out = parse_overrides(["--lr", "2e-4", "--max-steps=5", "--grad-ckpt", "--num_layers", "3",
                           "--lora-targets", "q_proj,v_proj"])
    assert out == {"lr": 2e-4, "max_steps": 5, "grad_ckpt": True, "num_layers": 3, "lora_targets": "q_proj,v_proj"}
    assert isinstance(out["max_steps"], int) and isinstance(out["lr"], float)


@pytest.mark.parametrize("args, expected", [
    (["--grad-ckpt"], True),                       # bare flag at the end
    (["--grad-ckpt", "--lr", "1"], True),          # bare flag followed by another flag
    (["--grad-ckpt", "false"], False),
    (["--grad-ckpt=no"], False),
    (["--grad_ckpt", "1"], True),
])
def test_parse_overrides_bool(args, expected):
    assert parse_overrides(args)["grad_ckpt"] is expected


def test_parse_overrides_bad_bool():
    with pytest.raises(ConfigError, match="grad-ckpt"):
        parse_overrides(["--grad-ckpt", "maybe"])


def test_parse_overrides_negative_number_is_a_value():
    assert parse_overrides(["--seed", "-3"]) == {"seed": -3}


def test_unknown_field_rejected_with_known_fields():
    with pytest.raises(ConfigError) as e:
        parse_overrides(["--bogus", "1"])
    msg = str(e.value)
    assert "bogus" in msg
    for name in FIELDS:
        assert name in msg


def test_unknown_field_suggests_close_names():
    with pytest.raises(ConfigError, match="--max-steps"):
        parse_overrides(["--steps", "3"])


@pytest.mark.parametrize("args, name", [
    (["--batch-size", "abc"], "batch-size"),
    (["--lr=fast"], "lr"),
    (["--max-steps", "2.5"], "max-steps"),
])
def test_ill_typed_value_names_field(args, name):
    with pytest.raises(ConfigError) as e:
        parse_overrides(args)
    assert name in str(e.value)
    assert "expected" in str(e.value)


def test_missing_value_and_positional_rejected():
    with pytest.raises(ConfigError, match="--lr"):
        parse_overrides(["--lr"])
    with pytest.raises(ConfigError, match="oops"):
        parse_overrides(["oops"])


def test_resolve_merges_preset_args_and_keywords():
    cfg = resolve("tiny", ["--lr", "1e-3", "--max-steps", "9"], max_steps=3)
    assert (cfg.lr, cfg.max_steps) == (1e-3, 3)  # keywords win over CLI args
    with pytest.raises(ConfigError, match="lr"):
        resolve("tiny", ["--lr", "0"])


# ---- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, name", [
    (dict(hidden_size=100, num_heads=3), "hidden_size"),
    (dict(method="bogus"), "method"),
    (dict(lr=0.0), "lr"),
    (dict(lr=-1e-3), "lr"),
    (dict(batch_size=0), "batch_size"),
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (dict(dtype="fp8"), "dtype"),
    (dict(attention="magic"), "attention"),
    (dict(device="tpu"), "device"),
    (dict(min_lr_ratio=1.5), "min_lr_ratio"),
    (dict(lora_dropout=1.0), "lora_dropout"),
    (dict(method="lora", lora_r=0), "lora_r"),
    (dict(save_every=-1), "save_every"),
    (dict(tokenizer_vocab=100), "tokenizer_vocab"),
])
def test_cross_field_checks_name_the_field(overrides, name):
    with pytest.raises(ConfigError) as e:
        tiny(**overrides)
    assert f"'{name}'" in str(e.value)


def test_full_finetune_ignores_lora_rank():
    assert tiny(method="full", lora_r=0).lora_r == 0


# ---- saving and loading --------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    cfg = tiny(lr=1.5e-4, max_steps=11, grad_ckpt=True, lora_targets="q_proj,v_proj", out_dir="a/b")
    path = tmp_path / "sub" / "config.json"
    config.save_config(cfg, path)
    assert json.loads(path.read_text())["lr"] == 1.5e-4
    assert config.load_config(path) == cfg
    assert not list(path.parent.glob(".*.tmp")), "atomic write left a temp file"


def test_load_config_unknown_field_names_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config.config_dict(tiny()), "learning_rate": 1e-3}))
    with pytest.raises(ConfigError) as e:
        config.load_config(path)
    assert str(path) in str(e.value)
    assert "learning_rate" in str(e.value)


def test_load_config_bad_json_and_missing_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"lr": 1e-3,\n "max_steps": }\n')
    with pytest.raises(ConfigError, match="line 2") as e:
        config.load_config(path)
    assert str(path) in str(e.value)
    with pytest.raises(ConfigError, match="no config file"):
        config.load_config(tmp_path / "missing.json")


def test_load_config_invalid_value_names_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"method": "bogus"}))
    with pytest.raises(ConfigError, match="method"):
        config.load_config(path)


def test_load_config_ill_typed_value_names_file_and_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"batch_size": "eight"}))
    with pytest.raises(ConfigError) as e:
        config.load_config(path)
    assert str(path) in str(e.value) and "batch_size" in str(e.value)


def test_lowmem_preset_is_valid_and_names_its_savers():
    cfg = llama7b_qlora_lowmem()
    assert (cfg.method, cfg.batch_size, cfg.optimizer) == ("qlora", 1, "adamw8bit")
    assert cfg.grad_ckpt and cfg.grad_ckpt_offload and cfg.embed_offload and cfg.loss == "chunked"


@pytest.mark.parametrize("overrides, field", [
    ({"grad_ckpt_offload": True}, "grad_ckpt_offload"),  # offload without checkpointing
    ({"peft_kbit_prepare": True}, "peft_kbit_prepare"),  # k-bit preparation on a 16-bit model
    ({"method": "full", "embed_offload": True}, "embed_offload"),  # the embeddings train
    ({"sdpa_backend": "cudnn,turbo"}, "sdpa_backend"),
    ({"loss": "fused"}, "loss"),
    ({"optimizer": "sgd"}, "optimizer"),
    ({"compile_recompute": True}, "compile_recompute"),  # tells a compiler that is not there what to recompute
])
def test_lesson2_fields_reject_bad_combinations(overrides, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        tiny(**overrides)


def test_entry_points_validate_fields_set_after_construction():
    """`cfg.batch_size = -1` after construction slips past __post_init__; the entry points check again."""
    import tunekit
    from tunekit.bench.step import run_bench

    cfg = tiny()
    cfg.batch_size = -1
    for entry in (tunekit.finetune, tunekit.benchmark, run_bench, tunekit.estimate_memory):
        with pytest.raises(ConfigError, match="batch_size"):
            entry(cfg)


def test_cpu_threads_auto_rule(monkeypatch):
    from tunekit.build import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads(tiny()) == 1  # a small model: one thread
    assert cpu_threads(tiny(hidden_size=2048, num_heads=16)) == 0  # large: PyTorch's default
    assert cpu_threads(tiny(cpu_threads=3)) == 3  # the field wins
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads(tiny()) == 0  # the environment already chose


def test_eval_every_minus_one_is_each_epoch_and_needs_epochs():
    from tunekit.build import run_length

    cfg = TuneConfig(eval_every=-1, epochs=2.0, eval_split=0.1, batch_size=4, grad_accum=5)
    cfg.validate()
    run = run_length(cfg, rows=400, say=lambda *_: None)  # 100 batches an epoch, 20 optimizer steps
    assert (run.max_steps, run.eval_every) == (40, 20)
    with pytest.raises(ConfigError, match="eval_every.*-1 \\(each epoch\\) with --epochs"):
        TuneConfig(eval_every=-1, eval_split=0.1).validate()
