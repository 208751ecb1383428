"""How pytest runs the lessons (nbval, lax mode, see pyproject.toml): each notebook in a kernel of its own,
started as JupyterLab starts a learner's, and no cell may write to stderr. A warning or a traceback a library
prints reads to a learner as something gone wrong, so it fails the cell here, where every lesson runs; the
browser test (tests/course/test_browser.py) runs lesson 0 in JupyterLab itself."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    # nbval starts a notebook's kernel in its first cell's setup, and the kernel inherits this process's
    # environment. tests/conftest.py sets MPLBACKEND=Agg for the tests: in a kernel every plt.show() would
    # then warn on stderr and draw nothing. The kernel starts without it, with Jupyter's inline backend.
    saved = os.environ.pop("MPLBACKEND", None)
    try:
        return (yield)
    finally:
        if saved is not None:
            os.environ["MPLBACKEND"] = saved


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    written = [o.get("text", "") for o in getattr(item, "test_outputs", None) or []
               if o.get("output_type") == "stream" and o.get("name") == "stderr"]
    if written:
        pytest.fail(f"{item.name} wrote to stderr, which a learner reads as an error:\n"
                    + "".join(written).strip()[-3000:], pytrace=False)
    return result
