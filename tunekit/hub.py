"""Local folder or hub: what is loaded by name, offline or not, and checked before transformers reads it.

- `is_local`: a local folder, or a hub name; a path that is not there is said to be so (not taken for a hub
  name).
- `load_from_hub` / `load_pretrained`: a hub name fails within seconds when the hub is offline
  (`HF_HUB_OFFLINE=1`) or does not answer and the local cache lacks it, where the hub libraries retry for
  25-50 s. A cached copy is used then, saying so. Nothing loaded runs code unless asked:
  `trust_remote_code=False` unless the caller passes True.
- `check_weights`: a local folder's weights before transformers or peft read them: safetensors whole, a
  pickled `.bin` loadable with `weights_only=True`, a damaged or crafted file named in one line.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

# A hub repo id, as huggingface_hub validates it: `name` or `organisation/name`, word characters, '-' and '.'.
HUB_NAME = re.compile(r"^(?:\w[\w.-]*\w/|\w/)?(?:\w[\w.-]*\w|\w)$")


HUB_EXAMPLES = "a hub name such as 'meta-llama/Llama-2-7b-hf' (organisation/name) or 'gpt2'"


HUB_TIMEOUT_S = 5.0  # a reachable hub answers one request in well under a second


class HubError(ConnectionError):
    """The hub is offline or unreachable and the local cache lacks what was asked for; says what to do."""


class WeightsError(ValueError):
    """A weights file is truncated, corrupt, or a pickle that could run code; the message names it."""


def is_local(name_or_path: str, kind: str = "model") -> bool:
    """True for a local folder, False for a hub name; for a path that is not there (or is a file), an error
    saying so and what a hub name looks like, rather than the hub library's complaint about repo ids."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return True
    if path.exists():
        raise FileNotFoundError(f"{kind} {name_or_path!r} is a file; give the folder that holds it "
                                "(with config.json, as save_pretrained writes it).")
    if HUB_NAME.match(name_or_path) and "--" not in name_or_path and ".." not in name_or_path:
        return False
    raise FileNotFoundError(f"{kind} {name_or_path!r}: no such local folder ({path.absolute()}). Give a folder "
                            f"that holds a saved {kind} (as save_pretrained writes it), or {HUB_EXAMPLES}.")


def hub_offline_requested() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE) set to a true value, read now."""
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    return any(os.environ.get(n, "").strip().lower() in ("1", "true", "yes", "on") for n in names)


def hub_unreachable(timeout: float = HUB_TIMEOUT_S) -> str | None:
    """None when the hub ($HF_ENDPOINT, default huggingface.co) answers a request within `timeout` seconds,
    else why not. One request, in a thread so that a hanging DNS lookup (which a socket timeout does not
    bound) is bounded too; proxies come from the environment, as for the hub libraries."""
    import ssl
    import urllib.error
    import urllib.request

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    answer: list[str | None] = []

    def ask() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
            answer.append(None)
        except urllib.error.HTTPError:  # an HTTP status is an answer
            answer.append(None)
        except urllib.error.URLError as e:  # a TLS complaint is an answer too: the libraries have their own setup
            answer.append(None if isinstance(e.reason, ssl.SSLError) else f"{endpoint} cannot be reached ({e.reason})")
        except ssl.SSLError:
            answer.append(None)
        except (OSError, ValueError) as e:
            answer.append(f"{endpoint} cannot be reached ({e})")

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout)
    return answer[0] if answer else f"{endpoint} did not answer within {timeout:g} s"


@contextlib.contextmanager
def hub_offline():
    """huggingface_hub, transformers and datasets in offline mode inside the block (the cache only, no
    request); the mode they had after it. They read HF_HUB_OFFLINE once, at import."""
    import datasets.config
    import huggingface_hub.constants as hub

    old = hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = old


def load_from_hub(load: Callable, name: str, kind: str = "model"):
    """`load()`, which fetches `name` from the hub. When HF_HUB_OFFLINE is set or the hub does not answer within
    HUB_TIMEOUT_S, `load()` runs offline: from the local cache, saying so, or a HubError in seconds saying
    what to do, instead of the libraries' minute of retries."""
    why = "HF_HUB_OFFLINE is set" if hub_offline_requested() else hub_unreachable()
    if why is None:
        return load()
    with hub_offline():
        try:
            loaded = load()
        except OSError as e:  # ConnectionError, FileNotFoundError, transformers' OSError: not in the cache
            import huggingface_hub.constants as hub

            local = "" if "/" in name else f" (and there is no local folder {name!r})"
            todo = ("pass --data a local JSONL/JSON/parquet file, or a save_to_disk folder" if kind == "dataset"
                    else f"pass a local folder that holds the {kind} (as save_pretrained writes it)")
            raise HubError(f"{kind} {name!r}: {why}, and the local hub cache ({hub.HF_HUB_CACHE}) has no copy"
                           f"{local}. Run once where the hub is reachable to cache it, or {todo}. "
                           f"({type(e).__name__})") from None
    if not hub_offline_requested():
        print(f"{kind} {name!r}: {why}; using the copy in the local cache", file=sys.stderr)
    return loaded


def load_pretrained(loader, name_or_path: str, kind: str = "model", trust_remote_code: bool = False, **kwargs):
    """`loader.from_pretrained(name_or_path, trust_remote_code=..., **kwargs)` for a local folder or a hub name,
    with the errors of `is_local` and `load_from_hub`. Code that comes with the model runs only with
    `trust_remote_code`; without it, a model that needs such code is a one-line error."""

    def load():
        try:
            return loader.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **kwargs)
        except ValueError as e:
            if trust_remote_code or "trust_remote_code" not in str(e):
                raise
            raise ValueError(f"{kind} {name_or_path!r} comes with its own Python code (named in its config's "
                             "auto_map), which tunekit does not run unless asked: read that code, then pass "
                             "--trust-remote-code true") from None

    if is_local(name_or_path, kind):
        return load()
    return load_from_hub(load, name_or_path, kind)


# What transformers and peft read from a folder: the safetensors file (or its shards) when there, else the pickle.
WEIGHT_FILES = (("model.safetensors", "pytorch_model.bin"), ("adapter_model.safetensors", "adapter_model.bin"))


def check_weights(folder: str | os.PathLike) -> None:
    """Check the weights files transformers or peft would read from `folder`, before they do: each safetensors
    file's header must cover the file (a truncated copy fails here), and a pickled `.bin` (read when no
    safetensors is there) must load with `weights_only=True`, so it holds tensors only and runs no code.
    A WeightsError (a ValueError) names the file and what is wrong."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():  # a hub name (or a missing folder, which `is_local` explains)
        return
    for names in WEIGHT_FILES:
        for name in names:
            if files := _weight_files(folder / name):
                for f in files:
                    _check_weights_file(f)
                break  # the safetensors are read, not the .bin beside them


def _weight_files(single: Path) -> list[Path]:
    """`single` if it is there, else the shards its `.index.json` lists, else []."""
    if single.is_file():
        return [single]
    index = single.with_name(single.name + ".index.json")
    if not index.is_file():
        return []
    import json

    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightsError(f"{index} is unreadable ({type(e).__name__}: {e}); copy the model folder again") from None
    return [single.with_name(Path(s).name) for s in shards]


def _check_weights_file(path: Path) -> None:
    if not path.is_file():
        raise WeightsError(f"{path} is missing (its index names it); copy the model folder again")
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as e:  # noqa: BLE001 - safetensors' errors: SafetensorError, OSError, ...
            raise WeightsError(f"{path} is truncated or corrupt ({_first_line(e)}); save or copy it again") from None
        return
    import pickle

    try:
        torch.load(path, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise WeightsError(f"{path} is truncated or corrupt ({_first_line(e)}); save or copy it again") from None
        called = re.search(r"GLOBAL ([\w.]+)", str(e))
        raise WeightsError(f"refusing {path}: a pickle that holds more than tensors, and loading it could run code"
                           f"{f' (it calls {called[1]})' if called else ''}. Use weights you trust, saved as "
                           "safetensors.") from None
    except Exception as e:  # noqa: BLE001 - torch.load fails in many ways on a damaged file
        raise WeightsError(f"{path} is truncated or corrupt ({_first_line(e)}); save or copy it again") from None


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
