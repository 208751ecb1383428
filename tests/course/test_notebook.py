"""The notebooks' helpers (tunekit_course/notebook.py): which preset and config a cell gets on CPU (smoke mode) and on
a GPU, and where its results go. No GPU needed: smoke mode is forced with TUNEKIT_SMOKE=1."""

from __future__ import annotations

import nbformat
import pytest
import torch

from tunekit.config import REPO_ROOT
from tunekit.presets import get_preset, tiny
from tunekit_course import notebook

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.fixture
def smoke(monkeypatch):
    """Smoke mode, even where a GPU is visible: TUNEKIT_SMOKE=1 must win over the hardware."""
    monkeypatch.setenv("TUNEKIT_SMOKE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not notebook.on_gpu()


def test_smoke_swaps_gpu_only_switches_for_stand_ins(smoke):
    cfg = notebook.config_for("llama7b_qlora_lowmem")  # qlora, 8-bit AdamW, checkpoints + embeddings offloaded
    assert cfg.preset == "tiny"
    assert (cfg.method, cfg.optimizer) == ("lora", "adamw")
    assert cfg.grad_ckpt and cfg.grad_ckpt_offload and cfg.embed_offload  # the switches that run on CPU stay
    assert (cfg.batch_size, cfg.max_length, cfg.vocab_size) == (1, 128, 1024)
    assert cfg.out_dir == str(REPO_ROOT / "runs" / "smoke")
    flex = notebook.config_for("llama7b_lora", attention="flex_attention")
    assert flex.attention == "sdpa" and flex.method == "lora" and not flex.grad_ckpt


def test_smoke_caps_the_batch_at_8(smoke):
    assert get_preset("llama7b_qlora").batch_size == 8
    assert notebook.config_for("llama7b_qlora").batch_size == 8
    assert notebook.config_for("llama7b_lora", batch_size=32).batch_size == 8
    assert notebook.config_for("llama7b_lora", batch_size=2).batch_size == 2


def test_smoke_carries_overrides_of_the_switches(smoke):
    cfg = notebook.config_for("llama7b_lora", grad_ckpt=True, loss="plain", packing="pack", sdpa_backend="math,flash",
                              lora_input_cast=True, method="full", bench_warmup=1, bench_steps=2)
    assert (cfg.grad_ckpt, cfg.loss, cfg.packing, cfg.sdpa_backend) == (True, "plain", "pack", "math,flash")
    assert cfg.lora_input_cast and cfg.method == "full"
    assert (cfg.bench_warmup, cfg.bench_steps) == (1, 2)
    # every other field is the tiny preset's, whatever the GPU preset says
    gpu, base = get_preset("llama7b_lora"), tiny()
    assert gpu.hidden_size != base.hidden_size and cfg.hidden_size == base.hidden_size
    assert cfg.data == base.data and cfg.lr == base.lr


def test_on_a_gpu_the_gpu_preset_is_used_as_is(monkeypatch):
    monkeypatch.setattr(notebook, "on_gpu", lambda: True)
    cfg = notebook.config_for("llama7b_qlora", batch_size=16, attention="flex_attention")
    assert cfg == get_preset("llama7b_qlora", batch_size=16, attention="flex_attention")
    assert (cfg.method, cfg.batch_size, cfg.attention) == ("qlora", 16, "flex_attention")
    assert notebook.results_dir() == notebook.RESULTS


def test_pick_preset_and_results_dir_in_smoke_mode(smoke, capsys):
    assert notebook.pick_preset("llama7b_qlora") == "tiny"
    out = capsys.readouterr().out
    assert "mode: smoke (TUNEKIT_SMOKE=1) -> preset tiny" in out and "mode: GPU" not in out
    assert notebook.results_dir() == REPO_ROOT / "runs" / "smoke-results" != notebook.RESULTS


def test_pick_preset_without_a_gpu(monkeypatch, capsys):
    monkeypatch.delenv("TUNEKIT_SMOKE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert notebook.pick_preset("llama7b_lora") == "tiny"
    assert "mode: smoke (no CUDA GPU)" in capsys.readouterr().out


# ---- outputs that read correctly untrusted (clean_outputs) ---------------------------------------------------------


def _widget_state(*models):
    return {"application/vnd.jupyter.widget-state+json": {
        "state": {i: {"model_name": name, "state": state} for i, name, state in models},
        "version_major": 2, "version_minor": 0}}


def _view(model_id, text):
    return nbformat.v4.new_output("display_data", data={
        "application/vnd.jupyter.widget-view+json": {"model_id": model_id, "version_major": 2, "version_minor": 0},
        "text/plain": text})


def _bar(box, left, right, value, total):
    """A tqdm.notebook progress bar as nbclient records it: HBox(HTML, FloatProgress, HTML), each with a layout."""
    return [(box, "HBoxModel", {"children": [f"IPY_MODEL_{box}l", f"IPY_MODEL_{box}p", f"IPY_MODEL_{box}r"],
                                "layout": f"IPY_MODEL_{box}y"}),
            (f"{box}l", "HTMLModel", {"value": left, "layout": f"IPY_MODEL_{box}y"}),
            (f"{box}p", "FloatProgressModel", {"value": value, "max": total, "bar_style": "success"}),
            (f"{box}r", "HTMLModel", {"value": right}),
            (f"{box}y", "LayoutModel", {})]


def test_clean_outputs_turns_a_progress_bar_into_its_final_text():
    f = "\u2007"  # tqdm.notebook pads with figure spaces and escapes HTML
    nb = nbformat.v4.new_notebook(metadata={"widgets": _widget_state(
        *_bar("aa", f"tokenize:{f}100%", f"{f}7473/7473{f}[00:01&lt;00:00,{f}5436.05{f}examples/s]", 7473.0, 7473.0),
        *_bar("bb", f"Loading:{f}50%", f"{f}1/2", 1, 2),
        ("cc", "IntSliderModel", {"value": 3, "layout": "IPY_MODEL_cy"}), ("cy", "LayoutModel", {}))})
    stdout = nbformat.v4.new_output("stream", name="stdout", text="done\n")
    nb.cells = [nbformat.v4.new_markdown_cell("# title"), nbformat.v4.new_code_cell("work()", outputs=[
        _view("aa", "tokenize:   0%|          | 0/7473 [00:00<?, ? examples/s]"), stdout,
        _view("bb", "Loading:   0%|          | 0/2 [00:00<?, ?it/s]"), _view("cc", "IntSlider(value=0)")])]
    assert notebook.clean_outputs(nb) is nb
    outs = nb.cells[1].outputs
    assert [o.get("data", {}).get("text/plain") for o in outs] == [
        "tokenize: 100%|██████████| 7473/7473 [00:01<00:00, 5436.05 examples/s]", None,
        "Loading: 50%|█████     | 1/2", "IntSlider(value=0)"]
    assert outs[1] == stdout and "application/vnd.jupyter.widget-view+json" in outs[3].data
    # only what the slider still shows is kept of the recorded widget state
    assert set(nb.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"]) == {"cc", "cy"}
    nbformat.validate(nb)
    assert nbformat.writes(notebook.clean_outputs(nb)) == nbformat.writes(nb)  # a second pass changes nothing


def test_clean_outputs_drops_a_stuck_bar_whose_state_was_not_recorded():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("work()", outputs=[
        _view("aa", "Writing model shards:   0%|          | 0/1 [00:00<?, ?it/s]"),
        nbformat.v4.new_output("stream", name="stdout", text="done\n")])]
    notebook.clean_outputs(nb)
    assert [o.output_type for o in nb.cells[0].outputs] == ["stream"] and "widgets" not in nb.metadata


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_read_correctly_untrusted_and_open_clean(path):
    text = path.read_text()
    nb = nbformat.reads(text, as_version=4)
    views = [o for c in nb.cells for o in c.get("outputs", []) if "application/vnd.jupyter.widget-view+json"
             in o.get("data", {})]
    assert not views and "widgets" not in nb.metadata, f"{path.name}: run notebook.clean_outputs on it"
    assert " 0%|" not in text, f"{path.name}: a progress bar stuck at 0% is committed"
    # JupyterLab writes the kernelspec it starts into the notebook: the same one keeps the tab unchanged.
    assert nb.metadata.kernelspec == {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    assert text == nbformat.writes(nb) + "\n", f"{path.name}: not as nbformat (and JupyterLab) write it"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and f"git checkout notebooks/{path.name}" in first.source


def test_execute_writes_plain_text_progress_and_the_kernelspec(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEKIT_NOTEBOOK", "")  # execute() sets it for the kernel; put it back afterwards
    path = tmp_path / "bar.ipynb"
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}})
    nb.cells = [nbformat.v4.new_code_cell("from tqdm.auto import tqdm\nfor _ in tqdm(range(3), desc='work'):\n"
                                          "    pass\nprint('done')")]
    path.write_text(nbformat.writes(nb))
    notebook.execute(path, timeout=120)
    text = path.read_text()
    done = nbformat.reads(text, as_version=4)
    outs = done.cells[0].outputs
    assert [o.output_type for o in outs] == ["display_data", "stream"], outs
    assert outs[0].data["text/plain"].startswith("work: 100%|██████████| 3/3 [") and list(outs[0].data) == ["text/plain"]
    assert "widgets" not in done.metadata and done.metadata.kernelspec.display_name != "Python 3"
    assert text.endswith("}\n")


def test_notebook_code_fits_a_laptop_screen():
    """No code line of a notebook is over 100 characters: every cell reads on a laptop screen in JupyterLab."""
    paths = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))
    assert paths
    long = [f"{path.name}, cell index {i}, line {j + 1} ({len(line)} characters): {line}"
            for path in paths for i, cell in enumerate(nbformat.read(path, as_version=4).cells)
            if cell.cell_type == "code" for j, line in enumerate(cell.source.split("\n")) if len(line) > 100]
    assert not long, "code lines over 100 characters:\n" + "\n".join(long)


def test_lesson5_waterfall_runs_from_before_to_after():
    """Its first step is the `llama7b_before` preset, its last `llama7b_after` field for field (but the name),
    and each step is a config the CLI accepts."""
    from tunekit import cli, config
    from tunekit.presets import llama7b_after, llama7b_before, resolve
    from tunekit_course import notebook

    runs = notebook.lesson5_runs(0.1)
    n = len(notebook.LESSON5_STEPS)
    assert [name for name, _, _ in runs] == ["l5_before", *(f"l5_step{i}" for i in range(1, n - 1)), "l5_after"]
    ends = []
    for _, _, args in (runs[0], runs[-1]):
        parsed, rest = cli.make_parser().parse_known_args(args)
        assert parsed.epoch == 0.1
        ends.append(config.config_dict(resolve(parsed.preset, rest)))
    before, after = (config.config_dict(c) for c in (llama7b_before(), llama7b_after()))
    assert ends[0] == before
    assert {k: v for k, v in ends[1].items() if k != "preset"} == {k: v for k, v in after.items() if k != "preset"}


def test_lesson5_plan_runs_the_ends_back_to_back_on_one_gpu():
    """On two GPUs the article's recipe and tunekit's run one after the other on the same GPU, the waterfall's
    middle steps beside them without the held-out evaluation; the smoke plan is the two ends on the tiny model."""
    from tunekit_course import notebook

    plan = notebook.lesson5_plan(True)
    assert [n for n, _, _ in plan[:2]] == ["l5_before", "l5_after"] and len(plan) == len(notebook.LESSON5_STEPS) + 3
    queues = {}
    for name, args, cache in plan:
        queues.setdefault(cache.partition(":")[2], []).append(name)
        assert ("--eval-data=" in args) == name.startswith("l5_step")
    # the after recipe's second run reads the kernels its first run compiled
    assert queues["l5-ends"][:3] == ["l5_before", "l5_after", "l5_after_warm"] and queues["l5-fp8"] == ["l5_after_fp8"]
    caches = {name: cache for name, _, cache in plan}
    assert caches["l5_after"] == "cold:l5-ends" and caches["l5_after_warm"] == "warm:l5-ends"
    args = {name: a for name, a, _ in plan}
    assert args["l5_after_warm"] == args["l5_after"] and args["l5_after_fp8"] == [*args["l5_after"], "--fp8=true"]
    assert args["l5_after_fast_fp8"] == [*args["l5_after"], "--fast-lora=true", "--fp8=true"]
    assert list(notebook.lesson5_labels()) == [*(n for n, _, _ in notebook.lesson5_runs(0.1)), "l5_after_warm",
                                                "l5_after_fp8", "l5_after_fast_fp8"]
    assert set(notebook.lesson5_labels()) == set(args)
    smoke = notebook.lesson5_plan(False)
    assert [n for n, _, _ in smoke] == ["l5_before", "l5_after"]
    assert all("--method=lora" in args and "--epoch" in args for _, args, _ in smoke)


def test_scaling_plan_covers_each_workload_at_each_count_it_can():
    from tunekit_course import notebook

    plan = notebook.scaling_plan(8)
    assert [n for _, n, _ in plan] == [1] * 3 + [2] * 3 + [4] * 3 + [8] * 3
    names = [name for name, _, _ in plan]
    assert "l3_scale_fsdp_full_8gpu" in names and "l3_scale_ddp_lora_1gpu" in names
    full = {name: args for name, _, args in plan}["l3_scale_fsdp_full_4gpu"]
    assert full[:3] == ["bench", "--preset", "llama7b_lora"] and "--parallel" in full and "fsdp" in full
    assert [n for _, n, _ in notebook.scaling_plan(2)] == [1, 1, 1, 2, 2, 2]  # a two-GPU machine: its points
    smoke = notebook.scaling_plan(0, smoke=True, workloads=("fsdp_qlora",))
    assert [(name, n) for name, n, _ in smoke] == [("l3_scale_fsdp_qlora_1gpu", 1), ("l3_scale_fsdp_qlora_2gpu", 2)]
    assert "tiny" in smoke[0][2] and "qlora" not in " ".join(smoke[0][2])  # bitsandbytes needs CUDA
    with pytest.raises(ValueError, match="choose from"):
        notebook.scaling_plan(8, workloads=("pipeline",))


@pytest.mark.slow
def test_measure_scaling_launches_each_count_on_cpu(tmp_path, monkeypatch):
    """The smoke plan of one workload end to end: one process, then two under torchrun (gloo); each writes its
    result, rank 0 for the pair, with the world size it ran on."""
    import json

    monkeypatch.setattr(notebook, "results_dir", lambda: tmp_path)
    monkeypatch.setenv("TUNEKIT_SMOKE", "1")
    notebook.measure_scaling(0, ("ddp_lora",))
    one = json.loads((tmp_path / "l3_scale_ddp_lora_1gpu.json").read_text())
    two = json.loads((tmp_path / "l3_scale_ddp_lora_2gpu.json").read_text())
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert one["tokens_per_s"] > 0 and two["tokens_per_s"] > 0 and two["config"]["parallel"] == "ddp"


def test_smoke_mode(monkeypatch):
    monkeypatch.delenv("TUNEKIT_SMOKE", raising=False)
    assert not notebook.smoke_mode()
    monkeypatch.setenv("TUNEKIT_SMOKE", "0")
    assert not notebook.smoke_mode()
    monkeypatch.setenv("TUNEKIT_SMOKE", "1")
    assert notebook.smoke_mode()
