"""How pytest spreads the suite over two processes (pytest-xdist, `-n 2` in pyproject.toml): the lessons
(notebooks/, nbval) and the course's tests (tests/course/) run on one process, in order — a lesson's cells share
one kernel, and the lessons share their run folders with the course's tests that execute them — and every other
test goes to whichever process is free. Written as a scheduler of its own: xdist's `--dist loadgroup` marks its
groups in the node id, which pytest 9 no longer lets a plugin change."""

from __future__ import annotations

import pytest

COURSE = ("notebooks/", "tests/course/")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: none without it (`-p no:xdist`)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":  # a --dist of the caller's own choice is kept
        return None
    from xdist.scheduler import LoadScopeScheduling

    class CourseInOrder(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "course" if nodeid.startswith(COURSE) else nodeid

    return CourseInOrder(config, log)
