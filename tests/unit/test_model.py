"""Adapters: save -> load -> merge keeps the function the model computes; local paths and the hub fail clearly."""

import http.server
import socket
import threading
import time

import pytest
import torch
from helpers import offline_failure
from transformers import AutoModelForCausalLM

from tunekit import hub as tunekit_hub
from tunekit import model as mdl
from tunekit.data.tokenizer import load_tokenizer
from tunekit.hub import hub_unreachable, load_from_hub


def tiny_base(seed=0):
    return mdl.build_model(mdl.llama_config(64, 2, 4, 128, 256), seed=seed).eval()


def test_save_load_merge_gives_the_same_logits(tmp_path):
    torch.manual_seed(1)
    lora = mdl.apply_lora(tiny_base(), r=8, alpha=16)
    with torch.no_grad():  # make the adapter do something: B starts at zero
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    lora.eval()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = lora(input_ids=ids).logits
    mdl.save_adapter(lora, tmp_path / "adapter")

    loaded = mdl.load_adapter(tiny_base(), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=0, atol=0)

    merged = mdl.merge_adapter(loaded, tmp_path / "merged", dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically: no temp folder left behind


# ---- local folders and the hub: errors a user can act on, in seconds -------------------------------


def test_missing_local_path_says_so(tmp_path):
    """Not `Repo id must be in the form 'repo_name'...`: no such folder, and what a hub name looks like."""
    for load in (lambda: load_tokenizer("/nonexistent/model"),
                 lambda: mdl.build_model(name_or_path="/nonexistent/model")):
        with pytest.raises(FileNotFoundError) as e:
            load()
        msg = str(e.value)
        assert "'/nonexistent/model': no such local folder" in msg
        assert "a hub name such as 'meta-llama/Llama-2-7b-hf' (organisation/name) or 'gpt2'" in msg
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="is a file; give the folder that holds it"):
        mdl.build_model(name_or_path=str(tmp_path / "model.safetensors"))


def test_hub_offline_fails_fast(monkeypatch):
    """HF_HUB_OFFLINE=1 (set after import, as a notebook would) and a name the cache lacks: one clear line in
    well under a second, not 50 s of retries."""
    msg = offline_failure(monkeypatch, lambda: load_tokenizer("tunekit-tests/no-such-model"))
    assert "tokenizer 'tunekit-tests/no-such-model': HF_HUB_OFFLINE is set" in msg
    assert "local hub cache" in msg and "pass a local folder" in msg


def test_hub_unreachable_fails_fast(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")  # nothing listens: refused at once
    start = time.perf_counter()
    with pytest.raises(OSError, match=r"model 'tunekit-tests/no-such-model': http://127\.0\.0\.1:\d+ cannot "
                                           r"be reached .*local hub cache"):
        mdl.build_model(name_or_path="tunekit-tests/no-such-model")
    assert time.perf_counter() - start < 5


def test_hub_that_answers_is_reachable(monkeypatch):
    """Any HTTP answer, even an error status, means the hub is there: the library then says what it says."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        assert hub_unreachable() is None
    finally:
        server.shutdown()
        server.server_close()


def test_unreachable_hub_uses_the_cache_and_says_so(monkeypatch, capsys):
    import datasets.config
    import huggingface_hub.constants as hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(tunekit_hub, "hub_unreachable", lambda: "the hub did not answer")
    before = hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    seen = load_from_hub(lambda: (hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE), "org/name", "model")
    assert seen == (True, True)  # the libraries ran offline: the cache only, no retries
    assert (hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE) == before  # and are put back
    assert "model 'org/name': the hub did not answer; using the copy in the local cache" in capsys.readouterr().err


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
