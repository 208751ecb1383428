"""The model families tunekit is tested on, and what each does on every path: the supported-architectures table
of the README is rendered from `MATRIX`, and `tests/e2e/test_matrix.py` checks every cell of it — a cell
marked tested runs that path on a tiny random-init model of the family's real module layout (its bias, norms,
soft-capping, fused projections and tied embeddings) and agrees with the plain path; a refused cell is refused
with the reason the table gives.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # as the README names it
    arch: str  # what `--arch` calls it (validation.ARCHS): the family a random-init preset of it builds
    hub: str  # a hub model of the family, for `--model`
    sets_apart: str  # what the family's layout has that Llama-2's has not
    tiny: dict  # the config fields of the test's tiny model beyond the shared shape (`TINY`)

    @property
    def model_type(self) -> str:
        """transformers' config `model_type`."""
        return MODEL_TYPES.get(self.arch, self.arch)


MODEL_TYPES = {"gemma3": "gemma3_text"}  # arch -> transformers' model_type, where they differ (Gemma 3's text model)


# The tests' tiny shape, shared by every family: seconds a model on CPU
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512}

FAMILIES = dict(zip(("llama2", "llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"), [
    Family("Llama 2", "llama", "meta-llama/Llama-2-7b-hf", "the course's reference shape",
           {"num_key_value_heads": 4}),
    Family("Llama 3 / 3.1", "llama", "meta-llama/Llama-3.1-8B", "grouped-query attention, RoPE scaling",
           {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 256}}),
    Family("Mistral", "mistral", "mistralai/Mistral-7B-v0.3", "grouped-query attention", {}),
    Family("Qwen2 / 2.5", "qwen2", "Qwen/Qwen2.5-7B", "a bias on q/k/v", {}),
    Family("Qwen3", "qwen3", "Qwen/Qwen3-8B", "RMSNorm on queries and keys", {"head_dim": 16}),
    Family("Gemma 2", "gemma2", "google/gemma-2-9b", "soft-capped logits, tied embeddings, no SDPA path",
           {"head_dim": 16, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
            "tie_word_embeddings": True}),
    Family("Gemma 3 (text)", "gemma3", "google/gemma-3-1b-pt",
           "RMSNorm on queries and keys, local and global layers, tied embeddings",
           {"head_dim": 16, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
            "tie_word_embeddings": True}),
    Family("Phi-3", "phi3", "microsoft/Phi-3-mini-4k-instruct", "fused qkv_proj and gate_up_proj", {}),
]))

PATHS = {  # path -> what its test checks
    "LoRA": "trains (tunekit train on the family's folder)",
    "QLoRA": "on CPU, the path to the 4-bit load and on from it (bitsandbytes' 4-bit needs a CUDA GPU)",
    "fused LoRA": "same loss as peft's LoRA over 3 steps of tunekit train",
    "FP8": "within FP8 rounding of peft's loss and gradients (FP8 matmuls emulated on CPU)",
    "regional compile": "same loss as eager over 3 steps (CPU: traced by dynamo, run by aot_eager)",
    "packing": "packed rows give each sample its own loss",
    "checkpointing": "same loss as without over 3 steps",
    "export + reload": "the merged export reloads with the run's logits",
    "generate": "tunekit generate on the run",
}

TESTED = "tested"
# (family, path) -> why tunekit refuses it; every other cell is tested
REFUSED: dict[tuple[str, str], str] = {}


def cell(family: str, path: str) -> str:
    """What the table says for `family` x `path`: "tested", or the reason it is refused."""
    if family not in FAMILIES or path not in PATHS:
        raise KeyError(f"{family!r} x {path!r}: no such cell")
    return REFUSED.get((family, path), TESTED)


def table() -> str:
    """The README's supported-architectures table (markdown)."""
    head = "| family | sets it apart | " + " | ".join(PATHS) + " |"
    rows = [head, "|" + "---|" * (len(PATHS) + 2)]
    for key, f in FAMILIES.items():
        cells = [cell(key, p) for p in PATHS]
        rows.append(f"| {f.name} (`{f.hub}`) | {f.sets_apart} | " +
                    " | ".join("✓" if c == TESTED else f"refused: {c}" for c in cells) + " |")
    legend = "; ".join(f"**{p}**: {what}" for p, what in PATHS.items())
    return "\n".join(rows) + f"\n\n✓ = tested in CI on a tiny random-init model of the family ({legend})."
