"""Runs that outlive their command (`tunekit_course.detach`): started, followed, chained."""

from __future__ import annotations

import json

from tunekit_course import detach


def test_a_detached_run_outlives_its_command_and_is_followed_to_its_end(tmp_path, monkeypatch, capsys):
    """A detached chain runs in a session of its own (on the GPU machine it outlives the command that started it);
    `--follow` prints what it wrote since the last follow, and says when it ended, with what."""
    from tunekit_course import notebook

    monkeypatch.setenv("TUNEKIT_SMOKE", "1")
    monkeypatch.setattr(notebook, "RUNS", tmp_path)
    assert detach.main(["--follow", "5"]) == 4  # nothing started here: a fresh machine
    assert "no detached run on this machine" in capsys.readouterr().err
    assert detach.main(["fullrun", "3600", "l5_smoke_a"]) == 0
    assert detach.main(["fullrun", "3600", "l5_smoke_a"]) == 2  # one at a time
    assert "is still going" in capsys.readouterr().err
    assert detach.main(["--follow", "600"]) == 0
    out = capsys.readouterr().out
    assert "whole runs done: l5_smoke_a; all done" in out and "detached run ended: exit code 0" in out
    written = json.loads((notebook.results_dir() / "l5_smoke_a.json").read_text())
    assert written["steps"] == 6 and "gpu_uuid" in written and written["gpu_uuid"] is None  # no GPU here
    assert detach.main(["--follow", "600"]) == 0  # followed again: nothing printed twice
    assert "whole runs done" not in capsys.readouterr().out
    assert detach.main(["fullrun", "0", "l5_smoke_b"]) == 0  # no time: it ends with the run not done
    assert detach.main(["--follow", "600"]) == 5 and "start it again" in capsys.readouterr().out
    # a chain: each command once the one before it ended well; the first that does not ends the chain, with its
    # code (here the waterfall's, refusing its range of bars)
    assert detach.main(["fullrun", "3600", "l5_smoke_a", ";", "waterfall", "60", "9-2", ";", "fullrun", "0",
                        "l5_smoke_b"]) == 0
    assert detach.main(["--follow", "600"]) == 2
    out = capsys.readouterr().out
    assert out.count("detached: python -m tunekit_course.") == 2  # the third never started
    assert "detached: python -m tunekit_course.waterfall 60 9-2" in out and "bars are numbered 0 to" in out
    assert "detached run ended: exit code 2" in out


def test_a_chain_is_split_at_each_semicolon_and_names_its_modules(capsys):
    assert detach.chain(["fullrun", "1", "a", ";", "waterfall", "2", "3-4"]) == [["fullrun", "1", "a"],
                                                                                ["waterfall", "2", "3-4"]]
    assert detach.main(["fullrun", "3600", "l5_smoke_a", ";", ";", "fullrun", "60"]) == 2
    assert "an empty command in the chain" in capsys.readouterr().err
    assert detach.main(["3600", "l5_smoke_a"]) == 2  # fullrun's arguments without the module's name
    assert "each command of the chain starts with one of fullrun, waterfall" in capsys.readouterr().err
    assert detach.main([]) == 2 and "usage" in capsys.readouterr().err
