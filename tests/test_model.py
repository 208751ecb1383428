"""Adapters: save -> load -> merge keeps the function the model computes."""

import torch
from transformers import AutoModelForCausalLM

from tunekit import model as mdl


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
