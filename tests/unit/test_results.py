"""Result files: the shared header and its provenance, reading and writing, reuse only by the same code,
the table, noise and comparisons, and that every published file traces to the code that made it."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers import SMALL_ARCH

from tunekit import results
from tunekit.config import REPO_ROOT
from tunekit.presets import tiny
from tunekit_course import RESULTS


@pytest.fixture(scope="module")
def result(tmp_path_factory, small_data):
    from tunekit.bench.step import run_bench

    cfg = tiny(out_dir=str(tmp_path_factory.mktemp("bench") / "run"), data=str(small_data), batch_size=4,
               max_length=32, bench_warmup=1, bench_steps=2, bench_max_steps=2, **SMALL_ARCH)
    return cfg, run_bench(cfg, name="tiny-cpu", verbose=False)


# ---- the header ------------------------------------------------------------------------------------------


def test_new_result_header(monkeypatch):
    monkeypatch.delenv("TUNEKIT_COMMIT", raising=False)
    cfg = tiny()
    r = results.new_result("x", cfg, 12.5, 1.25, call="f(1)", extra=3)
    for key in (*results.REQUIRED_KEYS, *results.PROVENANCE_KEYS, "config", "versions", "extra"):
        assert key in r, key
    assert (r["name"], r["preset"], r["tokens_per_s"], r["peak_memory_gb"], r["call"]) == ("x", "tiny", 12.5, 1.25, "f(1)")
    assert r["code_hash"] == results.code_hash() and len(r["code_hash"]) == 16
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert r["commit"] == head.stdout.strip() and isinstance(r["dirty"], bool)
    json.dumps(r)
    # which physical GPU measured it, so a result read back elsewhere can say whether it is this GPU's
    assert r["gpu_uuid"] is None  # no CUDA here
    monkeypatch.setattr(results, "gpu_uuid", lambda: "GPU-1234")
    assert results.new_result("x", cfg, 1.0, 1.0)["gpu_uuid"] == "GPU-1234"
    assert results.new_result("x", cfg, 1.0, 1.0, gpu_uuid="GPU-9")["gpu_uuid"] == "GPU-9"  # a caller's own wins


def test_a_run_with_fp8_says_how_its_input_gradients_accumulated(monkeypatch):
    from tunekit import fastlora

    monkeypatch.delenv("TUNEKIT_FP8_FAST_ACCUM", raising=False)
    assert "fp8_fast_accum" not in results.new_result("x", tiny(), 1.0, 1.0)  # no FP8, nothing to say
    fp8 = tiny(fp8=True)
    assert results.new_result("x", fp8, 1.0, 1.0)["fp8_fast_accum"] is True  # the library's default
    monkeypatch.setattr(fastlora, "FAST_ACCUM_BACKWARD", False)  # a script's own setting
    assert results.new_result("x", fp8, 1.0, 1.0)["fp8_fast_accum"] is False
    monkeypatch.setenv("TUNEKIT_FP8_FAST_ACCUM", "1")  # a parent process's: its children apply it
    assert results.new_result("x", fp8, 1.0, 1.0)["fp8_fast_accum"] is True
    monkeypatch.setenv("TUNEKIT_FP8_FAST_ACCUM", "0")
    assert results.new_result("x", fp8, 1.0, 1.0)["fp8_fast_accum"] is False


def test_provenance_from_the_environment_wins_over_git(monkeypatch):
    monkeypatch.setenv("TUNEKIT_COMMIT", "abc123")
    monkeypatch.setenv("TUNEKIT_DIRTY", "0")
    assert results.git_state() == ("abc123", False)  # even in a git checkout: its .git may be stale
    monkeypatch.setattr(results, "_git", lambda *a: None)
    monkeypatch.setenv("TUNEKIT_DIRTY", "0")
    assert results.git_state() == ("abc123", False)
    monkeypatch.setenv("TUNEKIT_DIRTY", "1")
    assert results.git_state() == ("abc123", True)
    monkeypatch.delenv("TUNEKIT_COMMIT")
    monkeypatch.delenv("TUNEKIT_DIRTY")
    assert results.git_state() == (None, None)


def test_entry_point_names_the_notebook_or_the_command(monkeypatch):
    monkeypatch.setattr("sys.argv", ["/x/bin/tunekit", "bench", "--preset", "tiny"])
    monkeypatch.delenv("TUNEKIT_NOTEBOOK", raising=False)
    assert results.entry_point() == "tunekit bench --preset tiny"
    monkeypatch.setenv("TUNEKIT_LORA_BMM", "0")  # changes the kernels: part of the command
    assert results.entry_point() == "TUNEKIT_LORA_BMM=0 tunekit bench --preset tiny"
    monkeypatch.delenv("TUNEKIT_LORA_BMM")
    monkeypatch.setenv("TUNEKIT_NOTEBOOK", "notebooks/02_x.ipynb")
    assert results.entry_point() == ("notebook notebooks/02_x.ipynb (python -m tunekit_course.notebook "
                                     "notebooks/02_x.ipynb): tunekit bench --preset tiny")
    monkeypatch.setattr("sys.argv", ["/venv/lib/ipykernel_launcher.py", "-f", "k.json"])
    assert results.entry_point() == "notebook notebooks/02_x.ipynb (python -m tunekit_course.notebook notebooks/02_x.ipynb)"
    monkeypatch.delenv("TUNEKIT_NOTEBOOK")
    monkeypatch.setattr("sys.argv", ["tunekit_course/fullrun.py", "l5c_fp8fast_s0", "900"])
    monkeypatch.setenv("TUNEKIT_FP8_FAST_ACCUM", "1")  # a whole run's child process says it too
    assert results.entry_point() == "TUNEKIT_FP8_FAST_ACCUM=1 python tunekit_course/fullrun.py l5c_fp8fast_s0 900"


def test_code_hash_follows_the_source(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    before = results.code_hash(tmp_path)
    assert results.code_hash(tmp_path) == before
    (tmp_path / "b.py").write_text("y = 3\n")
    assert results.code_hash(tmp_path) != before


def test_code_hash_covers_the_library_only(tmp_path):
    """Every .py under the library, named by its path in it (a flat library hashes as it did before it had
    folders), plus the code_files of an experiment; the course beside it is not in the hash."""
    lib, course = tmp_path / "tunekit", tmp_path / "tunekit_course"
    (lib / "data").mkdir(parents=True)
    course.mkdir()
    (lib / "a.py").write_text("x = 1\n")
    assert results.code_hash(lib) == results.source_hash({"a.py": b"x = 1\n"})  # the flat hash of old
    (lib / "data" / "b.py").write_text("y = 2\n")
    (course / "claims.py").write_text("table = 1\n")
    (course / "databench.py").write_text("run = 1\n")
    library, experiment = results.code_hash(lib), results.code_hash(lib, ["tunekit_course/databench.py"])
    (course / "claims.py").write_text("table = 2\n")  # a README-table formatter edited: no result changes
    assert results.code_hash(lib) == library and results.code_hash(lib, ["tunekit_course/databench.py"]) == experiment
    (course / "databench.py").write_text("run = 2\n")  # the experiment's own code: its results change
    assert results.code_hash(lib) == library and results.code_hash(lib, ["tunekit_course/databench.py"]) != experiment
    (lib / "data" / "b.py").write_text("y = 3\n")
    assert results.code_hash(lib) != library
    assert results.LIBRARY.name == "tunekit" and not list(results.LIBRARY.rglob("claims.py"))


def test_a_course_experiment_records_its_own_code(monkeypatch):
    monkeypatch.setenv("TUNEKIT_COMMIT", "f" * 40)
    monkeypatch.setenv("TUNEKIT_DIRTY", "0")
    from tunekit_course import databench

    r = results.new_result("x", None, None, None, code_files=(results.code_file(databench.__file__),))
    assert r["code_files"] == ["tunekit_course/databench.py"]
    assert r["code_hash"] == results.code_hash(code_files=["tunekit_course/databench.py"]) != results.code_hash()
    assert "code_files" not in results.new_result("y", None, None, None)


# ---- files -------------------------------------------------------------------------------------------------


def test_save_and_load_results(tmp_path, result):
    _, r = result
    in_folder = results.save_result(r, tmp_path / "results")
    assert in_folder == tmp_path / "results" / "tiny-cpu.json"
    as_file = results.save_result({**r, "name": "other"}, tmp_path / "x" / "mine.json")
    assert as_file == tmp_path / "x" / "mine.json"
    for path in (in_folder, as_file):
        assert json.loads(path.read_text())["tokens_per_s"] == r["tokens_per_s"]
    loaded = results.load_results(tmp_path / "results", as_file)
    assert [x["name"] for x in loaded] == ["tiny-cpu", "other"]
    assert loaded[0]["_file"] == str(in_folder)
    results.save_result(loaded[0], tmp_path / "again.json")  # a loaded result saves without its _file
    assert "_file" not in json.loads((tmp_path / "again.json").read_text())


def test_load_results_rejects_missing_keys(tmp_path):
    path = tmp_path / "partial.json"
    path.write_text(json.dumps({"name": "x", "tokens_per_s": 1.0}))
    with pytest.raises(ValueError) as e:
        results.load_results(path)
    assert str(path) in str(e.value)
    assert "gpu" in str(e.value) and "peak_memory_gb" in str(e.value)


def test_load_results_rejects_bad_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"name": "x",\n')
    with pytest.raises(ValueError) as e:
        results.load_results(tmp_path)  # a folder: every *.json in it
    assert str(path) in str(e.value) and "JSON" in str(e.value)


def test_reusable_only_for_the_same_code(tmp_path, result, monkeypatch):
    cfg, r = result
    path = results.save_result(r, tmp_path)
    assert results.reusable(path, cfg)["name"] == "tiny-cpu"
    assert results.reusable(path, tiny(**{**cfg.__dict__, "lr": 1.0})) is None  # another config
    assert results.reusable(tmp_path / "missing.json", cfg) is None
    monkeypatch.setattr(results, "code_hash", lambda *a, **k: "0" * 16)  # the library changed since
    assert results.reusable(path, cfg) is None


def test_format_table(result):
    _, r = result
    table = results.format_table([r, {**r, "name": "second", "mfu": 0.4321, "step_time_spread": 0.1,
                                      "commit": "0123456789", "dirty": True}])
    lines = table.splitlines()
    assert len(lines) == 4 and lines[0].startswith("| name") and "| spread |" in lines[0]
    assert "tiny-cpu" in lines[2] and "second" in lines[3] and "43.2%" in lines[3]
    assert "±5.0%" in lines[3] and "0123456+" in lines[3]


def test_plot_results(result):
    import matplotlib
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    assert matplotlib.get_backend().lower() == "agg"
    _, r = result
    fig = results.plot_results([r, {**r, "name": "second"}], reference={"paper": 100.0}, title="t")
    try:
        assert isinstance(fig, Figure) and len(fig.axes) == 2
        labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
        assert labels == ["tiny-cpu", "second"]
    finally:
        plt.close(fig)


def test_versions_lists_packages():
    v = results.versions()
    assert v["torch"] and v["transformers"] and v["python"]
    assert "bitsandbytes" in v  # None where not installed


# ---- noise -------------------------------------------------------------------------------------------------


def _speed(tps: float, batch: int, spread: float = 0.0) -> dict:
    return {"tokens_per_s": tps, "step_time_spread": spread, "config": {"batch_size": batch}}


def test_compare_says_same_within_noise():
    assert results.compare(_speed(110, 4), _speed(100, 4)) == pytest.approx((1.1, "1.10x"))
    ratio, words = results.compare(_speed(103, 4, 0.02), _speed(100, 4, 0.04))
    assert ratio == pytest.approx(1.03)
    assert words == "1.03x, same within noise (±4%)"
    noise = {"n1": {"between_run_spread": 0.2, "config": {"batch_size": 1}},
             "n4": {"between_run_spread": 0.01, "config": {"batch_size": 4}}}
    # batch 1 against batch 1: the batch-1 run-to-run spread applies; batch 4 against batch 4: the small one
    assert "same within noise (±20%)" in results.compare(_speed(115, 1), _speed(100, 1), noise)[1]
    assert results.compare(_speed(115, 4), _speed(100, 4), noise)[1] == "1.15x"


# ---- every published file traces to its code ----------------------------------------------------------------


def _published() -> list[dict]:
    return results.load_results(RESULTS)


def test_every_published_result_records_its_commit_and_call():
    for r in _published():
        where = r["_file"]
        for key in results.PROVENANCE_KEYS:
            assert key in r, f"{where}: no {key!r}: re-measure it with the current code"
        assert r["commit"] and r["call"] and r["entry"], where
        assert r["dirty"] is False, f"{where}: measured with uncommitted changes in tunekit/"


def test_published_code_hash_matches_the_recorded_commit():
    """The hash of the library at the recorded commit (every `tunekit/**/*.py`, named by its path inside
    `tunekit/`, which for the flat library of older commits is the file's name) and of the result's
    `code_files` equals the file's code_hash: the result was measured by exactly the code of that commit
    (checked through git, so it also holds for files made on a machine that had no .git, where the commit came
    from TUNEKIT_COMMIT)."""
    if subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: the recorded commits cannot be read back")

    def show(commit: str, name: str) -> bytes:
        return subprocess.run(["git", "-C", str(REPO_ROOT), "show", f"{commit}:{name}"], capture_output=True,
                              check=True).stdout

    hashes: dict[tuple[str, tuple[str, ...]], str] = {}
    for r in _published():
        commit, extra = r["commit"], tuple(r.get("code_files", ()))
        if (commit, extra) not in hashes:
            names = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-tree", "-r", "--name-only", commit, "tunekit/"],
                                   capture_output=True, text=True, check=True).stdout.split()
            files = {n.removeprefix("tunekit/"): show(commit, n) for n in names if n.endswith(".py")}
            hashes[commit, extra] = results.source_hash({**files, **{n: show(commit, n) for n in extra}})
        assert r["code_hash"] == hashes[commit, extra], f"{r['_file']}: code_hash is not that of commit {commit[:10]}"
