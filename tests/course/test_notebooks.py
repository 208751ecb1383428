"""The committed notebooks hold the outputs of a real GPU run; nbval (lax) re-executes them in CI."""

import json
import re

import pytest

from tunekit.config import REPO_ROOT

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_outputs_come_from_a_gpu_run(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c.get("execution_count") for c in code), f"{path.name}: not every code cell was executed"
    text = "".join("".join(o.get("text", "")) for c in code for o in c.get("outputs", []))
    # "mode: GPU (...)" (one GPU, notebook.pick_preset), "mode: 2 GPUs" or "mode: one GPU" (lesson 3); a smoke run
    # says "mode: smoke".
    assert re.search(r"mode: (GPU|\d+ GPUs|one GPU)\b", text), \
        f"{path.name}: committed outputs are not from a GPU run (re-execute on the GPU)"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: committed outputs contain an error"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_checked_cells_are_device_independent(path):
    """Cells compared by nbval must not print what differs between a GPU run and a CPU smoke run."""
    nb = json.loads(path.read_text())
    for c in nb["cells"]:
        if c["cell_type"] == "code" and "NBVAL_CHECK_OUTPUT" in "".join(c["source"]):
            src = "".join(c["source"])
            for word in ("tokens_per_s", "peak_memory", "cuda", "gpu", "preset"):
                assert word not in src, f"{path.name}: a checked cell uses {word!r}, which differs by device"
