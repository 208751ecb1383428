"""Runs that outlive the command that started them: on a GPU machine lent one command at a time, lesson 5's whole
runs and its waterfall go on in one process while each later command follows it. `python -m tunekit_course.detach
COMMAND... [';' COMMAND...]` starts the commands, each a module's name and its arguments (`fullrun 3000 l5_tunekit`,
`waterfall 3000 7-15`: those modules' own commands), one after the other in a process of its own session;
`python -m tunekit_course.detach --follow SECONDS` in each later command prints what it wrote since, until it
ends or SECONDS pass. One process for a whole run: one compile, and no segment boundaries.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tunekit_course import fullrun, notebook, waterfall

# the modules whose commands a chain runs: their `main(argv)`, each returning its exit code
COMMANDS = {"fullrun": fullrun.main, "waterfall": waterfall.main}


def background_folder() -> Path:
    """Where the detached run keeps its output (`log`), its process id (`pid`) and, once it ends, its exit code
    (`exit`): runs/full/background."""
    return fullrun.run_folder("background")


def chain(argv: list[str]) -> list[list[str]]:
    """`argv` split at each ";" into the commands of a chain (`start` runs them in order), each a module's name of
    `COMMANDS` and its arguments; ValueError where one is empty or names no such module."""
    groups: list[list[str]] = [[]]
    for arg in argv:
        if arg == ";":
            groups.append([])
        else:
            groups[-1].append(arg)
    if not all(groups):
        raise ValueError(f"an empty command in the chain {' '.join(argv)!r}: put ';' only between commands")
    if unknown := [g[0] for g in groups if g[0] not in COMMANDS]:
        raise ValueError(f"{', '.join(map(repr, unknown))}: each command of the chain starts with one of "
                         f"{', '.join(COMMANDS)} (e.g. fullrun 3000 l5_tunekit ';' waterfall 3000 7-15)")
    return groups


def run_chain(commands: list[list[str]], exit_file: Path) -> int:
    """Run `commands` (`chain`'s) one after the other, each once the one before it ended with exit code 0; the
    first that does not ends the chain. Writes the last exit code to `exit_file` and returns it."""
    code = 0
    for argv in commands:
        print("detached: python -m tunekit_course." + " ".join(argv), flush=True)
        code = COMMANDS[argv[0]](argv[1:])
        if code:
            break
    exit_file.write_text(str(code))
    return code


def start(argv: list[str]) -> int:
    """Start the chain of commands `argv` (`chain`) in a process of its own session, which outlives the command
    that started it (on a GPU machine lent one command at a time, a run longer than a command goes on while the
    next command follows it with `follow`): one whole-model compile for a whole run instead of one per command.
    Returns the process id; refuses while an earlier detached run is still going."""
    commands = chain(argv)
    folder = background_folder()
    if (pid := _background_pid()) is not None:
        raise RuntimeError(f"a detached run (process {pid}) is still going: follow it with `python -m "
                           "tunekit_course.detach --follow SECONDS`, or stop it first")
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("exit", "log", "pid", "offset"):
        (folder / name).unlink(missing_ok=True)
    code = ("import sys; from pathlib import Path; from tunekit_course import detach, notebook; "
            f"notebook.RUNS = Path({str(notebook.RUNS)!r}); "
            f"sys.exit(detach.run_chain({commands!r}, Path({str(folder / 'exit')!r})))")
    with open(folder / "log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-u", "-c", code], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    (folder / "pid").write_text(str(proc.pid))
    print(f"detached run started (process {proc.pid}): {' '.join(argv)}; follow it with: python -m "
          "tunekit_course.detach --follow SECONDS")
    return proc.pid


def _background_pid() -> int | None:
    """The detached run's process id while it goes on, else None (none started on this machine, or ended)."""
    import contextlib
    import os

    folder = background_folder()
    if not (folder / "pid").exists() or (folder / "exit").exists():
        return None
    pid = int((folder / "pid").read_text())
    with contextlib.suppress(ChildProcessError):  # this process's own child (a test's): reaped once it ended
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    return pid


def follow(seconds: float, poll_s: float = 2.0) -> int:
    """Print what the detached run writes, from where the last `follow` stopped, until it ends or `seconds` pass.
    Returns 3 while it goes on (follow again in the next command); once it has ended 0 (every run asked for is
    done), 5 (it ended with some not done: its own exit code 3; start it again), 1 (it failed or was killed); 4
    when no detached run was started on this machine (a fresh one: start it again)."""
    folder = background_folder()
    if not (folder / "pid").exists():
        print("no detached run on this machine (a fresh one?): start it with python -m tunekit_course.detach "
              "fullrun BUDGET_SECONDS [NAME,...]", file=sys.stderr)
        return 4
    offset_file, t0 = folder / "offset", time.perf_counter()
    offset = int(offset_file.read_text()) if offset_file.exists() else 0
    while True:
        ended = _background_pid() is None
        with open(folder / "log", "rb") as log:
            log.seek(offset)
            chunk = log.read()
        if chunk:
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
            offset += len(chunk)
            offset_file.write_text(str(offset))
        if ended:
            exit_file = folder / "exit"
            code = int(exit_file.read_text()) if exit_file.exists() else None
            print(f"detached run ended: exit code {code if code is not None else 'unknown (it was killed)'}"
                  + ("; not every run is done: start it again" if code == 3 else ""))
            return 1 if code is None else 5 if code == 3 else code
        if time.perf_counter() - t0 >= seconds:
            print(f"detached run still going after {seconds:,.0f} s of following: follow it again")
            return 3
        time.sleep(poll_s)


def main(argv: list[str]) -> int:
    # python -m tunekit_course.detach COMMAND... [";" COMMAND...]   start them, one after the other, detached
    # python -m tunekit_course.detach --follow SECONDS                 what they printed since, until they end
    if len(argv) == 2 and argv[0] == "--follow":
        return follow(float(argv[1]))
    if argv and not argv[0].startswith("--"):
        try:
            start(argv)
        except (RuntimeError, ValueError) as e:
            print(f"detach: {e}", file=sys.stderr)
            return 2
        return 0
    print("usage: python -m tunekit_course.detach COMMAND... [';' COMMAND...] (each fullrun ARGS... or waterfall "
          "ARGS...) | --follow SECONDS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
