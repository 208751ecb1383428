"""The full run's three recipes (tunekit/presets.py): the article's before, its checklist as written, tunekit's
recipe. The checklist must differ from the before by the article's items alone, or checklist / before would
judge something besides the article's claim."""

from __future__ import annotations

from tunekit import config
from tunekit.estimate import Setup, estimate_memory_for
from tunekit.presets import (
    ARTICLE_ITEMS,
    GPU_PRESETS,
    PRESETS,
    article_before,
    article_checklist,
    llama7b_after,
    tunekit_recipe,
)


def changed(a, b) -> dict:
    da, db = config.config_dict(a), config.config_dict(b)
    return {k: db[k] for k in da if da[k] != db[k] and k != "preset"}


def test_the_checklist_is_the_before_with_the_article_s_items_and_nothing_else():
    before, checklist = article_before(), article_checklist()
    assert changed(before, checklist) == {k: v for k, v in ARTICLE_ITEMS.items() if getattr(before, k) != v}
    assert all(getattr(checklist, k) == v for k, v in ARTICLE_ITEMS.items())
    # items on the article's list the before holds already: QLoRA (NF4, double quant, bf16 compute),
    # checkpointing, accumulation; the batches stay padded (the article never mentions packing)
    for cfg in (before, checklist):
        assert (cfg.method, cfg.grad_ckpt, cfg.grad_accum, cfg.packing) == ("qlora", True, 7, "pad")
        assert cfg.epochs == 1.0 and cfg.eval_data == "gsm8k-test"


def test_the_before_is_a_plain_hf_peft_user_s_default_stack():
    b = article_before()
    assert (b.attention, b.sdpa_backend) == ("sdpa", "flash,efficient,math,cudnn")  # transformers' default, flash first
    assert (b.tokenize, b.num_workers, b.pin_memory, b.tf32, b.compile, b.loss) == ("in_loop", 0, False, False,
                                                                                   "none", "plain")
    assert (b.optimizer, b.peft_kbit_prepare, b.lora_input_cast, b.fast_lora, b.fp8) == ("adamw_foreach", True, True,
                                                                                         False, False)


def test_tunekit_s_recipe_is_the_after_with_the_fused_lora_and_fp8_for_three_epochs_each_evaluated():
    assert changed(llama7b_after(), tunekit_recipe()) == {"fast_lora": True, "fp8": True, "epochs": 3.0,
                                                          "eval_every": -1, "prefetch_factor": 4}


def test_each_recipe_is_a_valid_gpu_preset_that_fits_one_h200():
    for name in ("article_before", "article_checklist", "tunekit_recipe"):
        cfg = PRESETS[name]()
        cfg.validate()
        assert name in GPU_PRESETS and cfg.preset == name
        assert estimate_memory_for(Setup.of(cfg))["device_total"] < 140e9, name


def test_the_waterfall_goes_from_the_before_to_the_checklist_to_tunekit_one_change_a_bar():
    from tunekit_course.waterfall import WATERFALL, waterfall_configs

    bars = waterfall_configs()
    assert len(bars) == len(WATERFALL) + 1
    for (_, _, before), (_, _, after), (_, change) in zip(bars, bars[1:], WATERFALL):
        moved = {k: after[k] for k in before if before[k] != after[k]}
        assert moved == change, (change, moved)  # each bar changes what its label says, and that alone
    same = ("preset", "epochs", "eval_every")  # the whole runs' length and schedule: not the bars' business
    by_label = {label: fields for _, label, fields in bars}
    for name, fields in (("article_checklist", by_label["+ torch.compile: the article's checklist"]),
                         ("tunekit_recipe", bars[-1][2])):
        target = config.config_dict(PRESETS[name]())
        assert {k: v for k, v in fields.items() if k not in same} == {k: v for k, v in target.items()
                                                                         if k not in same}, name
