"""The README's promises: its commands, its results table, and CI running its test command."""

import json
import re
import subprocess
import sys

from tunekit.config import REPO_ROOT
from tunekit.results import by_name
from tunekit_course import RESULTS, claims, readme

README = (REPO_ROOT / "README.md").read_text()


def readme_commands() -> list[str]:
    block = re.search(r"## Start here.*?```bash\n(.*?)```", README, re.DOTALL).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def readme_command(start: str) -> str:
    return next(c for c in readme_commands() if c.startswith(start))


def test_start_here_installs_in_order_from_the_clone():
    cmds = readme_commands()
    assert cmds[0].startswith("git clone") and "venv" in cmds[1] and "activate" in cmds[1]
    torch_cpu = readme_command("pip install torch")
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_cpu
    assert cmds.index(torch_cpu) < cmds.index(readme_command("pip install -e ."))  # before tunekit pulls torch in
    # never by name from PyPI: an unrelated project is called tunekit there
    assert not any(re.search(r"pip install ['\"]?tunekit", c) for c in cmds)
    for block in re.findall(r"```(?:bash|python)\n(.*?)```", README, re.DOTALL):  # no command block anywhere either
        assert not re.search(r"pip install ['\"]?tunekit\b", block), block


def test_readme_library_example_runs(tmp_path, monkeypatch):
    code = re.search(r"### As a library.*?```python\n(.*?)```", README, re.DOTALL).group(1)
    monkeypatch.chdir(tmp_path)  # out_dir is relative: keep it under tmp_path
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    cfg = namespace["cfg"]
    assert namespace["summary"]["steps"] == cfg.max_steps == 20
    assert (tmp_path / "runs" / "from-python" / "metrics.jsonl").exists()
    assert not namespace["model"].training and namespace["tokenizer"]("2+2")["input_ids"]  # what finetune hands back


def test_generated_tables_match_the_result_files():
    """The results, reference and claims tables are rendered from notebooks/results and notebooks/cited.json."""
    assert README == readme.render_readme(README, by_name(RESULTS)), (
        "README's generated tables are stale: run `tunekit results --update-readme`")


def test_readme_lists_every_library_module():
    """The README's library section lists every module of the library (its packages' parts included) and of the
    course, and nothing that is not there."""
    section = re.search(r"## The library\n(.*?)\n## ", README, re.DOTALL).group(1)
    listed = set(re.findall(r"`((?:tunekit|tunekit_course)/[\w/]+\.py)`", section))
    modules = {p.relative_to(REPO_ROOT).as_posix() for package in ("tunekit", "tunekit_course")
               for p in (REPO_ROOT / package).rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    assert listed == modules, f"README library section: missing {modules - listed}, stale {listed - modules}"


def test_cited_figures_name_their_source():
    for entry in claims.cited().values():
        assert entry["source"] and entry["date"], entry["id"]
        if "tokens_per_s" in entry:
            assert entry["stack"] and entry["machine"] and entry["matches"], entry["id"]


def test_ci_runs_the_readme_test_command():
    test_cmd = readme_command('pip install -e ".[dev]"')
    assert test_cmd == 'pip install -e ".[dev]" && pytest'
    assert test_cmd in (REPO_ROOT / ".ci" / "run").read_text()


def test_readme_train_command_runs_and_loss_falls(tmp_path):
    train_cmd = readme_command("pip install -e . &&").split("&&")[1].split()
    assert train_cmd[:4] == ["tunekit", "train", "--preset", "tiny"]
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "tunekit.cli", *train_cmd[1:], "--out-dir", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 150
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.5  # "falls from about 6.7 to about 5"


def test_readme_reliability_table_names_tests_that_exist():
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Reliability", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(test_\w+\.py)::(test_\w+)`", section))
    assert len(named) >= 15
    for file, test in named:
        found = list((REPO_ROOT / "tests").rglob(file))
        assert found and f"def {test}(" in found[0].read_text(), f"{file}::{test}"


def test_keeping_the_committed_outputs_is_said_once_in_the_readme():
    """How to keep a lesson's committed outputs (autosave off, `git checkout` to restore) is one README section;
    each lesson's opening cell points to it instead of repeating it."""
    assert README.count("### Keeping the committed outputs") == 1 and "Autosave Documents" in README
    lessons = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))
    for path in lessons:
        first = "".join(json.loads(path.read_text())["cells"][0]["source"])
        assert "*Keeping the committed outputs*" in first and "autosave" not in first.lower(), path.name


def test_readme_names_no_issue_of_the_project():
    # a reader of the README has no access to the project's issue tracker: what an issue decided is said in words
    found = [line for line in README.splitlines() if re.search(r"\bissues? ?#?\d+\b", line, re.IGNORECASE)]
    assert not found, found
