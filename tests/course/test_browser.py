"""The notebooks as a learner meets them: JupyterLab in headless Chromium, Run All in smoke mode.

JupyterLab starts on 127.0.0.1 with a token, serving copies of the notebooks (so neither Run All nor autosave
can touch the committed GPU outputs), with TUNEKIT_SMOKE=1 in its environment. Each notebook is opened as
it is committed (untrusted: widgets do not render) and must show no progress bar stuck at 0%. Lesson 0, the
first a learner runs, is then Run All in JupyterLab: it must finish within the timeout with no error and
nothing written to stderr. Every lesson is executed under the same two rules by nbval (notebooks/conftest.py);
running each again here cost CI about 7 of its minutes. Screenshots of every screenful, before and after the
run, are saved under $TUNEKIT_SCREENSHOTS/NAME/ when that is set, else under pytest's tmp_path (the folder is
printed: `pytest -s tests/course/test_browser.py` shows it).

Needs Chromium (Debian: `apt-get install chromium`; or `TUNEKIT_CHROMIUM=/path/to/chrome`), Playwright for
Python and JupyterLab (`pip install -e ".[browser]"`). Where one is missing the test skips and says which,
except in CI (CI=true), where that is a failure: CI must run it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tunekit.config import REPO_ROOT

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
RUN_ALL = [p for p in NOTEBOOKS if p.name.startswith("00_")]  # Run All in JupyterLab: lesson 0 (see above)
RUN_TIMEOUT_S = 900  # Run All, per notebook; each takes 1-3 min on the 2-core CI machine
VIEWPORT = {"width": 1366, "height": 768}  # a laptop screen
STUCK_BAR = re.compile(r"(?<!\d)0%\|")  # a tqdm bar drawn before any work: what an untrusted widget shows


def _missing(reason: str):
    """Skip on a developer's machine; fail in CI, which must run this test."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but the browser test cannot run: {reason}")
    pytest.skip(reason)


def _chromium() -> str | None:
    """Debian's chromium, or TUNEKIT_CHROMIUM; None lets Playwright try its own download (`playwright install`)."""
    return os.environ.get("TUNEKIT_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


# ---- JupyterLab and the browser, once for the module ---------------------------------------------------------


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 serving copies of the notebooks: (base URL, token, folder)."""
    if importlib.util.find_spec("jupyterlab") is None:
        _missing("jupyterlab is not installed (pip install -e '.[browser]')")
    root = tmp_path_factory.mktemp("lab")
    (root / "notebooks").mkdir()
    for path in NOTEBOOKS:
        shutil.copy(path, root / "notebooks" / path.name)
    home = root / ".jupyter-home"  # this server's own config, data, settings: a developer's ~/.jupyter stays out
    settings = home / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    # No "Would you like to get notified about official Jupyter news?" toast over the screenshots.
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                            "checkForUpdates": False}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = os.urandom(16).hex()
    # A cache of its own: the notebooks start cold, as a learner's first run does, and leave nbval's warm
    # or cold as it was (a check cell of 00_quickstart prints the progress of filling it).
    env = {**os.environ, "TUNEKIT_SMOKE": "1", "TUNEKIT_CACHE": str(root / "cache"),
           "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_DATA_DIR": str(home / "data"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime")}
    env.pop("MPLBACKEND", None)  # conftest's Agg would hide every plot (and warn on stderr at plt.show())
    log = (root / "jupyterlab.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--ServerApp.allow_root=True", "--LabApp.expose_app_in_browser=True",
         f"--LabApp.user_settings_dir={home / 'settings'}", f"--LabApp.workspaces_dir={home / 'workspaces'}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start:\n{(root / 'jupyterlab.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield base, token, root
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def chromium():
    """Headless Chromium driven by Playwright."""
    if importlib.util.find_spec("playwright") is None:
        _missing("playwright is not installed (pip install -e '.[browser]')")
    from playwright.sync_api import Error, sync_playwright

    with sync_playwright() as p:
        exe = _chromium()
        try:
            browser = p.chromium.launch(executable_path=exe)
        except Error as e:
            _missing(f"Chromium does not start ({exe or 'Playwright default'}; apt-get install chromium, or set "
                     f"TUNEKIT_CHROMIUM): {str(e).splitlines()[0]}")
        yield browser
        browser.close()


# ---- what the page holds, read from JupyterLab's own model -----------------------------------------------------

PANEL = "window.jupyterapp.shell.currentWidget"
CODE_CELLS = f"{PANEL}.content.model.toJSON().cells.filter(c => c.cell_type === 'code')"  # nbformat JSON
RUNNING = f"{PANEL}.content.widgets.filter(w => w.model.executionState === 'running').length"  # [*] or queued


def _open(page, base, token, name):
    page.goto(f"{base}/lab/tree/notebooks/{name}?reset&token={token}")
    page.wait_for_function(f"""(name) => window.jupyterapp && {PANEL} && {PANEL}.context
        && {PANEL}.context.path === 'notebooks/' + name && {PANEL}.context.isReady
        && {PANEL}.sessionContext.session?.kernel?.connectionStatus === 'connected'
        && {PANEL}.sessionContext.session.kernel.status === 'idle'""", arg=name, timeout=120_000)


def _menu(page, menu, item):
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{re.escape(menu)}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).click()


def _screenshots(page, folder: Path, prefix: str) -> int:
    """One screenshot per screenful, from the top of the notebook to its last cell; returns how many."""
    box = f"{PANEL}.content.outerNode"  # the notebook's scrolling box
    at_end = f"""() => {{ const s = {box}, last = {PANEL}.content.widgets.at(-1).node;
        return last.getBoundingClientRect().bottom <= s.getBoundingClientRect().bottom + 1
            || s.scrollTop >= s.scrollHeight - s.clientHeight - 1; }}"""
    for n in range(80):
        page.evaluate(f"(n) => {{ {box}.scrollTop = n * ({box}.clientHeight - 40); }}", n)
        page.wait_for_timeout(300)  # let the cells scrolled in paint
        page.screenshot(path=str(folder / f"{prefix}-{n:02d}.png"))
        if page.evaluate(at_end):
            break
    return n + 1


def _problems(cells) -> list[str]:
    """Error outputs, stderr output and cells that did not run, as readable lines."""
    out = []
    for i, cell in enumerate(cells):
        source = "".join(cell["source"]).splitlines()[:1]
        where = f"code cell {i + 1} ({source[0][:60] if source else ''!r})"
        if cell.get("execution_count") is None:
            out.append(f"{where}: did not run")
        for o in cell.get("outputs", []):
            if o["output_type"] == "error":
                out.append(f"{where}: {o['ename']}: {o['evalue']}")
            elif o["output_type"] == "stream" and o["name"] == "stderr":
                out.append(f"{where}: stderr: {''.join(o['text']).strip()[:2000]}")
    return out


def _committed(page, base, token, path: Path, shots: Path) -> None:
    """Open the notebook as committed, read untrusted: every output must read correctly without widgets."""
    _open(page, base, token, path.name)
    committed = page.evaluate(f"() => Array.from({PANEL}.content.node.querySelectorAll('.jp-OutputArea-output'))"
                              ".map(e => e.textContent).join('\\n')")
    _screenshots(page, shots, "1-committed")
    assert not STUCK_BAR.search(committed), f"{path.name}: a committed output shows a progress bar stuck at 0%"


@contextlib.contextmanager
def _page(chromium, base, token, path: Path, tmp_path):
    """A browser tab for `path`: (page, screenshot folder). On the way out it prints the time taken and the
    browser console's errors, and shuts the notebook's kernel down: the next notebook gets the cores."""
    page = chromium.new_page(viewport=VIEWPORT)
    console = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: console.append(f"page error: {e}"))
    shots = Path(os.environ.get("TUNEKIT_SCREENSHOTS") or tmp_path) / path.stem
    shots.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        yield page, shots
    finally:
        print(f"\n{path.name}: {time.monotonic() - t0:.0f} s; screenshots in {shots}")
        for line in console:
            print(f"  browser console {line}")
        page.close()
        try:
            for session in json.load(urllib.request.urlopen(f"{base}/api/sessions?token={token}")):
                urllib.request.urlopen(urllib.request.Request(
                    f"{base}/api/sessions/{session['id']}?token={token}", method="DELETE"))
        except OSError as e:
            print(f"  could not shut the kernel down: {e}")


@pytest.mark.browser
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p not in RUN_ALL], ids=lambda p: p.name)
def test_notebook_reads_as_committed_in_jupyterlab(path, chromium, lab, tmp_path):
    base, token, _ = lab
    with _page(chromium, base, token, path, tmp_path) as (page, shots):
        _committed(page, base, token, path, shots)


@pytest.mark.browser
@pytest.mark.parametrize("path", RUN_ALL, ids=lambda p: p.name)
def test_notebook_runs_all_in_jupyterlab(path, chromium, lab, tmp_path):
    base, token, _ = lab
    with _page(chromium, base, token, path, tmp_path) as (page, shots):
        _committed(page, base, token, path, shots)
        _menu(page, "Edit", "Clear Outputs of All Cells")  # so a cell the run never reached reads as not run
        page.wait_for_function(f"() => {CODE_CELLS}.every(c => c.execution_count === null)")
        _menu(page, "Run", "Run All Cells")
        # Run All queues every cell at once ([*]): it is over when none is queued and one has run.
        over = f"() => {RUNNING} === 0 && {CODE_CELLS}.some(c => c.execution_count !== null)"
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (ran := page.evaluate(over)) and time.monotonic() < deadline:
            page.wait_for_timeout(1000)
        cells = page.evaluate(f"() => {CODE_CELLS}")
        n = _screenshots(page, shots, "2-smoke-run")
    assert ran, f"{path.name}: Run All did not finish within {RUN_TIMEOUT_S} s"
    problems = _problems(cells)
    assert not problems, f"{path.name}, in JupyterLab ({n} screenshots in {shots}):\n" + "\n".join(problems)


def test_problems_names_errors_stderr_and_cells_not_run():
    """What fails a notebook here, without a browser: the check on the cells JupyterLab holds after Run All."""
    ok = {"source": "print(1)", "execution_count": 1, "outputs": [{"output_type": "stream", "name": "stdout",
                                                                  "text": "1\n"}]}
    err = {"source": "1/0\n", "execution_count": 2, "outputs": [
        {"output_type": "error", "ename": "ZeroDivisionError", "evalue": "division by zero", "traceback": []}]}
    warn = {"source": ["import warnings\n", "warnings.warn('x')"], "execution_count": 3,
            "outputs": [{"output_type": "stream", "name": "stderr", "text": ["UserWarning: x\n"]}]}
    queued = {"source": "", "execution_count": None, "outputs": []}
    assert _problems([ok]) == []
    assert _problems([ok, err, warn, queued]) == [
        "code cell 2 ('1/0'): ZeroDivisionError: division by zero",
        "code cell 3 ('import warnings'): stderr: UserWarning: x",
        "code cell 4 (''): did not run"]
