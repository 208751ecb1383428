"""What to run on each card (tunekit_course/cards.py): the fastest measured configuration that fits each memory
size, FP8 only where the card has FP8 matmuls, only results of the same model compared."""

from __future__ import annotations

import pytest

from tunekit_course import cards

SHAPE = {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 32, "intermediate_size": 11008,
         "vocab_size": 32000, "max_length": 2048}


def step(name, tps, reserved, method="lora", fp8=False, **config):
    return {"name": name, "tokens_per_s": tps, "peak_memory_gb": reserved / 1.1, "peak_reserved_gb": reserved,
            "config": {**SHAPE, "method": method, "batch_size": 4, "fp8": fp8, **config}}


def test_each_card_gets_the_fastest_that_fits_and_fp8_only_where_it_runs():
    rs = {r["name"]: r for r in (step("q", 9000, 15.0, "qlora", grad_ckpt=True), step("l", 13000, 60.0),
                                 step("f8", 24000, 74.0, fp8=True), step("big", 13500, 108.0, batch_size=8))}
    rows = cards.fastest_per_card(rs)
    picked = [(row["gb"], row["gpus"], row["result"]["name"]) for row in rows]
    # reserved peak + 0.75 GB of CUDA context: 15.75 fits 24 GB, 60.75 does not fit 48, 74.75 fits 80
    assert picked == [(24, ["RTX 4090", "RTX 3090"], "q"), (48, ["L40S", "RTX A6000"], "q"),
                      (80, ["H100"], "f8"), (80, ["A100 80GB"], "l"), (141, ["H200"], "f8")]
    assert rows[0]["need_gb"] == pytest.approx(15.8)
    text = cards.what_to_run(rs, "an H200")
    assert "speeds are an H200's" in text and "  80 GB (A100 80GB): LoRA, batch 4: 13,000 tok/s, needs ~60.8 GB" in text
    assert "nothing measured here fits" in cards.what_to_run({"big": rs["big"]})  # on 24, 48 and 80 GB


def test_only_results_of_the_same_model_and_length_are_compared():
    rs = {"seven": step("seven", 1000, 20.0), "small": step("small", 40000, 10.0, hidden_size=2048),
          "long": step("long", 900, 20.0, max_length=4096)}
    assert list(cards.same_shape(rs, rs["seven"])) == ["seven"]


def test_a_lesson_s_closing_lines_read_the_published_results_and_yours_first():
    text = cards.for_lesson("l2_", "l2_lora_b4", skip=("heldout",))
    assert text.startswith("What to run") and "the published H200's" in text and "q/v only" not in text
    mine = {"l2_mine": step("l2_mine", 5000, 20.0)}
    yours = cards.for_lesson("l2_", "l2_lora_b4", mine=mine, gpu="your RTX 4090")
    assert yours.index("your RTX 4090's") < yours.index("the published H200's")
    assert "LoRA, batch 4: 5,000 tok/s, needs ~20.8 GB" in yours  # the same model as the published step
    assert "no published result" in cards.for_lesson("l2_", "l2_nothing")


def test_on_several_cards_only_runs_on_that_many_gpus_count_each_card_holding_one_process():
    rs = {r["name"]: r for r in (step("one", 13000, 60.0), {**step("ddp", 12700, 62.0), "world_size": 2},
                                 {**step("fsdp_q", 8700, 12.0, "qlora", grad_ckpt=True), "world_size": 2},
                                 {**step("four", 12000, 40.0), "world_size": 4})}
    text = cards.what_to_run(rs, "an H200", gpus=2)
    assert text.startswith("What to run on 2 cards, by the memory of each") and "tok/s per GPU, an H200's" in text
    assert "  24 GB (RTX 4090, RTX 3090): QLoRA, batch 4, checkpointing, DDP on 2 GPUs: 8,700 tok/s" in text
    assert "  80 GB (H100, A100 80GB): LoRA, batch 4, DDP on 2 GPUs: 12,700 tok/s" in text  # not the 1-GPU run
    assert "13,000" not in text and "12,000" not in text
    assert "DDP on 2 GPUs" in cards.for_lesson("l3_", "l3_lora_1gpu", skip=("p2p", "train"), gpus=2)
