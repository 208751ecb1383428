"""Nothing lost: an export never deletes what its target held, a run folder has one writer, a run killed
after its final checkpoint is finished by a resume, a full disk is one line, and SIGHUP (a closed SSH
session) and an early SIGTERM stop a run as Ctrl-C does."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import SMALL_ARCH, SMALL_ARCH_ARGS

from tunekit import checkpoint, cli, export, runlock, stopping, train
from tunekit.config import REPO_ROOT
from tunekit.presets import get_preset, tiny
from tunekit.stopping import read_metrics


@pytest.fixture(scope="module")
def finished(tmp_path_factory, small_data):
    """A finished LoRA run (module-wide: each test copies it before changing anything)."""
    cfg = tiny(out_dir=str(tmp_path_factory.mktemp("runs") / "good"), data=str(small_data), max_steps=4,
                      save_every=2, batch_size=4, max_length=128, warmup_steps=1, packing="pad", **SMALL_ARCH)
    train.train(cfg, progress=False)
    return cfg


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def copy_run(cfg, tmp_path: Path, name: str = "run") -> Path:
    """A copy of the finished run whose config.json names the copy (as a run moved by the user would)."""
    dst = tmp_path / name
    shutil.copytree(cfg.run_dir(), dst)
    saved = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**saved, "out_dir": str(dst)}))
    return dst


def cli_args(run_dir: Path, data, *extra: str) -> list[str]:
    return ["train", "--preset", "tiny", "--out-dir", str(run_dir), "--data", str(data), "--batch-size", "4",
            "--max-length", "128", "--warmup-steps", "1", "--packing", "pad", *SMALL_ARCH_ARGS, *extra]


def start(argv: list[str], tmp_path: Path, name: str = "log", env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    err = tmp_path / f"{name}.err"
    with open(err, "w") as f:  # the child keeps its own copy of the file
        proc = subprocess.Popen([sys.executable, "-m", "tunekit.cli", *argv], cwd=REPO_ROOT,
                                stdout=subprocess.DEVNULL, stderr=f, start_new_session=True,
                                env={**os.environ, **(env or {})})
    return proc, err


def wait_for(what, proc: subprocess.Popen, err: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert proc.poll() is None, f"the run ended early:\n{err.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"timed out:\n{err.read_text()[-2000:]}"
        time.sleep(0.05)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


# ---- 1. export never deletes --------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["user-folder", "the-run", "a-folder-holding-the-run", "inside-the-run",
                                    "another-run", "a-file"])
def test_export_refuses_a_target_whose_replacement_would_lose_something(finished, tmp_path, capsys, target):
    run = copy_run(finished, tmp_path)
    other = copy_run(finished, tmp_path, "other")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's own file")
    (tmp_path / "file.bin").write_bytes(b"x")
    out = {"user-folder": mine, "the-run": run, "a-folder-holding-the-run": tmp_path,
           "inside-the-run": run / "adapter", "another-run": other, "a-file": tmp_path / "file.bin"}[target]
    before = {p: files_of(p) for p in (run, other, mine)}
    assert cli.main(["export", str(run), "--out", str(out), "--dtype", "fp32"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tunekit export: error: --out ") and str(out) in err
    assert {p: files_of(p) for p in (run, other, mine)} == before  # nothing deleted, nothing written
    assert (tmp_path / "file.bin").read_bytes() == b"x"
    if target == "user-folder":
        assert "notes.txt" in err


def test_export_replaces_an_earlier_export_and_its_default_folder(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    out = tmp_path / "exported"
    for where in (out, out, None, None):  # an earlier export (its export.json says so) is replaced
        r = export.merge_run(run, where, dtype=torch.float32)
        folder = Path(r["merged_dir"])
        assert json.loads((folder / export.EXPORT_RECORD).read_text())["run_dir"] == str(run.resolve())
        assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists()
    assert not list(tmp_path.glob(".*.tmp")) and not list(run.glob(".*.tmp"))


# ---- 2. one writer per run folder ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_process_into_a_folder_being_written_is_refused(tmp_path, small_data):
    """Two real processes: while one trains into the folder, a second start (plain, --resume, --overwrite),
    a `prepare` and an export of it are refused, naming the holder's pid and host; the folder stays the first
    run's. Killed with SIGKILL, the first leaves a lock no one holds: a resume then takes it and finishes."""
    run = tmp_path / "x"
    first, err = start(cli_args(run, small_data, "--max-steps", "100000", "--save-every", "5", "--lr", "1e-3",
                                "--seed", "1"), tmp_path, "first")
    try:
        wait_for(lambda: len(read_metrics(run)) >= 2 and checkpoint.checkpoints(run), first, err)
        saved = (run / "config.json").read_text()
        for extra in ([], ["--resume"], ["--overwrite"]):
            proc = subprocess.run([sys.executable, "-m", "tunekit.cli",
                                   *cli_args(run, small_data, "--max-steps", "100000", "--save-every", "5", "--lr",
                                             "3e-3", "--seed", "2", *extra)],
                                  cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
            assert proc.returncode == 2, proc.stderr[-2000:]
            line = proc.stderr.strip().splitlines()[-1]
            assert f"pid {first.pid} on " in line and "in use by another tunekit process" in line, line
        prep = subprocess.run([sys.executable, "-m", "tunekit.cli", "prepare", "--out-dir", str(run), "--data",
                               str(small_data)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                              check=False)
        assert prep.returncode == 2 and f"pid {first.pid}" in prep.stderr
        assert cli.main(["export", str(run)]) == 2
        assert (run / "config.json").read_text() == saved  # still the first run's
        assert first.poll() is None
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    assert (run / runlock.LOCK).exists()  # left by the kill, held by no one
    proc = subprocess.run([sys.executable, "-m", "tunekit.cli",
                           *cli_args(run, small_data, "--max-steps", "100000", "--save-every", "5", "--lr", "1e-3",
                                     "--seed", "1", "--resume", "--allow-config-change", "--max-steps",
                                     str(checkpoint.checkpoint_step(checkpoint.latest_checkpoint(run)) + 2))],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (run / runlock.LOCK).exists() and (run / "summary.json").exists()


def test_the_lock_names_its_holder_and_is_released_on_any_exit(tmp_path):
    with runlock.hold(tmp_path, "a test"):
        assert runlock.holder(tmp_path)["pid"] == os.getpid()
        assert not runlock.held_by_other(tmp_path)  # this process's own lock
        with pytest.raises(runlock.RunInUseError, match=f"pid {os.getpid()} on "), \
                runlock.hold(tmp_path, "a second writer"):
            pass
    assert not (tmp_path / runlock.LOCK).exists()
    with contextlib.suppress(RuntimeError), runlock.hold(tmp_path):
        raise RuntimeError("a failing run")
    with runlock.hold(tmp_path):  # released by the failure
        pass


def test_a_train_in_process_refuses_a_folder_locked_by_another_process(make_cfg, tmp_path):
    cfg = make_cfg()
    cfg.run_dir().mkdir(parents=True)
    code = (f"import time\nfrom tunekit import runlock\nwith runlock.hold({str(cfg.run_dir())!r}):\n"
            "    print('held', flush=True)\n    time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(runlock.RunInUseError, match=f"pid {holder.pid} "):
            train.train(cfg, progress=False)
        assert sorted(p.name for p in cfg.run_dir().iterdir()) == [runlock.LOCK]  # nothing else written
    finally:
        stop(holder)


# ---- 4. a kill after the final checkpoint -------------------------------------------------------------


KILL_AT_SAVE = """
import os, signal, sys
from tunekit import cli
from tunekit import model as mdl
mdl.save_adapter = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # dies as the final checkpoint appears
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_run_killed_after_its_final_checkpoint_is_finished_by_resume(tmp_path, small_data):
    run = tmp_path / "run"
    argv = cli_args(run, small_data, "--max-steps", "4", "--save-every", "2")
    proc = subprocess.run([sys.executable, "-c", KILL_AT_SAVE, *argv], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert checkpoint.checkpoint_step(checkpoint.latest_checkpoint(run)) == 4
    assert not (run / "adapter").exists() and not (run / "summary.json").exists()
    proc = subprocess.run([sys.executable, "-m", "tunekit.cli", *argv, "--resume"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "writing them from" in proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_loss"] == read_metrics(run)[-1]["loss"]
    assert (run / "adapter" / "adapter_config.json").exists()
    assert export.generate(run, ["Question: 1+1\nAnswer: "], max_new_tokens=2, dtype=torch.float32)
    again = subprocess.run([sys.executable, "-m", "tunekit.cli", *argv, "--resume"], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0 and "nothing to do" in again.stdout


# ---- 10. a full disk ----------------------------------------------------------------------------------


@pytest.mark.parametrize("failure", ["ENOSPC", "torch-zip-writer", "safetensors"])
def test_a_full_disk_is_one_line_and_loses_nothing(make_cfg, tmp_path, monkeypatch, capsys, failure):
    """The write of a checkpoint fails as each writer says a full disk: exit 2, one line naming the folder and
    its free space, the earlier checkpoint intact; once there is space, the printed command resumes."""
    cfg = make_cfg(max_steps=6, save_every=2)
    argv = ["train", "--preset", "tiny", "--out-dir", cfg.out_dir, "--data", cfg.data, "--max-steps", "6",
            "--save-every", "2", "--batch-size", "8", "--max-length", "128", "--warmup-steps", "2", *SMALL_ARCH_ARGS]
    real_save = torch.save

    def full(obj, f, *a, **k):
        if "ckpt-0000004" in str(f):  # the second checkpoint's files
            if failure == "ENOSPC":
                raise OSError(errno.ENOSPC, "No space left on device")
            if failure == "safetensors":
                raise type("SafetensorError", (Exception,), {})("Error while serializing: No space left on device")
            monkeypatch.setattr(stopping, "_free_bytes", lambda folder: 4096)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing "
                               "file data/2: file write failed")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"tunekit train: error: no space left on the device holding "
                                               f"{cfg.out_dir}") and "GB free" in err[0], err
    assert "Continue with: tunekit train" in err[0] and "--resume" in err[0]
    assert [checkpoint.checkpoint_step(p) for p in checkpoint.checkpoints(cfg.run_dir())] == [2]
    assert not list(cfg.run_dir().glob(".*.tmp"))
    monkeypatch.setattr(torch, "save", real_save)
    assert cli.main([*argv, "--resume"]) == 0
    assert read_metrics(cfg.run_dir())[-1]["step"] == 6


def test_a_really_full_disk(make_cfg, tmp_path, capsys):
    """The same on a real full filesystem (a small tmpfs; skipped where this process cannot mount one)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)],
                                           capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        cfg = make_cfg(max_steps=2, save_every=2, out_dir=str(mnt / "run"))
        train.train(cfg, progress=False)  # a first checkpoint: how much one takes
        size = sum(f.stat().st_size for f in checkpoint.checkpoints(cfg.run_dir())[-1].rglob("*") if f.is_file())
        free = shutil.disk_usage(mnt).free
        with open(mnt / "filler", "wb") as f:  # leave less than half a checkpoint free
            f.write(b"\0" * max(0, free - size // 2))
        argv = ["train", "--preset", "tiny", "--out-dir", cfg.out_dir, "--data", cfg.data, "--max-steps", "4",
                "--save-every", "2", "--batch-size", "8", "--max-length", "128", "--warmup-steps", "2",
                "--resume", "--allow-config-change", *SMALL_ARCH_ARGS]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no space left on the device holding" in err[0], err
        assert [checkpoint.checkpoint_step(p) for p in checkpoint.checkpoints(cfg.run_dir())] == [2]
        assert checkpoint.verify_checkpoint(checkpoint.checkpoints(cfg.run_dir())[-1]) is None
        (mnt / "filler").unlink()
        assert cli.main(argv) == 0
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# ---- 13. signals ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sighup_stops_a_run_as_sigterm_does(tmp_path, small_data):
    """A closed SSH session sends SIGHUP to the run's process group: it finishes the step, writes a
    checkpoint and exits 129 with the command that resumes (DataLoader workers ignore it too)."""
    run = tmp_path / "run"
    proc, err = start(cli_args(run, small_data, "--max-steps", "100000", "--save-every", "100000",
                               "--num-workers", "1"), tmp_path)
    try:
        wait_for(lambda: len(read_metrics(run)) >= 2, proc, err)
        os.killpg(proc.pid, signal.SIGHUP)
        proc.wait(timeout=60)
    finally:
        stop(proc)
    text = err.read_text()
    assert proc.returncode == 128 + signal.SIGHUP, text[-2000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("tunekit train: interrupted by SIGHUP at step ") and "--resume" in last
    assert "Traceback" not in text
    assert checkpoint.verify_checkpoint(checkpoint.latest_checkpoint(run)) is None


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_in_the_first_moments_is_one_line(tmp_path, small_data, signum):
    """A signal while Python imports torch (before the run catches signals) exits 128 + signal with one line,
    leaving no folder behind."""
    run = tmp_path / "run"
    proc, err = start(cli_args(run, small_data, "--max-steps", "10"), tmp_path)
    time.sleep(0.3)  # inside the imports
    proc.send_signal(signum)
    proc.wait(timeout=60)
    text = err.read_text()
    assert proc.returncode == 128 + signum, text[-2000:]
    assert len(text.strip().splitlines()) == 1 and f"interrupted by {signum.name}" in text
    assert not run.exists()


def test_an_import_a_signal_broke_is_the_signal_s_stop(monkeypatch, capsys):
    """A signal that lands inside a C extension's import can leave it to fail as a second load (numpy: "cannot load
    module more than once per process", seen in CI with SIGHUP 0.3 s after start): the stop is the signal's, one
    line and 128 + signal, not the ImportError's traceback. Without a signal the ImportError is raised."""
    import tunekit
    from tunekit import commands

    monkeypatch.delattr(tunekit, "train", raising=False)
    monkeypatch.setitem(sys.modules, "tunekit.train", None)  # importing it now raises ImportError
    monkeypatch.setattr(commands, "RECEIVED", [signal.SIGHUP])
    assert commands.train(None, [], []) == 128 + signal.SIGHUP
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "interrupted by SIGHUP" in err
    monkeypatch.setattr(commands, "RECEIVED", [])
    with pytest.raises(ImportError):
        commands.train(None, [], [])



def test_signals_during_the_imports_are_noted_then_stop_the_run(monkeypatch):
    """While torch imports, a signal is noted, not raised (an exception raised inside a C extension's import can
    abort the process: seen in CI, SIGHUP 0.3 s after start, exit -6); a second one of the same kind raises, so
    an import that hangs can still be stopped; the handlers are put back after."""
    from tunekit import commands

    monkeypatch.setattr(commands, "RECEIVED", [])
    before = signal.getsignal(signal.SIGHUP)
    with pytest.raises(commands.Stopped) as stopped, commands.signals_held():
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGTERM)
        assert commands.RECEIVED == [signal.SIGHUP, signal.SIGTERM]  # noted, nothing raised
        os.kill(os.getpid(), signal.SIGHUP)
    assert stopped.value.signum == signal.SIGHUP
    assert signal.getsignal(signal.SIGHUP) is before

SLOW_SAVE = """
import sys, time
from tunekit import cli
from tunekit import model as mdl
from transformers import PreTrainedModel
real = PreTrainedModel.save_pretrained
def slow(self, *a, **k):
    real(self, *a, **k)
    print("saved", flush=True)
    time.sleep(60)  # the export's temp folder is there now
PreTrainedModel.save_pretrained = slow
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigterm_during_export_leaves_no_temp(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    out = tmp_path / "exported"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, "export", str(run), "--out", str(out), "--dtype",
                             "fp32"], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saved"
        assert list(tmp_path.glob(".exported.*.tmp"))
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        stop(proc)
    assert proc.returncode == 143, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == ("tunekit export: interrupted by SIGTERM; nothing was written (its "
                                               "temp folder was removed)")
    assert not out.exists() and not list(tmp_path.glob(".*.tmp")) and not (run / runlock.LOCK).exists()


# ---- 14. help --------------------------------------------------------------------------------------


def test_help_shows_the_default_presets_values(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    assert "defaults are the tiny preset's" in out
    assert f"--batch-size INT (default {tiny().batch_size})" in out and tiny().batch_size == 4
    with pytest.raises(SystemExit):
        cli.main(["estimate", "--help"])
    out = capsys.readouterr().out
    assert "defaults are the llama7b_lora preset's" in out
    assert f"--hidden-size INT (default {get_preset('llama7b_lora').hidden_size})" in out
