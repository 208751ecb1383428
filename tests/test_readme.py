"""The README's promises: its commands, its results table, and CI running its test command."""

import json
import re
import subprocess
import sys

from tunekit.bench import format_table, load_results
from tunekit.config import REPO_ROOT
from tunekit.notebook import RESULTS

README = (REPO_ROOT / "README.md").read_text()


def readme_commands() -> list[str]:
    block = re.search(r"## Start here.*?```bash\n(.*?)```", README, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_results_table_matches_result_files():
    block = re.search(r"<!-- results:start -->\n(.*?)\n<!-- results:end -->", README, re.S).group(1)
    steps = [r for r in load_results(RESULTS) if "step_time_s" in r]  # the step benchmarks, not lesson data
    assert block == format_table(steps), "README table is stale: paste `tunekit results` into it"


def test_ci_runs_the_readme_test_command():
    test_cmd = readme_commands()[1]
    assert test_cmd == 'pip install -e ".[dev]" && pytest'
    assert test_cmd in (REPO_ROOT / ".ci" / "run").read_text()


def test_readme_train_command_runs_and_loss_falls(tmp_path):
    train_cmd = readme_commands()[0].split("&&")[1].split()
    assert train_cmd[:4] == ["tunekit", "train", "--preset", "tiny"]
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "tunekit.cli", *train_cmd[1:], "--out-dir", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 150
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.5  # "falls from about 6.5 to about 5"
