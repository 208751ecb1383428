"""Resume and reuse trust only what they checked: the prepared data and the tokenizer a run trains on are
keyed by content, checksummed, recorded by the run (`data.json`) and compared on resume, `generate` and
`export`; bad records and templates fail fast with one line naming the file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import SMALL_ARCH_ARGS, read_arith, write_jsonl

from tunekit import export, stopping, train
from tunekit.cli import main
from tunekit.config import REPO_ROOT
from tunekit.data.layouts import DataError
from tunekit.data.records import load_records
from tunekit.data.tokenizer import train_tokenizer
from tunekit.prepare import prepare
from tunekit.stopping import read_metrics


def files_of(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def losses(run) -> list[float]:
    return [r["loss"] for r in read_metrics(run)]


def edit_keeping_size_and_mtime(path, old: bytes, new: bytes) -> None:
    """Replace `old` with `new` (as long) once, then put the file's times back, as `cp -p` or `rsync -a` would."""
    assert len(old) == len(new)
    st = os.stat(path)
    body = path.read_bytes()
    assert old in body
    path.write_bytes(body.replace(old, new, 1))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns


@pytest.fixture
def own_data(tmp_path, small_records):
    """A data file of this test's own (the session's small_data is shared and must not change)."""
    return write_jsonl(tmp_path / "own.jsonl", small_records)


# ---- a start that fails changes nothing (issue item 3) ---------------------------------------------------


def test_a_failed_overwrite_start_keeps_prepared_and_the_run_keeps_its_tokenizer(make_cfg, tmp_path, small_records):
    good = make_cfg(max_steps=2)
    train.train(good, progress=False)
    run = good.run_dir()
    before, vocab = files_of(run / "prepared"), export.run_tokenizer(good, run).get_vocab()
    few = write_jsonl(tmp_path / "few.jsonl", small_records[:3])  # fewer samples than one batch: fails after prepare
    with pytest.raises(ValueError, match="fewer than one batch"):
        train.train(make_cfg(max_steps=5, data=str(few)), progress=False, overwrite=True)
    assert files_of(run / "prepared") == before, "a start that failed replaced the run's prepared data"
    assert export.run_tokenizer(good, run).get_vocab() == vocab
    assert export.generate(run, ["Question: 1+1?\nAnswer: "], max_new_tokens=2)  # the run's model and tokenizer
    # Into a new folder, the same failure leaves no folder behind.
    with pytest.raises(ValueError, match="fewer than one batch"):
        train.train(make_cfg("fresh", data=str(few)), progress=False)
    assert not (tmp_path / "fresh").exists()


# ---- resume trains on the data and tokenizer the run started with (items 5, 6) ------------------------


@pytest.mark.parametrize("tokenize", ["offline", "in_loop"])
@pytest.mark.parametrize("edit", ["same size and mtime", "appended"])
def test_resume_refuses_edited_data(make_cfg, own_data, tokenize, edit):
    cfg = make_cfg(max_steps=4, save_every=2, data=str(own_data), tokenize=tokenize,
                   packing="pad" if tokenize == "in_loop" else "auto")
    train.train(cfg, stop_after=2, progress=False)
    run = cfg.run_dir()
    before = files_of(run)
    if edit == "appended":
        rec = json.loads(own_data.read_text().splitlines()[5])
        lines = own_data.read_text().splitlines()
        lines[5] = json.dumps({**rec, "answer": rec["answer"] + " And then some more text."})
        own_data.write_text("\n".join(lines) + "\n")
    else:
        edit_keeping_size_and_mtime(own_data, b"stamps", b"stomps")
    with pytest.raises(DataError) as e:
        train.train(cfg, resume=True, progress=False)
    message = str(e.value)
    for part in (str(own_data), "changed since the run started", "data.json", "--overwrite"):
        assert part in message, part
    assert "\n" not in message
    assert files_of(run) == before, "a refused resume changed the run folder"


def test_a_swapped_prepared_tokenizer_is_not_trusted(make_cfg, own_data, tmp_path, capsys):
    """Another run's tokenizer put into the folder: the resume prepares the run's own again (saying so) and
    continues exactly as an uninterrupted run; `generate`/`export` do not use the swapped one either."""
    cfg = make_cfg(max_steps=4, save_every=2, data=str(own_data))
    other = make_cfg("other", max_steps=2, data=str(write_jsonl(tmp_path / "other.jsonl", read_arith(128)[64:])))
    train.train(other, progress=False)
    train.train(cfg, stop_after=2, progress=False)
    run, theirs = cfg.run_dir(), other.run_dir() / "prepared" / "tokenizer"
    ours = export.run_tokenizer(cfg, run).get_vocab()
    assert export.run_tokenizer(other, other.run_dir()).get_vocab() != ours
    for f in theirs.iterdir():  # as `cp other/prepared/tokenizer/* run/prepared/tokenizer/` does: in place
        (run / "prepared" / "tokenizer" / f.name).write_bytes(f.read_bytes())
    capsys.readouterr()
    train.train(cfg, resume=True, progress=True)
    out = capsys.readouterr().out
    assert "corrupt or replaced" in out and str(run / "prepared" / "tokenizer") in out
    clean = make_cfg("clean", max_steps=4, save_every=2, data=str(own_data))
    train.train(clean, progress=False)
    assert losses(run) == pytest.approx(losses(clean.run_dir()), abs=1e-5)
    # The finished run's tokenizer swapped again: generate and export make the run's own, or refuse.
    shutil.rmtree(run / "prepared" / "tokenizer")
    shutil.copytree(theirs, run / "prepared" / "tokenizer")
    assert export.run_tokenizer(cfg, run).get_vocab() == ours
    assert "made it again as the run did" in capsys.readouterr().err


def test_another_tokenizer_under_the_same_name_is_refused(make_cfg, own_data, tmp_path, tokenizer, capsys):
    """`--tokenizer FOLDER` whose contents were replaced: a resume refuses it; generate and export too."""
    folder, theirs = tmp_path / "tok", tmp_path / "theirs"
    tokenizer.save_pretrained(str(folder))
    train_tokenizer([f"other text {i}" for i in range(200)], 300).save_pretrained(str(theirs))
    cfg = make_cfg(max_steps=4, save_every=2, data=str(own_data), tokenizer=str(folder))
    train.train(cfg, stop_after=2, progress=False)
    run = cfg.run_dir()
    os.rename(folder, tmp_path / "ours")
    shutil.copytree(theirs, folder)
    with pytest.raises(DataError) as e:
        train.train(cfg, resume=True, progress=False)
    assert f"the tokenizer ({folder}) is not the one the run trained with" in str(e.value)
    shutil.rmtree(folder)
    os.rename(tmp_path / "ours", folder)
    train.train(cfg, resume=True, progress=False)  # the tokenizer it started with: resumes and finishes
    shutil.rmtree(folder)
    shutil.copytree(theirs, folder)
    (run / "prepared" / "tokenizer" / "tokenizer.json").write_bytes((theirs / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="gives another one"):
        export.generate(run, ["Question: 1+1?"], max_new_tokens=2)
    capsys.readouterr()
    assert main(["export", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(run / "prepared" / "tokenizer") in err and "gives another one" in err and "\n" not in err
    assert not (run / "merged").exists()


# ---- reuse follows the content (item 7) -------------------------------------------------------------


def test_a_save_to_disk_folder_edited_in_place_is_prepared_again(make_cfg, tmp_path, small_records, capsys):
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_list(small_records).save_to_disk(str(folder))
    cfg = make_cfg(data=str(folder))
    tok, ds, _ = prepare(cfg, verbose=False)
    assert "stamps" in tok.decode(ds[0]["input_ids"])
    arrow = next(folder.glob("data-*.arrow"))
    edit_keeping_size_and_mtime(arrow, b"stamps", b"stomps")  # state.json, its fingerprint, kept as it was
    capsys.readouterr()
    tok, ds, _ = prepare(cfg)
    assert "reusing" not in capsys.readouterr().out
    assert "stomps" in tok.decode(ds[0]["input_ids"]), "trained on the old record"


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_file_edited_keeping_size_and_mtime_is_prepared_again(make_cfg, own_data, small_records, kind, capsys):
    if kind == "parquet":  # uncompressed, so that the edit is a byte replacement
        import pyarrow as pa
        import pyarrow.parquet as pq

        own_data = own_data.with_suffix(".parquet")
        pq.write_table(pa.Table.from_pylist(small_records), own_data, compression="NONE", use_dictionary=False)
    cfg = make_cfg(data=str(own_data))
    prepare(cfg, verbose=False)
    edit_keeping_size_and_mtime(own_data, b"stamps", b"stomps")
    capsys.readouterr()
    tok, ds, _ = prepare(cfg)
    assert "reusing" not in capsys.readouterr().out
    assert "stomps" in tok.decode(ds[0]["input_ids"])


# ---- a damaged prepared folder is made again, never read into a traceback (items 11, 12) ---------------


def flip_middle(path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        chunk = f.read(64)
        f.seek(path.stat().st_size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))


DAMAGES = {
    "bit-flipped arrow": lambda p: flip_middle(next((p / "dataset").glob("data-*.arrow"))),
    "truncated tokenizer": lambda p: (p / "tokenizer" / "tokenizer.json").write_bytes(
        (p / "tokenizer" / "tokenizer.json").read_bytes()[:100]),
    "deleted tokenizer folder": lambda p: shutil.rmtree(p / "tokenizer"),
    "corrupt stats.json": lambda p: (p / "stats.json").write_text('{"key": "abc", '),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_prepared_folder_is_prepared_again_on_resume(make_cfg, own_data, damage, capsys):
    cfg = make_cfg(max_steps=4, save_every=2, data=str(own_data))
    train.train(cfg, stop_after=2, progress=False)
    run = cfg.run_dir()
    DAMAGES[damage](run / "prepared")
    capsys.readouterr()
    train.train(cfg, resume=True, progress=True)
    said = [line for line in capsys.readouterr().out.splitlines() if "preparing the data again" in line]
    assert len(said) == 1 and str(run / "prepared") in said[0], said
    clean = make_cfg("clean", max_steps=4, save_every=2, data=str(own_data))
    train.train(clean, progress=False)
    assert losses(run) == pytest.approx(losses(clean.run_dir()), abs=1e-5)
    from tunekit.data import prepared

    assert prepared.load(run / "prepared", json.loads((run / "data.json").read_text())["key"])[0] is not None


def test_a_damaged_prepared_folder_on_resume_through_the_cli_is_no_traceback(tmp_path, own_data, capsys):
    args = ["train", "--preset", "tiny", "--out-dir", str(tmp_path / "run"), "--data", str(own_data),
            "--batch-size", "8", "--max-length", "128", "--max-steps", "4", "--save-every", "2", *SMALL_ARCH_ARGS]
    assert main([*args, "--max-steps", "2"]) == 0
    flip_middle(next((tmp_path / "run" / "prepared" / "dataset").glob("data-*.arrow")))
    assert main([*args, "--resume", "--allow-config-change"]) == 0
    assert "Traceback" not in capsys.readouterr().err


# ---- bad records and templates: fast, one line, naming the file (items 9, 11, 12) ------------------------


def test_a_deeply_nested_record_is_refused_in_milliseconds_naming_its_line(tmp_path, small_records):
    deep = []
    for _ in range(50):
        deep = [deep]
    path = write_jsonl(tmp_path / "deep.jsonl", [*small_records[:5], {"question": "q", "answer": deep}])
    code = ("import sys, time; import datasets; from tunekit.data import layouts, records\n"
            "t = time.perf_counter()\n"
            "try:\n    records.load_records(sys.argv[1], cache_dir=sys.argv[2])\n"
            "except layouts.DataError as e:\n    print(f'{time.perf_counter() - t:.3f}', e, sep='\\n')\n")
    try:  # in a process of its own: before the fix this spun for hours
        done = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "cache")], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("reading a record of 50 nested lists did not end within 60 s")
    seconds, message = done.stdout.strip().split("\n", 1)
    assert float(seconds) < 2, seconds
    assert f"{path}:6: field 'answer' nests lists or objects more than" in message


def test_records_that_disagree_on_a_type_name_the_record_and_the_field(tmp_path, small_records):
    recs = [*small_records[:3], {"question": "2+2?", "answer": 4}]
    path = write_jsonl(tmp_path / "mixed.jsonl", recs)
    with pytest.raises(DataError) as e:
        load_records(str(path), cache_dir=tmp_path / "cache")
    assert f"{path}:4: field 'answer' is a number" in str(e.value) and f"text in {path}:1" in str(e.value)
    assert "one type" in str(e.value)
    # Inside a list: the top-level types agree, pyarrow's do not.
    recs = [{**small_records[0], "tags": ["a", "b"]}, {**small_records[1], "tags": ["c"]},
            {**small_records[2], "tags": [1, 2]}]
    path = write_jsonl(tmp_path / "tags.jsonl", recs)
    with pytest.raises(DataError) as e:
        load_records(str(path), cache_dir=tmp_path / "cache")
    assert f"{path}:3: field 'tags'" in str(e.value) and f"than in {path}:1" in str(e.value)


CHATS = [{"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}] * 16


@pytest.mark.parametrize("template, error", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
])
def test_a_chat_template_that_fails_is_one_line_naming_the_file(tmp_path, capsys, template, error):
    chats = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    file = tmp_path / "escape.jinja"
    file.write_text(template)
    code = main(["prepare", "--preset", "tiny", "--out-dir", str(tmp_path / "run"), "--data", str(chats),
                 "--chat-template", str(file), "--max-length", "64"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert str(file) in err and error in err and f"{chats}: record 1" in err and "\n" not in err


def test_a_damaged_middle_row_of_metrics_names_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [stopping.json_line({"step": s, "loss": 1.0}) for s in (1, 2, 3)]
    path.write_text(rows[0] + rows[1] + '{"step": 4, "lo')  # a run killed while writing its last row
    assert [r["step"] for r in stopping.read_metrics_file(path)] == [1, 2]
    path.write_text(rows[0] + '{"step": 2, "loss": 1.0, \x00\n' + rows[2])
    with pytest.raises(ValueError, match=rf"^{path}:2: not a metrics row"):
        stopping.read_metrics_file(path)
    path.write_text(rows[0] + "[1, 2]\n" + rows[2])
    with pytest.raises(ValueError, match=rf"^{path}:2: not a metrics row"):
        stopping.read_metrics_file(path)
