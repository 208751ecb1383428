"""Files written whole or not at all, and where tunekit keeps its caches: the ground floor every module may use.

`atomic_output` (a file or folder written beside its final name and renamed into place), `atomic_write_text`
(fsync, then rename), `temp_path` (the hidden temp name, which `checkpoint.clean_temp` recognises), the
writability check that names the folder, `file_sha256` (the checksum of checkpoints and prepared data) and
`cache_dir` ($TUNEKIT_CACHE, else ~/.cache/tunekit).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

# The checkout tunekit runs from: relative data paths fall back to it, and local copies of public datasets live beside
# it (`data.records.shared_data`).
REPO_ROOT = Path(__file__).resolve().parents[1]

def check_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create output directory {path}: {e.strerror}. Choose another --out-dir.") from None
    if not os.access(path, os.W_OK):
        raise OSError(f"output directory {path} is not writable. Choose another --out-dir or fix its permissions.")


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def temp_path(final: str | os.PathLike, tag: str | None = None) -> Path:
    """The temporary path `atomic_output` writes `final` into: `.<name>.<tag>.tmp` beside it, the tag being this
    process's id unless given (processes that write into one temp folder together agree on a tag)."""
    final = Path(final)
    return final.with_name(f".{final.name}.{os.getpid() if tag is None else tag}.tmp")


@contextlib.contextmanager
def atomic_output(final: str | os.PathLike, keep_existing: bool = False, tag: str | None = None):
    """Yield a temporary path beside `final` (`temp_path`) to write a file or folder into. If the block
    finishes, rename it to `final`, replacing what is there — or, with `keep_existing` (caches), keeping a copy
    another process finished first. If the block raises, nothing is left behind."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(final, tag)
    remove(tmp)
    try:
        yield tmp
        if keep_existing and final.exists():
            return
        remove(final)
        try:
            os.replace(tmp, final)
        except OSError:  # a folder another process renamed into place meanwhile
            if not (keep_existing and final.exists()):
                raise
    finally:
        remove(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to a temp file beside `path`, fsync, then rename over `path`."""
    path = Path(path)
    check_writable(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read 4 MB at a time (checkpoints' and prepared data's checksums)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def cache_dir() -> Path:
    """Where tokenizers, converted datasets and saved random-init models are cached: $TUNEKIT_CACHE, or
    ~/.cache/tunekit."""
    return Path(os.environ.get("TUNEKIT_CACHE", Path.home() / ".cache" / "tunekit"))


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated or corrupt; the message names it."""
