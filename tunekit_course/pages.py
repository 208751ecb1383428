"""A lesson's page: a notebook executed, in place on the GPU machine (`execute`, how the committed outputs are
made: `python -m tunekit_course.notebook notebooks/NAME.ipynb`) or in memory in replay mode (`replay_all`, the
published results read back on any machine, for `tunekit_course.agreement`), and its outputs made to read
correctly untrusted. Committed notebooks are read in JupyterLab or on GitHub, where widgets do not render:
`clean_outputs` turns the progress-bar widgets of `datasets`/`transformers` (tqdm) into the plain text of their
final state, so they do not read "0%" forever.
"""

from __future__ import annotations

import contextlib
import html
import os
import re
from pathlib import Path

import nbformat

from tunekit.config import REPO_ROOT


def execute(path: str | Path, timeout: int = 1800) -> Path:
    """Execute a notebook in place with nbclient (the way the committed GPU outputs are produced):
    `python -m tunekit_course.notebook notebooks/00_quickstart.ipynb`. Written atomically, only if every cell ran."""
    import nbclient
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


@contextlib.contextmanager
def _replay_env():
    """The environment a replaying kernel inherits: TUNEKIT_REPLAY=1, none of the switches that change what a
    lesson runs, and Jupyter's own plotting backend (as notebooks/conftest.py starts a lesson's kernel)."""
    saved = dict(os.environ)
    for var in ("TUNEKIT_SMOKE", "TUNEKIT_REMEASURE", "TUNEKIT_MEMORY_GB", "MPLBACKEND"):
        os.environ.pop(var, None)
    os.environ["TUNEKIT_REPLAY"] = "1"
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def replay_all(paths: list[Path], timeout: int = 600, kernels: int = 2) -> dict[Path, object]:
    """Each notebook of `paths` executed in replay mode in its own folder, in memory (the files are not touched),
    `kernels` at a time, each in a kernel of its own: its cells print the published results' figures with
    today's code. {path: the executed notebook, or the exception its replay raised (nbclient's
    CellExecutionError names the cell)}."""
    from concurrent.futures import ThreadPoolExecutor

    import nbclient

    def one(path: Path):
        try:
            nb = nbformat.read(path, as_version=4)
            nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                    resources={"metadata": {"path": str(Path(path).parent)}}).execute()
            return nb
        except Exception as e:  # noqa: BLE001 - handed back to the caller, whose report names the lesson
            return e

    with _replay_env(), ThreadPoolExecutor(kernels) as pool:
        return dict(zip(paths, pool.map(one, paths)))
