"""Helpers the course notebooks share: choosing the preset for the hardware, running commands, results.

A notebook picks the real (GPU) preset when a CUDA GPU is present and the tiny one otherwise, or whenever
TUNEKIT_SMOKE=1 — so the same notebook runs on an H200 for the course and on a CPU in CI. Heavy runs go
through the `tunekit` command in a child process: the GPU memory is freed when it exits, and the notebook
reads the result file back.

Committed notebooks are read untrusted, in JupyterLab or on GitHub, where widgets do not render: `clean_outputs`
turns the progress-bar widgets of `datasets`/`transformers` (tqdm) into the plain text of their final state,
so they do not read "0%" forever.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from tunekit.config import REPO_ROOT
from tunekit.optim import BNB_OPTIMIZERS
from tunekit_course import RESULTS


def smoke_mode() -> bool:
    """True when TUNEKIT_SMOKE=1: notebooks and benches pick the tiny preset whatever the hardware."""
    return os.environ.get("TUNEKIT_SMOKE", "") not in ("", "0")


def on_gpu() -> bool:
    """True when the notebook should run its real, GPU-sized experiments."""
    return torch.cuda.is_available() and not smoke_mode()


def pick_preset(gpu_preset: str) -> str:
    """`gpu_preset` on a GPU, `tiny` on CPU or in smoke mode; prints which and why."""
    if on_gpu():
        print(f"mode: GPU ({torch.cuda.get_device_name()}) -> preset {gpu_preset}")
        return gpu_preset
    why = "TUNEKIT_SMOKE=1" if smoke_mode() else "no CUDA GPU"
    print(f"mode: smoke ({why}) -> preset tiny; the committed outputs come from the GPU run")
    return "tiny"


# (GPU value, its CPU stand-in); FlexAttention has no backward on CPU
GPU_ONLY = {"method": ("qlora", "lora"), "attention": ("flex_attention", "sdpa"), "kernels": ("liger", "none"),
            "loss": ("liger", "chunked"), "fp8": (True, False)}
# bitsandbytes' optimizers (CUDA only) -> torch's of the same family
GPU_ONLY_OPTIMIZERS = {name: "lion" if "lion" in name else "adamw" for name in BNB_OPTIMIZERS}


def config_for(gpu_preset: str, **overrides):
    """The config a notebook cell measures: `gpu_preset` with `overrides` on a GPU; on CPU (smoke mode) the
    tiny preset with the same switches, at most batch 8 x 128 tokens, and the GPU-only ones swapped for
    their stand-ins (QLoRA -> LoRA and bitsandbytes' optimizers -> torch's: bitsandbytes needs CUDA;
    FlexAttention -> SDPA: flex has no backward on CPU; Liger and FP8 off: GPU kernels), so every cell runs."""
    from tunekit.presets import get_preset, tiny

    if on_gpu():
        return get_preset(gpu_preset, **overrides)
    gpu_fields = get_preset(gpu_preset)
    keep = ("method", "grad_ckpt", "grad_ckpt_offload", "embed_offload", "optimizer", "loss", "lora_input_cast",
            "attention", "sdpa_backend", "batch_size", "packing", "compile", "kernels", "fp8", "tf32")
    kw = {k: getattr(gpu_fields, k) for k in keep}
    kw.update({k: v for k, v in overrides.items() if k in keep or k.startswith("bench_")})
    for field, (gpu_value, cpu_value) in GPU_ONLY.items():
        if kw.get(field) == gpu_value:
            kw[field] = cpu_value
    kw["optimizer"] = GPU_ONLY_OPTIMIZERS.get(kw["optimizer"], kw["optimizer"])
    if kw["method"] != "qlora":
        kw.pop("peft_kbit_prepare", None)  # QLoRA's own preparation
    kw["batch_size"] = min(kw["batch_size"], 8)
    return tiny(**kw, vocab_size=1024, max_length=128, out_dir=str(REPO_ROOT / "runs" / "smoke"))


def results_dir() -> Path:
    """Where this run's results go: the published folder on a GPU, a scratch folder in smoke mode, so a
    CPU run never overwrites the GPU results the notebooks are read with."""
    return RESULTS if on_gpu() else REPO_ROOT / "runs" / "smoke-results"


def run(*args: str, check: bool = True, env: dict | None = None) -> int:
    """Run `tunekit ARGS...` in a child process, streaming its output into the notebook; `env` adds
    variables for this run only."""
    cmd = [sys.executable, "-m", "tunekit.cli", *map(str, args)]
    extra = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    print(f"$ {extra + ' ' if extra else ''}tunekit " + " ".join(map(str, args)), flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in proc.stdout:
        print(line, end="")
    code = proc.wait()
    if check and code != 0:
        raise RuntimeError(f"tunekit {' '.join(map(str, args))} failed with exit code {code}")
    return code


def torchrun(nproc: int, *args: str, env: dict | None = None, check: bool = True) -> int:
    """Launch `tunekit ARGS...` on `nproc` processes with torchrun (one per GPU, or gloo processes on a CPU),
    streaming rank 0's output; `env` adds variables (NCCL's, say) for this launch only. A notebook never
    starts a process group in its own kernel: each launch is a fresh set of processes."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    extra = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    print(f"$ {extra + ' ' if extra else ''}torchrun --nproc_per_node {nproc} -m tunekit.cli "
          + " ".join(map(str, args)), flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(port), "-m", "tunekit.cli", *map(str, args)]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1",
                "LOGLEVEL": "ERROR", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
    last, held = None, []  # `held`: a traceback, printed at the end unless it is only the launcher's report
    for line in proc.stdout:
        if line.startswith(("W1", "E1", "I1", "[W", "*****", "Setting OMP_NUM_THREADS")) or line == last:
            continue  # the launcher's chatter, and the same line from a second rank
        if held or line.startswith("Traceback (most recent call last)"):
            held.append(line)
        else:
            print(line, end="")
        last = line
    code = proc.wait()
    if held and any("ChildFailedError" in h for h in held) and not any("[rank" in h for h in held):
        print(f"torchrun: a process failed (exit code {code}); its error is above")
    else:
        print("".join(held), end="")
    if check and code != 0:
        raise RuntimeError(f"torchrun ... tunekit {' '.join(map(str, args))} failed with exit code {code}")
    return code


def measure(name: str, nproc: int, *args, env: dict | None = None) -> None:
    """Run `tunekit ARGS... --name NAME --out <results>` on `nproc` processes (1: a plain child process), unless
    on a GPU the published result NAME exists: then say where it came from and read it as it is.
    TUNEKIT_REMEASURE=1 measures again."""
    out = results_dir()
    path = out / f"{name}.json"
    if on_gpu() and path.exists() and os.environ.get("TUNEKIT_REMEASURE", "") in ("", "0"):
        import json

        r = json.loads(path.read_text())
        print(f"{name}: the published result of {r['date'][:16]}, commit {str(r['commit'])[:7]}, made by "
              f"`{r['entry'].split(': ')[-1]}` (TUNEKIT_REMEASURE=1 measures it again)")
        return
    args = (*args, "--name", name, "--out", out)
    if nproc == 1:
        run(*args, env=env)
    else:
        torchrun(nproc, *args, env=env)


def measure_in_parallel(plan: list[tuple[str, list, str]], gpus: int) -> None:
    """Run `measure` for each (name, args, cache) of `plan` on `gpus` GPUs at once, one run per GPU at a time
    (CUDA_VISIBLE_DEVICES); runs sharing a `cache` key go to one GPU in order (a cold compile, then the warm
    one), the others share what is left. For the GPU machine: a notebook runs its plan one at a time."""
    import threading
    from collections import deque

    queues = [deque() for _ in range(gpus)]
    by_cache: dict[str, int] = {}
    for item in plan:
        key = item[2].partition(":")[2]
        if key and key in by_cache:
            queues[by_cache[key]].append(item)
            continue
        i = min(range(gpus), key=lambda g: len(queues[g]))
        queues[i].append(item)
        if key:
            by_cache[key] = i

    def worker(gpu: int) -> None:
        while queues[gpu]:
            name, args, cache = queues[gpu].popleft()
            env = {"CUDA_VISIBLE_DEVICES": str(gpu), **cache_env(cache)}
            try:
                measure(name, 1, *args, env=env)
            except RuntimeError as e:  # one failed run does not stop the others; its error is printed
                print(f"{name}: {e}")

    threads = [threading.Thread(target=worker, args=(g,)) for g in range(gpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def cache_env(cache: str) -> dict:
    """The environment of a compile with inductor's and Triton's caches in a folder of its own. `cache`: ''
    (the default caches), 'cold:KEY' (KEY's folder, emptied now) or 'warm:KEY' (KEY's folder as the cold run
    left it)."""
    import shutil

    if not cache:
        return {}
    state, _, key = cache.partition(":")
    folder = REPO_ROOT / "runs" / "compile-cache" / key
    if state == "cold":
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    return {"TORCHINDUCTOR_CACHE_DIR": str(folder), "TRITON_CACHE_DIR": str(folder / "triton")}


def lesson4_plan(gpu: bool) -> dict[str, list[tuple[str, list, str]]]:
    """Lesson 4's measurements by section: (result name, `tunekit` arguments, compile cache: see `cache_env`).
    On a GPU: 7B LoRA/QLoRA steps (seq 2048), a 1.1B full fine-tune for the optimizers and fp32, a 10M model
    trained from scratch on tinyshakespeare. In smoke mode: the tiny model, GPU-only switches left out."""
    # 7B steps of about a second: 15 timed steps hold the median's error near 1% (noise_lora_b4: 0.2% spread)
    lora = ["bench", "--preset", "llama7b_lora", "--bench-max-steps", "15"]
    if not gpu:
        small = ["--bench-warmup", "1", "--bench-steps", "3", "--bench-max-steps", "3", "--max-length", "128"]
        tiny = ["bench", "--preset", "tiny", *small]
        tiny_converge = ["--max-steps", "20", "--eval-every", "10", "--hidden-size", "64", "--num-layers", "2",
                         "--num-heads", "4", "--intermediate-size", "128", "--batch-size", "8", "--max-length", "128",
                         "--warmup-steps", "2"]
        return {
            "tf32": [],
            "compile": [("l4_lora_eager", tiny, ""), ("l4_lora_regional_cold", [*tiny, "--compile", "regional"],
                                                     "cold:regional")],
            "optimizers": [(f"l4_opt_{o}", [*tiny, "--method", "full", "--optimizer", o], "") for o in ("adamw", "lion")],
            "converge": [(f"l4_converge_{o}", ["converge", "--preset", "shakespeare", "--sweep", f"{o}={lr}",
                                               *tiny_converge], "") for o, lr in (("adamw", 1e-3), ("lion", 1e-4))],
            "kernels": [], "fp8": []}
    one_b = ["bench", "--preset", "llama1b_full"]
    qlora = ["bench", "--preset", "llama7b_qlora", "--bench-max-steps", "15"]
    return {
        "tf32": [("l4_tf32_fp32_off", [*one_b, "--dtype", "fp32", "--batch-size", "2", "--tf32", "false"], ""),
                 ("l4_tf32_fp32_on", [*one_b, "--dtype", "fp32", "--batch-size", "2", "--tf32", "true"], ""),
                 ("l4_lora_tf32_off", [*lora, "--tf32", "false"], "")],
        "compile": [("l4_lora_eager", lora, ""),
                    ("l4_lora_regional_cold", [*lora, "--compile", "regional"], "cold:regional"),
                    ("l4_lora_regional_warm", [*lora, "--compile", "regional"], "warm:regional"),
                    ("l4_lora_model_cold", [*lora, "--compile", "model"], "cold:model"),
                    ("l4_qlora_eager", [*qlora], ""),
                    ("l4_qlora_regional_cold", [*qlora, "--compile", "regional"], "cold:qlora")],
        "optimizers": [(f"l4_opt_{o}", [*one_b, "--optimizer", o], "") for o in
                       ("adamw", "adamw_foreach", "adamw8bit", "paged_adamw8bit", "lion", "lion_pytorch", "lion8bit")],
        # two results, one per GPU; Lion's rates are AdamW's / 10 (the paper's rule), each range around its best
        "converge": [("l4_converge_adamw", ["converge", "--preset", "shakespeare", "--sweep",
                                            "adamw=1e-3,3e-3,1e-2;adamw8bit=1e-3,3e-3,1e-2"], ""),
                     ("l4_converge_lion", ["converge", "--preset", "shakespeare", "--sweep",
                                           "lion=1e-4,3e-4,1e-3;lion8bit=1e-4,3e-4,1e-3"], "")],
        "kernels": [("l4_lora_liger", [*lora, "--kernels", "liger", "--loss", "liger"], ""),
                    ("l4_lora_liger_regional", [*lora, "--kernels", "liger", "--loss", "liger", "--compile", "regional"],
                     "cold:liger")],
        "fp8": [("l4_lora_fp8", [*lora, "--fp8"], ""),
                ("l4_lora_fp8_regional", [*lora, "--fp8", "--compile", "regional"], "cold:fp8")]}


# Lesson 5's waterfall: from the article's "before" to tunekit's "after", one technique at a time. Each step is
# (label, the config fields it changes); each run keeps the ones before it. The last step is `llama7b_after`
# exactly (tests/course/test_notebook.py checks it), so the bars add up to the two ends.
LESSON5_STEPS = [
    ("before: the article's recipe", {}),
    ("+ offline tokenization", {"tokenize": "offline"}),
    ("+ DataLoader workers, pinned memory", {"num_workers": 2, "pin_memory": True, "persistent_workers": True}),
    ("+ SDPA (cuDNN) attention", {"attention": "auto"}),
    ("+ no peft casts or k-bit upcasts, chunked loss", {"lora_input_cast": False, "peft_kbit_prepare": False,
                                                        "loss": "chunked"}),
    # 4 packed rows of 2,048 tokens hold about as many samples as 8 x 7 padded ones: the step count stays
    ("+ packed rows", {"packing": "auto", "batch_size": 4, "grad_accum": 1}),
    ("+ bf16 LoRA without checkpointing (fits the GPU)", {"method": "lora", "grad_ckpt": False}),
    ("+ TF32, fused AdamW", {"tf32": True, "optimizer": "adamw"}),
    ("+ regional compile: the after recipe", {"compile": "regional"}),
]


def lesson5_runs(fraction: float) -> list[tuple[str, str, list[str]]]:
    """(result name, label, `tunekit bench` arguments) of each waterfall step: `--epoch FRACTION` of GSM8K
    from a fresh folder, the `llama7b_before` preset with the fields of every step so far."""
    from tunekit.presets import llama7b_before

    fields: dict = {}
    out = []
    for i, (label, change) in enumerate(LESSON5_STEPS):
        fields.update(change)
        args = [f"--{k.replace('_', '-')}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()]
        llama7b_before(**fields)  # every step is a valid config
        name = "l5_before" if i == 0 else "l5_after" if i == len(LESSON5_STEPS) - 1 else f"l5_step{i}"
        out.append((name, label, ["bench", "--preset", "llama7b_before", "--epoch", str(fraction), *args]))
    return out


LESSON5_FRACTION = 0.1  # of GSM8K's epoch: the article's recipe runs ~2 min, all nine runs fit one 10-min call
# The tiny stand-in of a CPU smoke run: QLoRA -> LoRA (bitsandbytes needs CUDA), a small model and vocabulary.
LESSON5_SMOKE = ["--method=lora", "--peft-kbit-prepare=false", "--hidden-size=64", "--num-layers=2", "--num-heads=4",
                 "--num-kv-heads=4", "--intermediate-size=128", "--vocab-size=0", "--tokenizer-vocab=1024",
                 "--max-length=256"]


# lesson5_plan's runs beside the waterfall, both of the after recipe
LESSON5_VARIANTS = {"l5_after_warm": "the after recipe again, its compiled kernels cached",
                    "l5_after_fp8": "the after recipe with FP8 matmuls (torchao, rowwise)",
                    "l5_after_fast_fp8": "the after recipe with the fused LoRA and FP8 weights quantized once "
                                         "(issue 14)"}


def lesson5_labels() -> dict[str, str]:
    """{result name: what it measures} for every run of `lesson5_plan`: the waterfall in order, then the
    variants."""
    return {**{name: label for name, label, _ in lesson5_runs(LESSON5_FRACTION)}, **LESSON5_VARIANTS}


def lesson5_prepare(gpu: bool) -> None:
    """What a user's first run downloads once and every later run reads from disk, made before the timed runs
    so that none of them pays for it: the tokenizer (trained on GSM8K here) and, on a GPU, the random-init 7B
    checkpoint that QLoRA's 4-bit load reads (a hub model's weights, on a user's machine)."""
    from tunekit import model as mdl
    from tunekit.build import run_arch
    from tunekit.prepare import build_tokenizer
    from tunekit.presets import llama7b_before

    cfg = llama7b_before()
    tokenizer = build_tokenizer(cfg)
    if gpu:
        path = mdl.save_random_init(run_arch(cfg, len(tokenizer)), torch.bfloat16, cfg.seed)
        print(f"random-init weights for QLoRA's 4-bit load: {path}")


def lesson5_plan(gpu: bool, fraction: float = LESSON5_FRACTION) -> list[tuple[str, list, str]]:
    """Lesson 5's runs as (result name, `tunekit` arguments, compile cache: see `cache_env`), for `measure` one
    at a time or `measure_in_parallel` on two GPUs. The two ends share a cache key, so they run back to back on
    one GPU, each compile cold, then the after recipe once more with the compiled kernels cached; the
    waterfall's middle steps skip the held-out evaluation (the same fixed cost for every recipe) and are
    compared by the time to train; last, the after recipe with FP8 matmuls. In smoke mode: the two ends only,
    on the tiny model, 2% of the epoch."""
    runs = lesson5_runs(fraction if gpu else 0.02)
    if not gpu:
        return [(name, [*args, *LESSON5_SMOKE], "") for name, _, args in (runs[0], runs[-1])]
    ends = [(name, args, "cold:l5-ends") for name, _, args in (runs[0], runs[-1])]
    # the after recipe again, reading the compiled kernels the first run left: what a user's next run pays
    warm = [("l5_after_warm", runs[-1][2], "warm:l5-ends")]
    middle = [(name, [*args, "--eval-data="], "warm:l5-ends" if name in ("l5_step4", "l5_step6", "l5_step7")
               else "warm:l5-other") for name, _, args in runs[1:-1]]
    # lesson 4's fastest step on random tokens, FP8 matmuls, tried on the real data
    fp8 = [("l5_after_fp8", [*runs[-1][2], "--fp8=true"], "cold:l5-fp8")]
    # the speed push's fastest recipe (lesson 6), on the same real data
    fast = [("l5_after_fast_fp8", [*runs[-1][2], "--fast-lora=true", "--fp8=true"], "cold:l5-fast")]
    return ends + warm + middle + fp8 + fast  # an end first: the two keys go to two GPUs


# ---- issue 15: scaling from 1 to 8 GPUs ------------------------------------------------------------------------

SCALING_GPUS = (1, 2, 4, 8)
# workload: its `tunekit` arguments on a GPU; each runs under its parallelism on 1, 2, 4 and 8 GPUs
SCALING_WORKLOADS = {
    "ddp_lora": ["bench", "--preset", "llama7b_lora", "--parallel", "ddp"],  # LoRA 7B, batch 4 per GPU
    # full fine-tune 7B, batch 4 per GPU, each block compiled
    "fsdp_full": ["bench", "--preset", "llama7b_lora", "--method", "full", "--parallel", "fsdp", "--batch-size", "4",
                  "--compile", "regional"],
    "fsdp_qlora": ["bench", "--preset", "llama7b_qlora", "--parallel", "fsdp"],  # QLoRA 7B, checkpointing, batch 8
}
SCALING_SMOKE = ["--preset", "tiny", "--max-length", "128", "--batch-size", "2", "--bench-warmup", "1",
                 "--bench-steps", "2", "--bench-max-steps", "2"]


def scaling_plan(gpus: int, smoke: bool = False, workloads: tuple[str, ...] = tuple(SCALING_WORKLOADS)) \
        -> list[tuple[str, int, list[str]]]:
    """(result name `l3_scale_<workload>_<n>gpu`, processes, `tunekit` arguments) for each workload at each count
    of `SCALING_GPUS` up to `gpus`, fewest GPUs first (one GPU is each workload's baseline: the same step in one
    process). Smoke: the tiny model on 1 and 2 CPU processes (gloo), QLoRA as LoRA."""
    unknown = [w for w in workloads if w not in SCALING_WORKLOADS]
    if unknown:
        raise ValueError(f"scaling workloads {unknown}: choose from {', '.join(SCALING_WORKLOADS)}")
    counts = [n for n in SCALING_GPUS if n <= (2 if smoke else gpus)]
    plan = []
    for n in counts:
        for w in workloads:
            args = SCALING_WORKLOADS[w]
            if smoke:  # the same parallelism and method on the tiny model; bitsandbytes needs CUDA
                method = "full" if "full" in w else "lora"
                args = ["bench", *SCALING_SMOKE, "--method", method, "--parallel", args[args.index("--parallel") + 1]]
            plan.append((f"l3_scale_{w}_{n}gpu", n, list(args)))
    return plan


def measure_scaling(gpus: int, workloads: tuple[str, ...] = tuple(SCALING_WORKLOADS)) -> None:
    """Measure `scaling_plan` one launch at a time, each on its count of GPUs, with NVLink SHARP and multicast off
    (../shared/gpu/README.md). `python -m tunekit_course.notebook --measure scaling GPUS [WORKLOAD,...]`."""
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    for name, n, args in scaling_plan(gpus, not on_gpu(), workloads):
        measure(name, n, *args, env=env)


def gpu_count() -> int:
    return torch.cuda.device_count() if on_gpu() else 0


def execute(path: str | Path, timeout: int = 1800) -> Path:
    """Execute a notebook in place with nbclient (the way the committed GPU outputs are produced):
    `python -m tunekit_course.notebook notebooks/00_quickstart.ipynb`. Written atomically, only if every cell ran."""
    import nbclient
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager

    from tunekit.io import atomic_write_text

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    # The kernel inherits this: every result file the notebook writes names it as its entry point.
    os.environ["TUNEKIT_NOTEBOOK"] = str(path.resolve().relative_to(REPO_ROOT)) if path.resolve().is_relative_to(
        REPO_ROOT) else str(path)
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    clean_outputs(nb)
    # The kernelspec as JupyterLab records it when it opens the notebook, display name included, so opening the
    # committed file does not mark it changed (nbclient writes language_info from the kernel itself).
    spec = KernelSpecManager().get_kernel_spec("python3")
    nb.metadata["kernelspec"] = {"display_name": spec.display_name, "language": spec.language, "name": "python3"}
    atomic_write_text(path, nbformat.writes(nb) + "\n")  # the trailing newline JupyterLab's save writes too
    return path


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
TQDM_TEXT = re.compile(r"\d+%\|.*\|")  # tqdm's text form: "tokenize:   0%|          | 0/7473 [...]"


def _progress_text(model_id: str, state: dict) -> str | None:
    """The final text of a tqdm progress bar widget (an HBox of HTML, progress bar, HTML) from the recorded
    widget state, as tqdm prints it in a terminal; None when `model_id` is not such a widget."""
    box = state.get(model_id, {})
    kids = [state.get(c.removeprefix("IPY_MODEL_"), {}) for c in box.get("state", {}).get("children", [])]
    names = [k.get("model_name") for k in kids]
    if box.get("model_name") != "HBoxModel" or len(names) != 3 or names[::2] != ["HTMLModel"] * 2 or \
            names[1] not in ("FloatProgressModel", "IntProgressModel"):
        return None
    left, bar, right = (k["state"] for k in kids)
    text = lambda s: html.unescape(s.get("value", "")).replace("\u2007", " ")  # tqdm pads with figure spaces
    filled = min(10, max(0, round(10 * bar.get("value", 0) / bar["max"]))) if bar.get("max") else 0
    return f"{text(left)}|{'█' * filled}{' ' * (10 - filled)}|{text(right)}"


def _reachable(ids: set[str], state: dict) -> set[str]:
    """`ids` and every widget model their states refer to (children, layout, style)."""
    seen, todo = set(), list(ids)
    while todo:
        i = todo.pop()
        if i in seen or i not in state:
            continue
        seen.add(i)
        todo += re.findall(r"IPY_MODEL_(\w+)", str(state[i].get("state", {})))
    return seen


def clean_outputs(nb):
    """Make a notebook's outputs read correctly untrusted (in place; returns `nb`): each progress-bar widget
    becomes a plain-text output of its final state when the widget state is recorded in the notebook, and
    is dropped when it is not (its text is the bar at 0%, drawn before any work); other widgets are kept,
    and the recorded widget state is pruned to what the remaining widget outputs use."""
    import nbformat

    meta = nb.get("metadata", {})
    state = meta.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    kept = set()
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        outputs = []
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(WIDGET_VIEW)
            if view is None:
                outputs.append(out)
                continue
            final = _progress_text(view.get("model_id", ""), state)
            if final is not None:
                outputs.append(nbformat.v4.new_output("display_data", data={"text/plain": final}))
            elif not TQDM_TEXT.search("".join(out["data"].get("text/plain", ""))):
                outputs.append(out)
                kept.add(view.get("model_id", ""))
        cell["outputs"] = outputs
    if "widgets" in meta:
        keep = _reachable(kept, state)
        if keep:
            meta["widgets"][WIDGET_STATE]["state"] = {i: m for i, m in state.items() if i in keep}
        else:
            del meta["widgets"]
    return nb


if __name__ == "__main__":
    # python -m tunekit_course.notebook NOTEBOOK...        execute notebooks in place
    # python -m tunekit_course.notebook --measure 4 GPUS   lesson 4's plan on GPUS GPUs at once (the notebook then reads it)
    # python -m tunekit_course.notebook --measure 4 GPUS SECTION,SECTION   only those sections
    # python -m tunekit_course.notebook --measure 5 GPUS [NAME,NAME]      lesson 5's runs (or those of them)
    # python -m tunekit_course.notebook --measure scaling GPUS [WORKLOAD,...]  issue 15: 1, 2, 4, 8 GPUs up to GPUS
    if sys.argv[1:3] == ["--measure", "scaling"]:
        measure_scaling(int(sys.argv[3]), tuple(sys.argv[4].split(",")) if len(sys.argv) > 4 else
                        tuple(SCALING_WORKLOADS))
    elif sys.argv[1:3] == ["--measure", "5"]:  # python -m tunekit_course.notebook --measure 5 GPUS
        lesson5_prepare(on_gpu())
        plan = lesson5_plan(on_gpu())
        wanted = sys.argv[4].split(",") if len(sys.argv) > 4 else [name for name, _, _ in plan]
        measure_in_parallel([item for item in plan if item[0] in wanted], int(sys.argv[3]))
    elif sys.argv[1:2] == ["--measure"]:
        plan = lesson4_plan(on_gpu())
        wanted = sys.argv[4].split(",") if len(sys.argv) > 4 else list(plan)
        measure_in_parallel([item for s in wanted for item in plan[s]], int(sys.argv[3]))
    else:
        for arg in sys.argv[1:]:
            print(f"executed {execute(arg)}")
