"""One writer per run folder: a lock held for the life of whatever writes there (a training run, an export).

Two `tunekit train` processes started into one folder would otherwise both run, each overwriting some of the
other's files (the config and metrics of one, the checkpoints and adapter of the other), and leave a folder
that neither can resume. The lock is an exclusive `flock` on `<folder>/.tunekit.lock`: the kernel drops it
when its process exits in any way (a `kill -9` included), so a lock left by a dead process is never mistaken
for a live one. The file records the holder's pid, host, command and start time, which the refusal names.

Where `flock` does not exist (Windows) the lock is the file itself, created exclusively; one whose pid no
longer runs on this host is taken over as stale.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK = ".tunekit.lock"


class RunInUseError(RuntimeError):
    """Another live process writes into the folder; the message names it."""


def holder(folder: str | os.PathLike) -> dict | None:
    """What the lock file of `folder` says about its holder (pid, host, command, since), or None."""
    try:
        return json.loads((Path(folder) / LOCK).read_text() or "null")
    except (OSError, ValueError):
        return None


def _refusal(folder: Path, what: str) -> RunInUseError:
    h = holder(folder) or {}
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["since"])) if "since" in h else "?"
    by = f"pid {h.get('pid', '?')} on {h.get('host', '?')} (`{h.get('command', '?')}`, since {since})"
    return RunInUseError(f"{folder} is in use by another tunekit process: {by}. A folder has one writer at a "
                         f"time, so {what} was not started; wait for that process to end or stop it, or choose "
                         "another folder.")


def _alive_here(info: dict | None) -> bool:
    if not info or info.get("host") != socket.gethostname():
        return bool(info)  # another host's lock on a shared disk: its process cannot be checked from here
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, ValueError, TypeError):
        return True
    return True


@contextlib.contextmanager
def hold(folder: str | os.PathLike, what: str = "this command"):
    """Hold `folder`'s lock for the block (the folder must exist); raise `RunInUseError` at once, naming the
    holder, if another process holds it. `what` names the refused command in that message."""
    folder = Path(folder)
    path = folder / LOCK
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                         "command": " ".join(["tunekit", *sys.argv[1:]]) if sys.argv[1:] else what})
    if fcntl is None:  # pragma: no cover - Windows
        with _exclusive_file(path, record, folder, what):
            yield
        return
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _refusal(folder, what) from None
        # The holder before us may have unlinked the file between our open and our flock: then we hold a lock
        # on a file no one else will see. Take the one at the path instead.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, record.encode())
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # before closing: whoever waits then opens a new file
        os.close(fd)


@contextlib.contextmanager
def _exclusive_file(path: Path, record: str, folder: Path, what: str):  # pragma: no cover - Windows
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            break
        except FileExistsError:
            if _alive_here(holder(folder)):
                raise _refusal(folder, what) from None
            path.unlink(missing_ok=True)  # stale: its process is gone
    else:
        raise _refusal(folder, what)
    try:
        os.write(fd, record.encode())
        os.close(fd)
        yield
    finally:
        path.unlink(missing_ok=True)


def held_by_other(folder: str | os.PathLike) -> bool:
    """Whether a live process other than this one holds `folder`'s lock (a look; nothing is taken)."""
    path = Path(folder) / LOCK
    if not path.exists():
        return False
    if fcntl is None:  # pragma: no cover - Windows
        info = holder(folder)
        return _alive_here(info) and info.get("pid") != os.getpid()
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return (holder(folder) or {}).get("pid") != os.getpid()
    finally:
        os.close(fd)  # closing drops the shared lock taken to look
    return False
