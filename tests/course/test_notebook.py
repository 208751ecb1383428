"""The notebooks' helpers (tunekit_course/notebook.py): which preset and config a cell gets on CPU (smoke mode) and on
a GPU, and where its results go. No GPU needed: smoke mode is forced with TUNEKIT_SMOKE=1."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import nbformat
import pytest
import torch

from tunekit import cli, config
from tunekit.config import REPO_ROOT
from tunekit.presets import get_preset, resolve, tiny
from tunekit_course import notebook, pages

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
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    # your own folder for this GPU, never the published one the README is made from
    assert notebook.results_dir() == REPO_ROOT / "runs" / "results" / "nvidia-h200" != notebook.RESULTS


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
    assert pages.clean_outputs(nb) is nb
    outs = nb.cells[1].outputs
    assert [o.get("data", {}).get("text/plain") for o in outs] == [
        "tokenize: 100%|██████████| 7473/7473 [00:01<00:00, 5436.05 examples/s]", None,
        "Loading: 50%|█████     | 1/2", "IntSlider(value=0)"]
    assert outs[1] == stdout and "application/vnd.jupyter.widget-view+json" in outs[3].data
    # only what the slider still shows is kept of the recorded widget state
    assert set(nb.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"]) == {"cc", "cy"}
    nbformat.validate(nb)
    assert nbformat.writes(pages.clean_outputs(nb)) == nbformat.writes(nb)  # a second pass changes nothing


def test_clean_outputs_drops_a_stuck_bar_whose_state_was_not_recorded():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("work()", outputs=[
        _view("aa", "Writing model shards:   0%|          | 0/1 [00:00<?, ?it/s]"),
        nbformat.v4.new_output("stream", name="stdout", text="done\n")])]
    pages.clean_outputs(nb)
    assert [o.output_type for o in nb.cells[0].outputs] == ["stream"] and "widgets" not in nb.metadata


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_read_correctly_untrusted_and_open_clean(path):
    text = path.read_text()
    nb = nbformat.reads(text, as_version=4)
    views = [o for c in nb.cells for o in c.get("outputs", []) if "application/vnd.jupyter.widget-view+json"
             in o.get("data", {})]
    assert not views and "widgets" not in nb.metadata, f"{path.name}: run pages.clean_outputs on it"
    assert " 0%|" not in text, f"{path.name}: a progress bar stuck at 0% is committed"
    # JupyterLab writes the kernelspec it starts into the notebook: the same one keeps the tab unchanged.
    assert nb.metadata.kernelspec == {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    assert text == nbformat.writes(nb) + "\n", f"{path.name}: not as nbformat (and JupyterLab) write it"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "*Keeping the committed outputs*" in first.source  # the README's


def test_a_command_s_output_is_printed_without_this_machine_s_folders():
    assert notebook.tidy(f"result -> {REPO_ROOT / 'runs' / 'a.json'}\n") == "result -> runs/a.json\n"
    log = ("[__recompiles] Recompiling function forward in "
           "/opt/torch/.venv/lib/python3.12/site-packages/transformers/models/llama/modeling_llama.py:295")
    assert notebook.tidy(log).endswith(" in site-packages/transformers/models/llama/modeling_llama.py:295")
    assert notebook.tidy('  File "/usr/lib/python3/dist-packages/x.py", line 3') == '  File "site-packages/x.py", line 3'
    assert notebook.tidy("torch/_dynamo/guards.py:4760] same") == "torch/_dynamo/guards.py:4760] same"
    # the command a lesson echoes before running it: its folders inside the checkout relative to it
    assert notebook.command_line(["databench", "--out-dir", REPO_ROOT / "runs" / "lesson01", "--steps", 15]) == \
        "databench --out-dir runs/lesson01 --steps 15"
    # the command that made a published result, recorded on another machine: none of its folders either
    r = {"entry": "tunekit bench --preset llama7b_lora --compare --unsloth-site /srv/lab/checkout/.unsite --data "
                  "/srv/lab/checkout/.gpudata/head/runs/gsm8k/train.jsonl --out /srv/out/r --tokenizer /tmp/tok"}
    assert notebook.entry_of(r) == ("tunekit bench --preset llama7b_lora --compare --unsloth-site .unsite --data "
                                    "runs/gsm8k/train.jsonl --tokenizer tok")


# A learner's page carries no bookkeeping of the project's: no folder of the machine that ran it (commands' output and
# the lessons' own paths are printed tidied: `notebook.tidy`, `notebook.shown`), no issue number, no target of
# tunekit's own, no path outside the repository. Provenance lives in the result files.
MACHINE_FOLDER = re.compile(r"(?<![\w.])/(?:work|root|tmp|home|opt|usr|mnt)/|\.devsite|\.gpudata")
BOOKKEEPING = re.compile(r"\bissues? ?#?\d+|\.\./shared|\btarget (?:>=|<=|\(|is)|tunekit's targets?\b|\b\d+ of \d+ met\b",
                         re.IGNORECASE)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_learner_s_page_carries_no_bookkeeping(path):
    nb = nbformat.read(path, as_version=4)
    texts = [(i, cell.source) for i, cell in enumerate(nb.cells) if cell.cell_type == "markdown"]
    texts += [(i, o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
               + str(o.get("data", {}).get("text/markdown", "")))
              for i, cell in enumerate(nb.cells) for o in cell.get("outputs", [])]
    found = [(i, m.group(0), text[max(0, m.start() - 60):m.end() + 40])
             for i, text in texts for pattern in (MACHINE_FOLDER, BOOKKEEPING) for m in pattern.finditer(text)]
    assert not found, f"{path.name}: bookkeeping on a learner's page: {found[:5]}"


def test_execute_writes_plain_text_progress_and_the_kernelspec(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEKIT_NOTEBOOK", "")  # execute() sets it for the kernel; put it back afterwards
    path = tmp_path / "bar.ipynb"
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}})
    nb.cells = [nbformat.v4.new_code_cell("from tqdm.auto import tqdm\nfor _ in tqdm(range(3), desc='work'):\n"
                                          "    pass\nprint('done')")]
    path.write_text(nbformat.writes(nb))
    pages.execute(path, timeout=120)
    text = path.read_text()
    done = nbformat.reads(text, as_version=4)
    outs = done.cells[0].outputs
    assert [o.output_type for o in outs] == ["display_data", "stream"], outs
    assert outs[0].data["text/plain"].startswith("work: 100%|██████████| 3/3 [") and list(outs[0].data) == ["text/plain"]
    assert "widgets" not in done.metadata and done.metadata.kernelspec.display_name != "Python 3"
    assert text.endswith("}\n")


def test_notebook_code_fits_a_laptop_screen():
    """No code line of a notebook is over 100 characters: every cell reads
    on a laptop screen in JupyterLab."""
    paths = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))
    assert paths
    long = [f"{path.name}, cell index {i}, line {j + 1} ({len(line)} characters): {line}"
            for path in paths for i, cell in enumerate(nbformat.read(path, as_version=4).cells)
            if cell.cell_type == "code" for j, line in enumerate(cell.source.split("\n")) if len(line) > 100]
    assert not long, "code lines over 100 characters:\n" + "\n".join(long)


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


# ---- measuring here, the published run beside, replaying it -------------------------------------------------

FAKE = "NVIDIA FakeGPU 24GB"


def _snapshot(folder):
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.iterdir())}


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A 24 GB GPU named FAKE, your folders under tmp_path; no mode variable set."""
    for var in ("TUNEKIT_SMOKE", "TUNEKIT_REPLAY", "TUNEKIT_REMEASURE", "TUNEKIT_MEMORY_GB"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(notebook, "on_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: FAKE)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(total_memory=24 * 10**9))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # its properties have no UUID: not recorded
    monkeypatch.setattr(notebook, "RUNS", tmp_path / "runs")
    return tmp_path / "runs" / "results" / "nvidia-fakegpu-24gb"


@pytest.fixture
def fake_runs(monkeypatch):
    """`notebook.run` and `notebook.torchrun` write a result file into the --out folder they are given; each
    call's (processes, arguments) is recorded."""
    calls = []

    def write(nproc, args, cwd=None):
        args = [str(a) for a in args]
        calls.append((nproc, args))
        name, out = args[args.index("--name") + 1], Path(cwd or ".") / args[args.index("--out") + 1]
        cfg = config.config_dict(resolve(args[args.index("--preset") + 1], [a for a in args[3:] if a.startswith("--")
                                                                              and "=" in a]))
        result = {"name": name, "preset": cfg["preset"], "gpu": FAKE, "world_size": nproc, "tokens_per_s": 1000.0 * nproc,
                  "peak_memory_gb": 20.0, "date": "2026-12-02T10:00:00+00:00", "config": cfg}
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(result))
        return 0

    monkeypatch.setattr(notebook, "run", lambda *args, check=True, env=None, cwd=None: write(1, args, cwd))
    monkeypatch.setattr(notebook, "torchrun", lambda nproc, *args, env=None, check=True, cwd=None:
                        write(nproc, args, cwd))
    return calls


def test_a_result_copied_in_from_another_machine_says_so(monkeypatch):
    """A result read back from your results folder says whether this GPU measured it or another machine of its
    kind did (a published result copied in): two machines of one model differ, so its figures are not yours."""
    from tunekit import results

    r = {"date": "2026-12-04T10:00:00+00:00", "gpu": "NVIDIA H200", "world_size": 1, "gpu_uuid": "aaa"}
    monkeypatch.setattr(results, "gpu_uuid", lambda: "bbb")
    assert notebook.read_back("l5_x", r) == (
        "l5_x: measured 2026-12-04 10:00 UTC on another H200 machine and copied into your results folder (its "
        "figures are that machine's, not this GPU's); TUNEKIT_REMEASURE=1 measures again")
    monkeypatch.setattr(results, "gpu_uuid", lambda: "aaa")
    assert notebook.read_back("l5_x", r).startswith("l5_x: your measurement of 2026-12-04 10:00 UTC on this GPU (H200)")
    # on a GPU, a result from before machines were recorded is not claimed for this GPU (nor for another)
    unknown = notebook.read_back("l5_x", {**r, "gpu_uuid": None})
    assert unknown.startswith("l5_x: measured 2026-12-04 10:00 UTC on H200, read from your results folder (which "
                              "machine was not recorded: this one, or another whose result was copied in)")
    assert "your measurement" not in unknown and "this GPU" not in unknown
    monkeypatch.setattr(results, "gpu_uuid", lambda: None)  # no GPU here: a CPU run's result is this machine's
    assert notebook.read_back("l5_x", {**r, "gpu_uuid": None, "gpu": "cpu"}).startswith("l5_x: your measurement of")


def test_measure_measures_this_gpu_even_where_a_published_result_exists(fake_gpu, fake_runs, capsys, monkeypatch):
    assert (notebook.RESULTS / "l4_lora_eager.json").exists()
    before = _snapshot(notebook.RESULTS)
    assert notebook.results_dir() == fake_gpu
    notebook.measure("l4_lora_eager", 1, "bench", "--preset", "llama7b_lora", "--bench-max-steps", "15")
    mine = json.loads((fake_gpu / "l4_lora_eager.json").read_text())
    assert mine["gpu"] == FAKE and len(fake_runs) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "gradient checkpointing on" in out  # LoRA 7B batch 4: ~59 GB
    assert "--grad-ckpt=true" in fake_runs[0][1] and mine["config"]["grad_ckpt"]
    # measured again later: your own result is read back, and says so; never the published one
    notebook.measure("l4_lora_eager", 1, "bench", "--preset", "llama7b_lora")
    assert len(fake_runs) == 1
    assert "your measurement of 2026-12-02 10:00 UTC on this GPU (FakeGPU 24GB); TUNEKIT_REMEASURE=1" in \
        capsys.readouterr().out
    monkeypatch.setenv("TUNEKIT_REMEASURE", "1")
    notebook.measure("l4_lora_eager", 1, "bench", "--preset", "llama7b_lora")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    notebook.measure("l3_ddp_lora", 2, "bench", "--preset", "llama7b_qlora", "--parallel", "ddp")
    assert [n for n, _ in fake_runs] == [1, 1, 2] and (fake_gpu / "l3_ddp_lora.json").exists()
    assert _snapshot(notebook.RESULTS) == before  # nothing written to the published folder
    assert "l4_lora_eager" in notebook.here() and notebook.published("l4_lora_eager")["gpu"] == "NVIDIA H200"


def test_lesson_1_s_data_benches_read_your_earlier_result_back(fake_gpu, monkeypatch, capsys):
    ran = []

    def run(*args, **kw):  # tunekit databench writes data_<experiment>.json into --out
        ran.append([str(a) for a in args])
        out = Path(args[args.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"data_{args[1]}.json").write_text(json.dumps({"name": f"data_{args[1]}", "gpu": FAKE, "rows": [1],
                                                              "date": "2026-12-02T10:00:00+00:00"}))
        return 0

    monkeypatch.setattr(notebook, "run", run)
    first = notebook.databench("train", "--preset", "llama7b_lora", "--steps", 15)
    assert first["rows"] == [1] and ran == [["databench", "train", "--preset", "llama7b_lora", "--steps", "15",
                                             "--out", str(fake_gpu)]]
    capsys.readouterr()
    assert notebook.databench("train", "--steps", 15) == first and len(ran) == 1  # read back, not run again
    assert "data_train: your measurement of 2026-12-02 10:00 UTC on this GPU" in capsys.readouterr().out
    monkeypatch.setenv("TUNEKIT_REMEASURE", "1")
    notebook.databench("train", "--steps", 15)
    assert len(ran) == 2


def test_replay_reads_the_published_result_and_writes_nothing(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("TUNEKIT_REPLAY", "1")
    monkeypatch.delenv("TUNEKIT_SMOKE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a laptop
    monkeypatch.setattr(notebook, "RUNS", tmp_path / "runs")

    def never(*a, **k):
        raise AssertionError("replay mode ran a command")

    monkeypatch.setattr(notebook.subprocess, "Popen", never)
    before = _snapshot(notebook.RESULTS)
    assert notebook.results_dir() == notebook.RESULTS and notebook.gpu_results()
    notebook.measure("l4_lora_eager", 1, "bench", "--preset", "llama7b_lora")
    notebook.measure("l3_ddp_lora", 2, "bench", "--preset", "llama7b_lora", "--parallel", "ddp")
    out = capsys.readouterr().out
    pub = notebook.published("l4_lora_eager")
    assert f"l4_lora_eager: replaying the published H200 result of {pub['date'][:10]}" in out
    assert "(not measured here)" in out
    assert "l3_ddp_lora: replaying the published 2x H200 result" in out
    assert notebook.run("bench", "--preset", "tiny", "--name", "x", "--out", notebook.RESULTS) == 0
    assert notebook.torchrun(2, "commbench", "--name", "x", "--out", notebook.RESULTS) == 0
    assert notebook.save({"name": "x"}) is None
    assert "replay mode" in capsys.readouterr().out
    assert "replayed" in notebook.beside(["l4_lora_eager"]) and f"{pub['tokens_per_s']:,.0f} tok/s" in notebook.beside(
        ["l4_lora_eager"])
    assert notebook.config_for("llama7b_lora").preset == "llama7b_lora"  # the published run's configs
    assert _snapshot(notebook.RESULTS) == before and not (tmp_path / "runs").exists()


def test_fit_here_picks_the_nearest_config_that_fits_and_leaves_a_fitting_one(fake_gpu, capsys, monkeypatch):
    from tunekit.estimate import CUDA_CONTEXT_BYTES, Setup, estimate_memory_for
    from tunekit.fitting import RESERVE_FACTOR

    def peak(args):
        parsed, rest = cli.make_parser().parse_known_args(args)
        return estimate_memory_for(Setup.of(resolve(parsed.preset, rest)))["total"] * RESERVE_FACTOR

    budget = 24e9 - CUDA_CONTEXT_BYTES
    lora = ["bench", "--preset", "llama7b_lora", "--bench-max-steps", "15"]
    fitted = notebook.fit_here(lora)
    assert fitted[:len(lora)] == lora and "--grad-ckpt=true" in fitted and peak(lora) > budget >= peak(fitted)
    out = capsys.readouterr().out
    assert f"does not fit {FAKE} (22 GiB)" in out and "running the nearest config that fits instead: gradient " \
        "checkpointing on, micro-batch 4" in out
    qlora = ["bench", "--preset", "llama7b_qlora"]  # ~12 GB: fits as it is, and nothing is said
    assert notebook.fit_here(qlora) == qlora and capsys.readouterr().out == ""
    # the article's recipe (QLoRA, checkpointing, 8 x 7 a step): a smaller micro-batch, the same samples a step
    before = notebook.fit_here(["train", "--preset", "article_before"])
    assert before[-2:] == ["--batch-size=7", "--grad-accum=8"] and "a smaller micro-batch" in capsys.readouterr().out
    monkeypatch.setenv("TUNEKIT_MEMORY_GB", "8")  # run as on an 8 GB card: QLoRA at a smaller micro-batch
    small = notebook.fit_here(qlora)
    assert "--batch-size=" in " ".join(small) and peak(small) <= 8e9
    assert "a card of 8 GB (TUNEKIT_MEMORY_GB)" in capsys.readouterr().out
    for kept in (["converge", "--preset", "shakespeare"], ["bench", "--preset", "llama1b_full", "--dtype", "fp32"]):
        assert notebook.fit_here(kept) == kept  # not a bench or train of a preset; no estimate of fp32


def test_nearest_fit_under_compile_recomputes_before_it_checkpoints():
    """A compiled step that does not fit first keeps its micro-batch and recomputes what the adapters read
    (`--compile-recompute`: 2% of the 7B LoRA step on an H100, checkpointing a quarter or more); where that alone
    does not fit at the micro-batch asked, checkpointing as before; never without compile."""
    from tunekit.fitting import RESERVE_FACTOR

    compiled = ["--compile", "regional", "--fast-lora", "true"]
    flags, lines, est = notebook.nearest_fit("llama7b_lora", compiled, 48e9, "a 48 GB card")
    assert flags == ["--compile-recompute=true"] and "recomputing what the adapters read, micro-batch 4" in lines[-1]
    assert est * RESERVE_FACTOR <= 48e9
    assert notebook.nearest_fit("llama7b_lora", compiled, 40e9)[0] == ["--grad-ckpt=true"]  # recompute: too big
    assert notebook.nearest_fit("llama7b_lora", [], 48e9)[0] == ["--grad-ckpt=true"]  # eager: no such switch


def test_fit_here_is_a_no_op_in_smoke_mode(smoke):
    args = ["bench", "--preset", "llama7b_lora"]
    assert notebook.fit_here(args) == args


def test_on_one_gpu_a_two_gpu_run_is_not_launched_and_the_published_figures_stand_alone(fake_gpu, fake_runs, capsys,
                                                                                       monkeypatch):
    """Lesson 3 on a machine of one GPU: its one-GPU runs are measured, each two-GPU one says why it is not, and
    the claim that needs two GPUs prints the published verdict alone; with two GPUs both run."""
    assert notebook.too_few_gpus(1) is None and notebook.too_few_gpus(2) == "needs 2 GPUs, this machine has 1"
    notebook.measure("l3_lora_1gpu", 1, "bench", "--preset", "llama7b_lora")
    notebook.measure("l3_ddp_lora", 2, "bench", "--preset", "llama7b_lora", "--parallel", "ddp")
    assert [n for n, _ in fake_runs] == [1] and not (fake_gpu / "l3_ddp_lora.json").exists()
    out = capsys.readouterr().out
    assert "l3_ddp_lora: not measured here (needs 2 GPUs, this machine has 1); the published result is shown" in out
    table = notebook.beside(["l3_lora_1gpu", "l3_ddp_lora"]).splitlines()
    assert table[2].split()[1] == "-" and "tok/s" in table[2]  # the published figure alone
    notebook.verdict("C10", gpus=2)
    yours, published = capsys.readouterr().out.splitlines()
    assert yours == "C10 from your results: no verdict (needs 2 GPUs, this machine has 1)"
    assert published.startswith("published, 2x H200, H200: C10 verdict: holds")
    rs = {"a_one": {"world_size": 1, "wall_s": 120.0}, "a_two": {"world_size": 2, "wall_s": 600.0}}
    assert notebook.lesson_seconds("a_", rs=rs) == 720 + 2 * notebook.START_S
    assert notebook.lesson_seconds("a_", rs=rs, here=True) == 120 + notebook.START_S  # the two-GPU run left out
    mine = notebook._minutes(notebook.lesson_seconds("l3_", here=True))
    assert f", those that fit this machine's GPUs {mine} (an estimate" in notebook.intro("l3_")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert notebook.too_few_gpus(2) is None
    assert "those that fit" not in notebook.intro("l3_")
    notebook.measure("l3_ddp_lora", 2, "bench", "--preset", "llama7b_lora", "--parallel", "ddp")
    assert [n for n, _ in fake_runs] == [1, 2]
    monkeypatch.setenv("TUNEKIT_SMOKE", "1")  # off a GPU the CPU processes stand in: never too few
    monkeypatch.setattr(notebook, "on_gpu", lambda: False)
    assert notebook.too_few_gpus(2) is None


def test_beside_and_verdict_show_yours_beside_the_published_figure(fake_gpu, fake_runs, capsys):
    notebook.measure("l4_lora_eager", 1, "bench", "--preset", "llama7b_lora")
    table = notebook.beside(["l4_lora_eager", "l4_lora_liger"])
    head, eager, liger = table.splitlines()[:3]
    assert f"here, {FAKE}" in head and "published, NVIDIA H200" in head and "here / published" in head
    pub = notebook.published("l4_lora_eager")["tokens_per_s"]
    assert "1,000 tok/s*" in eager and f"{pub:,.0f} tok/s" in eager and f"{1000 / pub:.2f}x" in eager
    assert liger.split()[1] == "-"  # not measured here
    assert "* l4_lora_eager: ran with grad_ckpt on" in table
    capsys.readouterr()
    notebook.verdict("C13")
    yours, published = capsys.readouterr().out.splitlines()
    assert yours.startswith(f"yours, {FAKE}: C13 verdict: unmeasured")
    assert published.startswith("published, H200: C13 verdict:") and "unmeasured" not in published
    assert "| C13 | unmeasured |" in notebook.verdicts_table()


def test_publish_copies_a_folder_of_results(fake_gpu, fake_runs, monkeypatch, tmp_path, capsys):
    published = tmp_path / "published"
    monkeypatch.setattr(notebook, "RESULTS", published)
    assert notebook.main(["--publish"]) == 2  # nothing measured on this GPU yet
    assert "does not exist" in capsys.readouterr().err
    notebook.measure("l4_lora_eager", 1, "bench", "--preset", "llama7b_qlora")
    (fake_gpu / "l4_lora_eager.png").write_bytes(b"png")
    assert notebook.main(["--publish"]) == 0
    out = capsys.readouterr().out
    assert "published l4_lora_eager.json" in out and "2 files copied" in out
    assert sorted(p.name for p in published.iterdir()) == ["l4_lora_eager.json", "l4_lora_eager.png"]
    assert json.loads((published / "l4_lora_eager.json").read_text())["gpu"] == FAKE
    assert notebook.main(["--publish", str(tmp_path / "nope")]) == 2
    assert "nope does not exist: nothing to publish" in capsys.readouterr().err
    assert notebook.main(["--publish", str(fake_gpu / "l4_lora_eager.json")]) == 2  # a file, not its folder
    assert f"is a file: name the folder that holds the results to publish (python -m tunekit_course.notebook " \
           f"--publish {fake_gpu})" in capsys.readouterr().err


def test_seed_copies_the_published_results_of_this_gpu_s_model_and_the_named_ones(fake_gpu, monkeypatch, tmp_path,
                                                                                 capsys):
    published = tmp_path / "published"
    published.mkdir()
    for name, gpu in (("l2_a", FAKE), ("l2_b", "NVIDIA H100 80GB HBM3"), ("l5c_c", "NVIDIA H100 80GB HBM3")):
        (published / f"{name}.json").write_text(json.dumps({"name": name, "gpu": gpu}))
    # two processes on two of this model: not copied to a machine of one GPU, where it could not be yours
    (published / "l3_ddp.json").write_text(json.dumps({"name": "l3_ddp", "gpu": FAKE, "world_size": 2}))
    monkeypatch.setattr(notebook, "RESULTS", published)
    fake_gpu.mkdir(parents=True)
    (fake_gpu / "l2_a.json").write_text('{"name": "l2_a", "gpu": "mine"}')  # yours: kept
    assert notebook.main(["--seed", "l5c_"]) == 0
    assert "1 published results copied into" in capsys.readouterr().out
    assert sorted(p.name for p in fake_gpu.iterdir()) == ["l2_a.json", "l5c_c.json"]
    assert json.loads((fake_gpu / "l2_a.json").read_text())["gpu"] == "mine"
    (fake_gpu / "l2_a.json").unlink()
    assert [p.name for p in notebook.seed()] == ["l2_a.json"]
    monkeypatch.setattr(notebook, "on_gpu", lambda: False)  # a CPU, or TUNEKIT_SMOKE=1
    assert notebook.main(["--seed"]) == 2 and "no CUDA GPU here" in capsys.readouterr().err


def test_measure_takes_lesson_4_or_scaling_and_points_lesson_5_to_fullrun(monkeypatch, capsys):
    """Lesson 5's runs are fullrun's whole runs: `--measure 5` is refused, not taken for lesson 4's plan."""
    monkeypatch.setattr(notebook, "measure_in_parallel", lambda *a: pytest.fail("nothing may run"))
    assert notebook.main(["--measure", "5", "2"]) == 2
    assert "python -m tunekit_course.fullrun SECONDS" in capsys.readouterr().err


def test_executing_on_a_gpu_says_first_which_sections_will_skip_and_strict_refuses(fake_gpu, monkeypatch, capsys):
    from tunekit import speedups
    from tunekit_course import pages

    ran = []
    monkeypatch.setattr(pages, "execute", lambda path: ran.append(path) or path)
    monkeypatch.setattr(speedups, "fp8_available", lambda: "torchao is not installed (pip install torchao)")
    monkeypatch.setattr(speedups, "liger_available", lambda: "")
    assert notebook.main(["--strict", "notebooks/04_speedups.ipynb"]) == 2 and not ran
    err = capsys.readouterr().err
    assert "lesson 4's fp8 section will be skipped here: torchao is not installed" in err and "kernels" not in err
    assert notebook.main(["notebooks/04_speedups.ipynb"]) == 0 and ran == ["notebooks/04_speedups.ipynb"]
    monkeypatch.setattr(speedups, "fp8_available", lambda: "")
    assert notebook.main(["--strict", "notebooks/00_quickstart.ipynb"]) == 0 and ran[-1] == "notebooks/00_quickstart.ipynb"


def test_intro_says_what_it_measures_and_how_long_the_published_run_took(fake_gpu, monkeypatch, capsys):
    minutes = notebook.lesson_seconds("l4_") / 60
    assert 5 < minutes < 60  # lesson 4's published results: builds, warm-ups and steps, the convergence races
    text = notebook.intro("l4_")
    assert text.startswith(f"This lesson measures {FAKE} (22 GiB) here; on the published H200 run its "
                           f"measurements took about {minutes:.0f} min (an estimate")
    assert "runs/results" not in text or "nvidia-fakegpu-24gb" in text
    assert capsys.readouterr().out.strip() == text
    monkeypatch.setenv("TUNEKIT_MEMORY_GB", "16")
    assert "as a card of 16 GB (TUNEKIT_MEMORY_GB)" in notebook.intro("l4_")
    monkeypatch.setenv("TUNEKIT_SMOKE", "1")
    monkeypatch.setattr(notebook, "on_gpu", lambda: False)
    assert notebook.intro("l4_").startswith("smoke mode: tiny model on CPU")
    assert "parity check" in notebook.intro()
    monkeypatch.setenv("TUNEKIT_REPLAY", "1")
    assert notebook.intro("l4_").startswith("replay mode (TUNEKIT_REPLAY=1)")


def test_run_seconds_adds_the_build_warm_up_and_timed_steps():
    r = {"build_s": 10.0, "first_step_s": 3.0, "warmup_step_times_s": [3.0, 1.0], "step_time_s": 0.5,
         "step_times_s": [0.5, 0.4, 0.6]}
    assert notebook.run_seconds(r) == pytest.approx(10 + 4 + 1.5)  # the first step is the first warm-up step
    assert notebook.run_seconds({"wall_s": 61.6, "build_s": 10.0}) == 61.6
    assert notebook.run_seconds({"runs": [r, {"wall_s": 5.0}]}) == pytest.approx(20.5)


def test_bench_and_train_run_under_tunekit_memory_gb(monkeypatch, capsys):
    import contextlib

    from tunekit import commands, memory

    monkeypatch.delenv("TUNEKIT_MEMORY_GB", raising=False)
    assert commands.env_memory_cap()[1] is None
    monkeypatch.setenv("TUNEKIT_MEMORY_GB", "24")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert commands.env_memory_cap()[1] is None and "ignored: no CUDA GPU" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capped = []
    monkeypatch.setattr(memory, "memory_cap", lambda gb, device=None: capped.append((gb, device))
                        or contextlib.nullcontext())
    _, gb = commands.env_memory_cap()
    assert gb == 24.0 and capped == [(24.0, 0)]


RECOMPILE_LOG = """\
V1205 07:32:47.566000 29320 torch/_dynamo/guards.py:5396] [0/1] [__recompiles] Recompiling function forward_with_checkpointing in /x/.venv/lib/python3.11/site-packages/transformers/modeling_layers.py:89
V1205 07:32:47.566000 29320 torch/_dynamo/guards.py:5396] [0/1] [__recompiles]     triggered by the following guard failure(s):
V1205 07:32:47.566000 29320 torch/_dynamo/guards.py:5396] [0/1] [__recompiles]     - 0/0: tensor 'args[0]' requires_grad mismatch. expected requires_grad=0
V1205 07:32:47.967000 29320 torch/_dynamo/guards.py:5396] [0/2] [__recompiles] Recompiling function forward_with_checkpointing in /x/.venv/lib/python3.11/site-packages/transformers/modeling_layers.py:89
V1205 07:32:47.967000 29320 torch/_dynamo/guards.py:5396] [0/2] [__recompiles]     triggered by the following guard failure(s):
V1205 07:32:47.967000 29320 torch/_dynamo/guards.py:5396] [0/2] [__recompiles]     - 0/1: tensor 'args[0]' requires_grad mismatch. expected requires_grad=1
V1205 07:32:47.967000 29320 torch/_dynamo/guards.py:5396] [0/2] [__recompiles]     - 0/0: tensor 'args[0]' size mismatch at index 1. expected 128, actual 64
"""


def test_a_lesson_shows_a_runs_attention_banner_once_and_sums_up_its_recompiles(monkeypatch, capsys):
    # a `tunekit train` child process as notebook.run reads it: its output lines, then its exit code
    outputs = []

    class Child:
        def __init__(self, cmd, **kw):
            self.stdout = iter(outputs.pop(0).splitlines(keepends=True))

        def wait(self):
            return 0

    monkeypatch.setattr(notebook.subprocess, "Popen", Child)
    monkeypatch.setattr(notebook, "_SHOWN_ONCE", set())
    banner = "attention: auto: PyTorch SDPA (CPU); sdpa_backend=auto: PyTorch's default order (CPU)\n"
    outputs += [banner + "done: 12 steps\n", banner + RECOMPILE_LOG + "done: 12 steps\n",
                banner.replace("auto", "eager", 1) + "done\n"]
    notebook.run("train", "--preset", "tiny")
    notebook.run("train", "--preset", "tiny", env={"TORCH_LOGS": "recompiles"})
    notebook.run("train", "--preset", "tiny", "--attention", "eager")
    out = capsys.readouterr().out
    assert out.count("attention: auto") == 1 and out.count("attention: eager") == 1  # once, and again if it changes
    assert out.count("[__recompiles]") == 7  # the log itself, as PyTorch wrote it
    assert ("TORCH_LOGS=recompiles, in short: 2 recompile(s) of forward_with_checkpointing "
            "(transformers/modeling_layers.py:89): 3 graphs of it. The guards that failed: tensor 'args[0]' "
            "requires_grad mismatch. expected requires_grad=0; tensor 'args[0]' requires_grad mismatch. expected "
            "requires_grad=1; tensor 'args[0]' size mismatch at index 1. expected 128, actual 64") in out
    assert notebook.recompiles(["step 1/3: loss 6.6"]) is None


def test_quiet_turns_the_libraries_progress_bars_off_inside_and_back_as_they_were():
    import datasets
    import huggingface_hub.utils as hub
    from transformers.utils import logging as hf_logging

    state = lambda: (hf_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled(),
                     hub.are_progress_bars_disabled())
    before = state()
    with notebook.quiet():
        assert state() == (False, False, True)
    assert state() == before
    datasets.disable_progress_bars()  # one the caller had off stays off
    try:
        with notebook.quiet():
            pass
        assert not datasets.is_progress_bar_enabled()
    finally:
        if before[1]:
            datasets.enable_progress_bars()


def test_lesson_2_s_steps_read_your_earlier_results_back_and_measure_the_rest(fake_gpu, monkeypatch, capsys):
    from tunekit import bench

    fake_gpu.mkdir(parents=True)
    earlier = {"name": "l2_a", "gpu": FAKE, "world_size": 1, "tokens_per_s": 1.0, "peak_memory_gb": 1.0,
               "date": "2026-12-01T09:00:00+00:00"}
    (fake_gpu / "l2_a.json").write_text(json.dumps(earlier))
    asked = []

    def run_many(configs, out, reuse=True, memory_gb=0.0, verbose=True):
        asked.append((sorted(configs), reuse, memory_gb))
        return {n: {"name": n, "tokens_per_s": 2.0} for n in configs}

    monkeypatch.setattr(bench, "run_many", run_many)
    rs = notebook.bench_here({"l2_a": "cfg a", "l2_b": "cfg b"}, memory_gb=23.0)
    assert rs["l2_a"] == earlier and rs["l2_b"]["tokens_per_s"] == 2.0 and asked == [(["l2_b"], True, 23.0)]
    assert "l2_a: your measurement of 2026-12-01 09:00 UTC on this GPU" in capsys.readouterr().out
    monkeypatch.setenv("TUNEKIT_REMEASURE", "1")  # both measured again, none reused
    notebook.bench_here({"l2_a": "cfg a", "l2_b": "cfg b"})
    assert asked[-1] == (["l2_a", "l2_b"], False, 0.0) and notebook.yours("l2_a") is None
    monkeypatch.delenv("TUNEKIT_REMEASURE")
    monkeypatch.setenv("TUNEKIT_REPLAY", "1")  # the published results; nothing runs
    assert notebook.bench_here({"l2_lora_b4": "cfg"})["l2_lora_b4"]["gpu"] == "NVIDIA H200" and len(asked) == 2
