"""Nothing a run folder holds runs code when loaded. Checkpoints are read with `weights_only=True` (weights as
safetensors, the RNG state as tensors and plain values), a `meta.json` must list its files, the metadata and
values of a sharded checkpoint are checked before torch unpickles them, adapters and models are checked before
peft or transformers read them, and `trust_remote_code` stays off unless the config asks for it.

Each crafted file here carries a payload that creates a marker file when unpickled freely; the first test
shows that it does."""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import sys
import warnings

import numpy as np
import pytest
import torch
from helpers import SMALL_ARCH, SMALL_ARCH_ARGS

from tunekit import checkpoint, cli, distributed, export, train
from tunekit import model as mdl
from tunekit.optim import build_scheduler
from tunekit.stopping import read_metrics


class Payload:
    """What a crafted pickle holds: unpickled without `weights_only`, it creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def craft(path, marker, real: dict | None = None) -> None:
    """Overwrite `path` with a `torch.save` pickle: the real contents (if given) plus the payload."""
    torch.save({**(real or {}), "payload": Payload(marker)}, path)


def record(ckpt, name: str, drop: str | None = None) -> None:
    """Rewrite `ckpt`'s meta.json with `name`'s new sha256 and size (as whoever crafted it would), `drop`
    taken out of the list."""
    meta = json.loads((ckpt / checkpoint.META).read_text())
    raw = (ckpt / name).read_bytes()
    meta["files"][name] = {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
    meta["files"].pop(drop, None)
    (ckpt / checkpoint.META).write_text(json.dumps(meta))


def real_state(ckpt) -> dict:
    """What tunekit wrote into `ckpt/state.pt` (the test's own file, read as any tunekit version wrote it)."""
    return torch.load(ckpt / "state.pt", weights_only=False)


def stopped_run(make_cfg, steps: int = 4):
    """A run killed after `steps` steps, with checkpoints every 2."""
    cfg = make_cfg(max_steps=8, save_every=2)
    train.train(cfg, stop_after=steps, progress=False)
    return cfg


def test_the_payload_is_live(tmp_path):
    """The control: the crafted file does run its payload when loaded the way tunekit used to."""
    craft(tmp_path / "state.pt", tmp_path / "ran")
    torch.load(tmp_path / "state.pt", weights_only=False)
    assert (tmp_path / "ran").exists()


# ---- checkpoints -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["state.pt", "trainable.pt"])
def test_a_crafted_checkpoint_pickle_is_refused_and_never_runs(make_cfg, tmp_path, name):
    """state.pt (or the weights, as checkpoints before safetensors held them) replaced by a pickle that would
    run code, its sha256 rewritten in meta.json: the resume refuses, naming the file; nothing runs."""
    cfg = stopped_run(make_cfg, 2)
    ckpt, marker = cfg.run_dir() / "ckpt-0000002", tmp_path / "ran"
    real = real_state(ckpt) if name == "state.pt" else None
    if name == "trainable.pt":
        (ckpt / checkpoint.WEIGHTS).unlink()
    craft(ckpt / name, marker, real)
    record(ckpt, name, drop=checkpoint.WEIGHTS if name == "trainable.pt" else None)
    assert checkpoint.verify_checkpoint(ckpt) is None  # the checksums match: only the load can refuse it
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(str(ckpt / name)) + ".*could run code") as e:
        train.train(cfg, resume=True, progress=False)
    assert "\n" not in str(e.value) and "exec" in str(e.value)
    assert not marker.exists()


def test_the_cli_refuses_a_crafted_checkpoint_in_one_line(make_cfg, tmp_path, capsys):
    cfg = stopped_run(make_cfg, 2)
    ckpt, marker = cfg.run_dir() / "ckpt-0000002", tmp_path / "ran"
    craft(ckpt / "state.pt", marker, real_state(ckpt))
    record(ckpt, "state.pt")
    capsys.readouterr()
    argv = ["train", "--preset", "tiny", "--out-dir", cfg.out_dir, "--data", cfg.data, "--max-steps", "8",
            "--save-every", "2", "--batch-size", "8", "--max-length", "128", "--warmup-steps", "2",
            *SMALL_ARCH_ARGS, "--resume"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(ckpt / "state.pt") in err and "could run code" in err
    assert not marker.exists()


def test_a_meta_json_without_its_file_list_is_refused(make_cfg, tmp_path, capsys):
    """A meta.json without "files" is not a pass: that checkpoint is skipped, naming its meta.json, even
    with a crafted state.pt beside it; with none left, the resume is refused."""
    cfg = stopped_run(make_cfg, 4)
    older, newer = cfg.run_dir() / "ckpt-0000002", cfg.run_dir() / "ckpt-0000004"
    marker = tmp_path / "ran"
    for ckpt in (newer, older):
        meta = json.loads((ckpt / checkpoint.META).read_text())
        (ckpt / checkpoint.META).write_text(json.dumps({"step": meta["step"], "data": meta["data"]}))
    craft(newer / "state.pt", marker, real_state(newer))
    assert "lists no files" in checkpoint.verify_checkpoint(newer)
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint verifies") as e:
        train.train(cfg, resume=True, progress=False)
    assert all(str(c / checkpoint.META) in str(e.value) for c in (older, newer))
    assert not marker.exists()


def test_a_meta_json_without_its_file_list_falls_back_to_one_with_it(make_cfg, tmp_path, capsys):
    cfg = stopped_run(make_cfg, 4)
    older, newer = cfg.run_dir() / "ckpt-0000002", cfg.run_dir() / "ckpt-0000004"
    meta = json.loads((newer / checkpoint.META).read_text())
    (newer / checkpoint.META).write_text(json.dumps({"step": meta["step"], "data": meta["data"]}))
    craft(newer / "state.pt", tmp_path / "ran")
    capsys.readouterr()
    train.train(cfg, resume=True)
    out = capsys.readouterr().out
    assert f"{newer / checkpoint.META} lists no files" in out and f"falling back to {older}" in out
    assert not (tmp_path / "ran").exists()


def test_a_meta_json_must_list_what_is_loaded(tmp_path, make_cfg):
    cfg = stopped_run(make_cfg, 2)
    ckpt = cfg.run_dir() / "ckpt-0000002"
    meta = json.loads((ckpt / checkpoint.META).read_text())
    del meta["files"]["state.pt"]
    (ckpt / checkpoint.META).write_text(json.dumps(meta))
    assert checkpoint.verify_checkpoint(ckpt) == (f"{ckpt / checkpoint.META} does not list state.pt, so the "
                                                  "checkpoint cannot be checked and is not loaded")


def test_a_checkpoint_holds_no_pickled_objects(make_cfg):
    """What tunekit writes loads with weights_only=True (the optimizer and RNG state included), and its
    weights are safetensors."""
    cfg = stopped_run(make_cfg, 2)
    ckpt = cfg.run_dir() / "ckpt-0000002"
    state = torch.load(ckpt / "state.pt", weights_only=True)
    assert {"optimizer", "scheduler", "rng", "data", "step"} <= state.keys()
    assert (ckpt / checkpoint.WEIGHTS).is_file() and not (ckpt / checkpoint.OLD_WEIGHTS).exists()


@pytest.mark.parametrize("name", ["adamw", "adamw_foreach", "lion", "lion_pytorch"])
def test_every_optimizer_state_loads_weights_only(tmp_path, name):
    from helpers import small_model

    from tunekit.optim import build_optimizer

    model = small_model(300, "lora")
    try:
        opt = build_optimizer(model, 1e-3, 0.1, "cpu", name)
    except RuntimeError as e:  # lion_pytorch not installed
        pytest.skip(str(e))
    sum(p.square().sum() for p in model.parameters() if p.requires_grad).backward()
    opt.step()
    sched = build_scheduler(opt, 2, 10, 0.1)
    path = checkpoint.save_checkpoint(tmp_path, 1, model, opt, sched, {"epoch": 0, "next_batch": 1})
    fresh = small_model(300, "lora")
    opt2 = build_optimizer(fresh, 1e-3, 0.1, "cpu", name)
    checkpoint.load_checkpoint(path, fresh, opt2, build_scheduler(opt2, 2, 10, 0.1))
    for (_, a), (_, b) in zip(opt.state_dict()["state"].items(), opt2.state_dict()["state"].items()):
        for k in a:
            assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), k


def test_every_rng_is_restored_exactly(tmp_path):
    """Python's, numpy's (gauss cache included) and torch's next draws after a restore are those after the save."""
    random.seed(3)
    np.random.seed(4)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    torch.manual_seed(5)
    torch.save({"rng": checkpoint.rng_state()}, tmp_path / "state.pt")
    draws = random.random(), np.random.randn(), np.random.randint(1 << 30), torch.rand(4)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    checkpoint.set_rng_state(torch.load(tmp_path / "state.pt", weights_only=True)["rng"])
    again = random.random(), np.random.randn(), np.random.randint(1 << 30), torch.rand(4)
    assert draws[:3] == again[:3] and torch.equal(draws[3], again[3])


def test_a_checkpoint_from_before_safetensors_still_resumes(make_cfg):
    """trainable.pt and a numpy RNG state stored as an ndarray, as tunekit wrote them before: read with
    weights_only=True (numpy's uint32 arrays allowed, nothing else), and the resume matches a clean run."""
    kw = {"max_steps": 6, "save_every": 2}
    a, b = make_cfg("a", **kw), make_cfg("b", **kw)
    train.train(a, progress=False)
    train.train(b, stop_after=3, progress=False)
    ckpt = b.run_dir() / "ckpt-0000002"
    from safetensors.torch import load_file

    torch.save(load_file(ckpt / checkpoint.WEIGHTS), ckpt / checkpoint.OLD_WEIGHTS)
    (ckpt / checkpoint.WEIGHTS).unlink()
    state = torch.load(ckpt / "state.pt", weights_only=True)
    name, keys, *rest = state["rng"]["numpy"]
    state["rng"]["numpy"] = (name, keys.numpy().astype(np.uint32), *rest)
    torch.save(state, ckpt / "state.pt")
    record(ckpt, "state.pt")
    record(ckpt, checkpoint.OLD_WEIGHTS, drop=checkpoint.WEIGHTS)
    train.train(b, resume=True, progress=False)
    assert [r["loss"] for r in read_metrics(b.run_dir())] == pytest.approx(
        [r["loss"] for r in read_metrics(a.run_dir())], abs=1e-5)


# ---- a sharded (FSDP2) checkpoint's torch.distributed.checkpoint folder --------------------------------


def dcp_folder(path, optim: dict):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # no process group: dcp saves as one process, saying so
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.arange(6.0)}, "optim": optim}, checkpoint_id=str(path), no_dist=True)
    return path


def test_a_sharded_checkpoint_loads_plain_values(tmp_path):
    folder = dcp_folder(tmp_path / "sharded", {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]})
    state = {"model": {"w": torch.zeros(6)}, "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}}
    distributed.load_dcp(state, folder)
    assert torch.equal(state["model"]["w"], torch.arange(6.0))
    assert state["optim"]["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.99)}]


def test_a_crafted_sharded_checkpoint_never_runs(tmp_path):
    """torch.distributed.checkpoint unpickles its `.metadata` with plain pickle and each non-tensor value with
    weights_only=False: a payload in either is refused, naming it."""
    marker = tmp_path / "ran"
    folder = dcp_folder(tmp_path / "values", {"x": Payload(marker)})
    state = {"model": {"w": torch.zeros(6)}, "optim": {"x": 0}}
    with pytest.raises(checkpoint.CheckpointError, match="optim.x .*could run code"):
        distributed.load_dcp(state, folder)
    folder = dcp_folder(tmp_path / "meta", {"lr": 0.1})
    with open(folder / ".metadata", "wb") as f:
        import pickle

        pickle.dump(Payload(marker), f)
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(str(folder / ".metadata")) + ".*builtins.exec"):
        distributed.load_dcp({"model": {"w": torch.zeros(6)}, "optim": {"lr": 0.0}}, folder)
    assert not marker.exists()


# ---- a finished run's adapter and model: export and generate ---------------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory, small_data):
    """A finished LoRA run and a finished full fine-tune, made once; each test works on a copy."""
    from tunekit.presets import tiny

    runs = tmp_path_factory.mktemp("finished")
    for method in ("lora", "full"):
        cfg = tiny(out_dir=str(runs / method), data=str(small_data), max_steps=2, batch_size=8,
                          max_length=128, warmup_steps=1, method=method, **SMALL_ARCH)
        train.train(cfg, progress=False)
    return runs


def copy_run(finished, tmp_path, method: str = "lora"):
    """A copy of a finished run whose config.json names the copy's folder."""
    run = tmp_path / method
    shutil.copytree(finished / method, run)
    saved = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**saved, "out_dir": str(run)}))
    return run


def test_a_crafted_adapter_bin_is_refused_and_never_runs(finished, tmp_path, capsys):
    """adapter_model.safetensors replaced by a pickled adapter_model.bin holding the real weights and a
    payload: export.load_run and `tunekit generate` refuse it in one line naming it; nothing runs."""
    from safetensors.torch import load_file

    run, marker = copy_run(finished, tmp_path), tmp_path / "ran"
    adapter = run / "adapter"
    weights = load_file(adapter / "adapter_model.safetensors")
    (adapter / "adapter_model.safetensors").unlink()
    craft(adapter / "adapter_model.bin", marker, weights)
    with pytest.raises(ValueError, match=re.escape(str(adapter / "adapter_model.bin")) + ".*could run code"):
        export.load_run(run, dtype=torch.float32)
    capsys.readouterr()
    assert cli.main(["generate", str(run), "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "adapter_model.bin" in err and "could run code" in err
    assert not marker.exists()


def test_an_adapter_bin_of_plain_tensors_loads(finished, tmp_path):
    """A `.bin` adapter that is tensors only (what `torch.save(state_dict)` writes) is not refused."""
    from safetensors.torch import load_file

    run = copy_run(finished, tmp_path)
    adapter = run / "adapter"
    torch.save(load_file(adapter / "adapter_model.safetensors"), adapter / "adapter_model.bin")
    want = export.generate(run, ["Question: 1 + 1?\nAnswer: "], max_new_tokens=3, dtype=torch.float32)
    (adapter / "adapter_model.safetensors").unlink()
    assert export.generate(run, ["Question: 1 + 1?\nAnswer: "], max_new_tokens=3, dtype=torch.float32) == want


@pytest.mark.parametrize("method, name", [("lora", "adapter/adapter_model.safetensors"),
                                          ("full", "model/model.safetensors")])
def test_a_truncated_safetensors_file_is_one_line_naming_it(finished, tmp_path, capsys, method, name):
    run = copy_run(finished, tmp_path, method)
    weights = run / name
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    capsys.readouterr()
    assert cli.main(["generate", str(run), "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(weights) in err and "truncated" in err, err


def test_an_adapter_of_another_peft_type_is_refused(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    config = run / "adapter" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "peft_type": "PROMPT_TUNING"}))
    with pytest.raises(ValueError, match=re.escape(str(config)) + ".*LoRA adapters only"):
        export.load_run(run, dtype=torch.float32)


# ---- trust_remote_code ---------------------------------------------------------------------------------


@pytest.fixture
def recorded(monkeypatch):
    """Every `from_pretrained` call of transformers' Auto classes, with its keyword arguments."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    calls = []
    for cls in (AutoModelForCausalLM, AutoTokenizer):
        real = cls.from_pretrained

        def spy(name, *args, _real=real, _cls=cls, **kwargs):
            calls.append((_cls.__name__, str(name), kwargs))
            return _real(name, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    return calls


@pytest.fixture
def local_model(tmp_path, tokenizer):
    """A small model and its tokenizer saved where `--model` can name them."""
    folder = tmp_path / "local-model"
    mdl.build_model(mdl.llama_config(vocab_size=len(tokenizer), **SMALL_ARCH)).save_pretrained(folder)
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("flag", [None, "true"])
def test_trust_remote_code_is_off_unless_asked(recorded, local_model, tmp_path, small_data, flag):
    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--model", str(local_model), "--data", str(small_data), "--out-dir",
            str(out), "--max-steps", "2", "--batch-size", "8", "--max-length", "128", "--warmup-steps", "1"]
    assert cli.main(argv + (["--trust-remote-code", flag] if flag else [])) == 0
    trusted = flag == "true"
    kinds = {kind for kind, _, _ in recorded}
    assert kinds == {"AutoModelForCausalLM", "AutoTokenizer"}, recorded
    assert all(kw.get("trust_remote_code", "unset") is trusted for _, _, kw in recorded), "\n".join(map(str, recorded))
    # export and generate never take it from the run's config.json: a run folder cannot switch it on
    recorded.clear()
    export.load_run(out, dtype=torch.float32)
    assert recorded and all(kw.get("trust_remote_code", "unset") is False for _, _, kw in recorded), recorded


def test_the_4bit_load_passes_trust_remote_code(monkeypatch, recorded, local_model):
    """`load_quantized` (CUDA only) passes the flag too: checked with bitsandbytes and the GPU stood in for."""
    monkeypatch.setattr(mdl, "require_cuda_for_4bit", lambda device: None)
    monkeypatch.setitem(sys.modules, "bitsandbytes", type(sys)("bitsandbytes"))
    from transformers import AutoModelForCausalLM

    seen, model = [], mdl.build_model(None, str(local_model))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda name, **kw: seen.append(kw) or model)
    for trusted in (False, True):
        mdl.load_quantized(str(local_model), "cpu", trust_remote_code=trusted)
        assert seen[-1]["trust_remote_code"] is trusted and "quantization_config" in seen[-1]


def test_a_model_that_needs_its_own_code_is_one_line(local_model):
    """A model whose config names code of its own (auto_map) is refused, not prompted for, without the flag."""
    config = local_model / "config.json"
    saved = json.loads(config.read_text())
    saved.update(model_type="tunekit-custom", auto_map={"AutoConfig": "custom.Config",
                                                        "AutoModelForCausalLM": "custom.Model"})
    config.write_text(json.dumps(saved))
    marker = local_model / "ran"
    (local_model / "custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(ValueError, match="--trust-remote-code true") as e:
        mdl.build_model(None, str(local_model))
    assert "\n" not in str(e.value) and not marker.exists()
