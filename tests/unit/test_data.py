"""Data: loaders, the offline tokenizer and its cache, prompt masking, chats, truncation, saving, bad input.

Batching (collator, samplers, packing, the DataLoader) is tested in test_batching.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import SMALL_ARCH, offline_failure, write_jsonl

from tunekit import data
from tunekit import hub as tunekit_hub
from tunekit import model as mdl
from tunekit.data.batching import IGNORE, Collator, pack_dataset
from tunekit.data.layouts import (
    CHATML,
    DataError,
    detect_layout,
    format_prompt,
    record_text,
    split_at_markers,
)
from tunekit.data.records import READERS, load_records, resolve_source, shared_data
from tunekit.data.tokenizer import train_tokenizer
from tunekit.data.tokens import (
    count_target_tokens,
    iter_jsonl_tokenized,
    load_tokenized,
    preview,
    save_dataset,
    save_parquet,
    tokenize_batch,
    tokenize_dataset,
)
from tunekit.prepare import prepare, training_texts
from tunekit.step import count_targets, micro_step

GSM8K = shared_data() / "gsm8k" / "train.jsonl"
needs_gsm8k = pytest.mark.skipif(not GSM8K.exists(), reason=f"real GSM8K not present at {GSM8K}")
needs_shakespeare = pytest.mark.skipif(not (shared_data() / "tinyshakespeare" / "input.txt").exists(),
                                       reason="tinyshakespeare not present under shared/data")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_one(tokenizer, rec: dict, max_length: int = 512) -> dict:
    prompt_fields, response = detect_layout(list(rec))
    out = tokenize_batch({k: [v] for k, v in rec.items()}, tokenizer, max_length, prompt_fields, response)
    return {k: v[0] for k, v in out.items()}


def files_under(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


# What `load_records` leaves in its cache for one converted file: the arrow copy and no tokenized result.
CONVERTED = ["data-00000-of-00001.arrow", "dataset_info.json", "state.json"]
CHATML_TEXT = (
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATS = [
    {"messages": [{"role": "system", "content": "Answer with a number."},
                  {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "It is 6."}]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
]


def trained_runs(sample: dict) -> list[list[int]]:
    """The maximal runs of labels that are not ignored."""
    runs, current = [], []
    for t in sample["labels"] + [IGNORE]:
        if t != IGNORE:
            current.append(t)
        elif current:
            runs, current = runs + [current], []
    return runs


# ---- tokenizer -----------------------------------------------------------------------------------


def test_train_tokenizer_is_cached(tmp_path, small_records, monkeypatch):
    texts = [r["question"] + " " + r["answer"] for r in small_records]
    cache = tmp_path / "tok"
    first = train_tokenizer(texts, 300, cache=cache)
    folders = list(cache.iterdir())
    assert len(folders) == 1 and (folders[0] / "tokenizer.json").exists()
    mtime = (folders[0] / "tokenizer.json").stat().st_mtime_ns

    import tokenizers.trainers

    def no_training(*a, **k):
        raise AssertionError("train_tokenizer retrained instead of using its cache")

    monkeypatch.setattr(tokenizers.trainers, "BpeTrainer", no_training)
    second = train_tokenizer(texts, 300, cache=cache)
    assert second.get_vocab() == first.get_vocab()
    assert list(cache.iterdir()) == folders
    assert (folders[0] / "tokenizer.json").stat().st_mtime_ns == mtime
    monkeypatch.undo()
    # Other texts or another size are another tokenizer, in another folder.
    train_tokenizer(texts[:10], 300, cache=cache)
    train_tokenizer(texts, 280, cache=cache)
    assert len(list(cache.iterdir())) == 3


def test_train_tokenizer_uses_tunekit_cache_env(tmp_path, monkeypatch, small_records):
    monkeypatch.setenv("TUNEKIT_CACHE", str(tmp_path / "envcache"))
    train_tokenizer([r["answer"] for r in small_records], 300)
    assert list((tmp_path / "envcache" / "tokenizers").glob("*/tokenizer.json"))


def test_tokenizer_special_tokens_and_round_trip(tokenizer, small_records):
    assert len(tokenizer) <= 1024
    ids = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}
    assert len(ids) == 3 and None not in ids
    texts = [r["question"] + "\n" + r["answer"] for r in small_records[:16]]
    texts += ["Zoë paid €5 — 日本語 too!", "  two  spaces , then tabs\t and a newline\n"]
    for text in texts:
        assert tokenizer.decode(encode(tokenizer, text)) == text
    # Byte-level BPE: characters never seen in training still encode, with no unknown token.
    assert all(i is not None for i in encode(tokenizer, "ж∑🙂"))


# ---- prompt masking ------------------------------------------------------------------------------


def test_labels_mask_bos_and_prompt_exactly(tokenizer, small_records):
    rec = small_records[0]
    sample = tokenize_one(tokenizer, rec)
    prompt = format_prompt(rec, ("question",))
    assert rec["question"].strip() in prompt
    n_prompt = 1 + len(encode(tokenizer, prompt))
    r_ids = encode(tokenizer, rec["answer"])
    ids, labels = sample["input_ids"], sample["labels"]
    assert len(ids) == len(labels) == sample["length"] == n_prompt + len(r_ids) + 1
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert ids[n_prompt:-1] == r_ids
    assert labels[:n_prompt] == [IGNORE] * n_prompt
    assert labels[n_prompt:] == ids[n_prompt:]
    assert not sample["truncated"]


def test_masked_prompt_contributes_nothing_to_loss(tokenizer, small_records):
    """The step loss equals the mean cross-entropy over response (+EOS) predictions alone."""
    sample = tokenize_one(tokenizer, small_records[3])
    n_prompt = sum(1 for t in sample["labels"] if t == IGNORE)
    n = len(sample["input_ids"])
    batch = Collator(tokenizer.pad_token_id)([sample])
    arch = mdl.llama_config(vocab_size=len(tokenizer), **SMALL_ARCH)
    model = mdl.build_model(arch, seed=0)
    n_targets = count_targets([batch])
    assert n_targets == n - n_prompt
    loss = micro_step(model, batch, n_targets, None)

    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[0].float()
    ids = batch["input_ids"][0]
    positions = torch.arange(n_prompt - 1, n - 1)  # each predicts the next token, a response token
    expected = F.cross_entropy(logits[positions], ids[positions + 1])
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    # The whole-sequence loss differs: the prompt would have counted without the mask.
    everything = F.cross_entropy(logits[: n - 1], ids[1:n])
    assert not torch.isclose(everything, expected)


def test_text_layout_trains_on_everything_after_bos(tokenizer):
    sample = tokenize_one(tokenizer, {"text": "Once upon a time there was a tokenizer."})
    assert sample["labels"][0] == IGNORE
    assert sample["labels"][1:] == sample["input_ids"][1:]


def test_instruction_layout(tokenizer):
    rec = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
    sample = tokenize_one(tokenizer, rec)
    prompt = format_prompt(rec, ("instruction", "input"))
    assert "Add the numbers." in prompt and "2 and 3" in prompt
    n_prompt = 1 + len(encode(tokenizer, prompt))
    assert sample["labels"][:n_prompt] == [IGNORE] * n_prompt
    assert sample["labels"][n_prompt:] == encode(tokenizer, "5") + [tokenizer.eos_token_id]


@pytest.mark.parametrize("columns, expected", [
    (["question", "answer"], (("question",), "answer")),
    (["prompt", "response"], (("prompt",), "response")),
    (["instruction", "output"], (("instruction", "input"), "output")),
    (["prompt", "completion", "id"], (("prompt",), "completion")),
    (["text", "meta"], ((), "text")),
    (["messages", "text"], ((), "messages")),
])
def test_detect_layout(columns, expected):
    assert detect_layout(columns) == expected


# ---- chats ---------------------------------------------------------------------------------------


def test_chat_builtin_template_trains_on_assistant_turns_alone(tokenizer):
    assert not tokenizer.chat_template  # the offline BPE has none: the built-in template applies
    sample = tokenize_one(tokenizer, CHATS[0])
    assert sample["input_ids"][0] == tokenizer.bos_token_id
    text = tokenizer.decode(sample["input_ids"])
    for m in CHATS[0]["messages"]:
        assert f"<|{m['role']}|>\n{m['content']}" in text
    answers = [m["content"] for m in CHATS[0]["messages"] if m["role"] == "assistant"]
    runs = trained_runs(sample)
    assert [tokenizer.decode(r[:-1]) for r in runs] == answers
    assert all(r[-1] == tokenizer.eos_token_id for r in runs)
    # Every trained label is the input token at its position (labels are not shifted here).
    assert all(t in (IGNORE, i) for t, i in zip(sample["labels"], sample["input_ids"]))


def test_chat_uses_the_tokenizers_template(tokenizer):
    chatml = copy.deepcopy(tokenizer)
    chatml.chat_template = CHATML
    for rec in CHATS:
        sample = tokenize_one(chatml, rec)
        rendered = chatml.apply_chat_template(rec["messages"], tokenize=False)
        assert chatml.decode(sample["input_ids"]) == rendered
        answers = [m["content"] + "<|im_end|>\n" for m in rec["messages"] if m["role"] == "assistant"]
        assert [chatml.decode(r) for r in trained_runs(sample)] == answers


def test_chat_template_that_is_not_prefix_stable_is_refused(tokenizer):
    odd = copy.deepcopy(tokenizer)
    odd.chat_template = "{% if add_generation_prompt %}!{% endif %}" + CHATML
    with pytest.raises(DataError, match=r"message 3 \(assistant\) cannot be located"):
        tokenize_one(odd, CHATS[0])


def test_chat_dataset_end_to_end(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    ds = load_records(str(path), cache_dir=tmp_path / "cache")
    assert [dict(r) for r in ds] == CHATS
    tok, stats = tokenize_dataset(ds, tokenizer, 512, source=str(path))
    assert stats["samples"] == 2 and stats["truncated"] == 0
    assert tok[1]["input_ids"] == tokenize_one(tokenizer, CHATS[1])["input_ids"]
    assert record_text(CHATS[1], (), "messages") == "Hi\nHello!"


# ---- users' own data: field mapping, instances, response templates, chat templates ---------------

GUANACO = [  # one `text` field per record, the way openassistant-guanaco stores it
    {"text": "### Human: What is 2+2?### Assistant: It is 4."},
    {"text": "### Human: Name a colour.### Assistant: Blue.### Human: Another?### Assistant: Red."},
]


def test_field_mapping_renames_onto_a_layout(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "own.jsonl", [{"q": "What is 2+2?", "a": "4", "id": 1},
                                                {"q": "What is 3+3?", "a": "6", "id": 2}])
    with pytest.raises(DataError, match="none of the known layouts"):  # without a mapping
        tokenize_dataset(load_records(str(path)), tokenizer, 64)
    ds = load_records(str(path), fields="question=q,answer=a")
    assert ds.column_names == ["question", "answer"] and ds.cache_files  # still file-backed: cacheable
    tok, _ = tokenize_dataset(ds, tokenizer, 64)
    assert tok[0]["input_ids"] == tokenize_one(tokenizer, {"question": "What is 2+2?", "answer": "4"})["input_ids"]
    # The layout named is the format used: prompt/response takes the prompt as it is.
    ds = load_records(str(path), fields="prompt=q,response=a")
    assert ds.column_names == ["prompt", "response"]
    sample = tokenize_dataset(ds, tokenizer, 64)[0][1]
    assert tokenizer.decode(sample["input_ids"]) == "<|bos|>What is 3+3?6<|eos|>"
    assert [tokenizer.decode(r) for r in trained_runs(sample)] == ["6<|eos|>"]


@pytest.mark.parametrize("spec, match", [
    ("prompt=q", r"prompt is not one whole layout; map every field of one of: .*prompt\+response"),
    ("prompt=q,reply=a", r"'reply' is not a layout field; the layout fields are .*instances"),
    ("prompt", r"'prompt' is not LAYOUT_FIELD=YOUR_FIELD"),
    ("prompt=q,response=q", r"each layout field and each of your fields may appear once"),
    ("question=q,answer=solution", r"names \['solution'\], which the data does not have \(it has \['a', 'q'\]\)"),
])
def test_field_mapping_errors(tmp_path, spec, match):
    path = write_jsonl(tmp_path / "own.jsonl", [{"q": "What is 2+2?", "a": "4"}])
    with pytest.raises(DataError, match=match):
        load_records(str(path), fields=spec)


def test_template_fields_are_config_fields_on_the_command_line():
    from tunekit import config
    from tunekit.presets import resolve, tiny

    cfg = resolve("tiny", ["--fields", "prompt=q,response=a", "--response-template", "### Assistant:",
                                  "--instruction-template", "### Human:", "--chat-template", "chatml"])
    assert (cfg.fields, cfg.response_template, cfg.instruction_template, cfg.chat_template) == (
        "prompt=q,response=a", "### Assistant:", "### Human:", "chatml")
    with pytest.raises(config.ConfigError, match=r"config field 'fields' = 'prompt=q': prompt is not one whole"):
        tiny(fields="prompt=q")
    with pytest.raises(config.ConfigError, match="instruction_template"):
        tiny(instruction_template="### Human:")


def test_instruction_with_instances_expands_one_sample_per_instance(tmp_path, tokenizer):
    records = [{"instruction": "Add the numbers.", "instances": [{"input": "2 and 3", "output": "5"},
                                                                  {"input": "1 and 1", "output": "2"}]},
               {"instruction": "Say hello.", "instances": [{"input": "", "output": "Hello!"}]}]
    ds = load_records(str(write_jsonl(tmp_path / "tasks.jsonl", records)), cache_dir=tmp_path / "cache")
    assert ds[:] == {"instruction": ["Add the numbers.", "Add the numbers.", "Say hello."],
                     "input": ["2 and 3", "1 and 1", ""], "output": ["5", "2", "Hello!"]}
    tok, stats = tokenize_dataset(ds, tokenizer, 128)
    assert stats["samples"] == 3
    assert tok[1]["labels"] == tokenize_one(tokenizer, {"instruction": "Add the numbers.", "input": "1 and 1",
                                                        "output": "2"})["labels"]
    # Other names, through the mapping: input/output then name the keys inside each instance.
    other = [{"definition": "Add.", "examples": [{"x": "2 3", "y": "5"}]}]
    path = write_jsonl(tmp_path / "other.jsonl", other)
    ds = load_records(str(path), fields="instruction=definition,instances=examples,input=x,output=y")
    assert ds[:] == {"instruction": ["Add."], "input": ["2 3"], "output": ["5"]}


@pytest.mark.parametrize("good, instances, match", [
    ({"input": "1 1", "output": 2}, [{"input": "2 3", "output": 2}, {"input": "2 3", "output": 5}],
     r"record 1: instance 1: 'output' is a number \(2\), expected text"),  # one type per field, or arrow refuses
    ({"input": "1 1", "output": "2"}, [{"input": "2 3"}], r"record 2: instance 1: missing field 'output'"),
    ({"input": "1 1", "output": "2"}, [], r"record 2: 'instances' must be a non-empty list"),
])
def test_bad_instances_name_the_record_and_instance(tmp_path, good, instances, match):
    records = [{"instruction": "Add.", "instances": [good]}, {"instruction": "Add.", "instances": instances}]
    path = write_jsonl(tmp_path / "tasks.jsonl", records)
    with pytest.raises(DataError, match=match):
        load_records(str(path), cache_dir=tmp_path / "cache")


def test_response_template_trains_only_after_the_marker(tmp_path, tokenizer):
    ds = load_records(str(write_jsonl(tmp_path / "g.jsonl", GUANACO)))
    plain, _ = tokenize_dataset(ds, tokenizer, 256)
    assert trained_runs(plain[0]) == [plain[0]["input_ids"][1:]]  # without it the question trains too
    tok, stats = tokenize_dataset(ds, tokenizer, 256, response_template="### Assistant:")
    assert not stats["cached"]  # another template is another tokenization
    first, second = tok[0], tok[1]
    assert tokenizer.decode(first["input_ids"]) == "<|bos|>" + GUANACO[0]["text"] + "<|eos|>"
    assert [tokenizer.decode(r) for r in trained_runs(first)] == [" It is 4.<|eos|>"]
    # Several markers, no instruction template: the last reply alone, as TRL's completion-only collator.
    assert [tokenizer.decode(r) for r in trained_runs(second)] == [" Red.<|eos|>"]


def test_instruction_template_trains_every_reply(tmp_path, tokenizer):
    ds = load_records(str(write_jsonl(tmp_path / "g.jsonl", GUANACO)))
    tok, _ = tokenize_dataset(ds, tokenizer, 256, response_template="### Assistant:",
                                   instruction_template="### Human:")
    assert [tokenizer.decode(r) for r in trained_runs(tok[1])] == [" Blue.", " Red.<|eos|>"]
    assert split_at_markers("A: x B: y A: z", "B:", "A:") == [("A: x B:", False), (" y ", True),
                                                                  ("A: z", False)]


def test_record_without_the_marker_is_an_error_naming_it(tmp_path, tokenizer):
    """Decided: an error naming the record (not a silent drop): a wrong marker would otherwise drop every record."""
    records = GUANACO + [{"text": "### Human: Hi\nAssistant: Hello"}]
    path = write_jsonl(tmp_path / "g.jsonl", records)
    ds = load_records(str(path), cache_dir=tmp_path / "cache")
    with pytest.raises(DataError) as e:
        tokenize_dataset(ds, tokenizer, 256, source=str(path), response_template="### Assistant:")
    msg = str(e.value)
    assert f"{path}: record 3: no response marker '### Assistant:' in its text" in msg
    assert "'### Human: Hi\\nAssistant: Hello'" in msg and "Fix or remove the record" in msg
    assert files_under(tmp_path / "cache") == CONVERTED


def test_templates_refused_where_they_do_not_apply(tmp_path, tokenizer, small_data):
    qa = load_records(str(small_data))
    with pytest.raises(DataError, match="applies to single-text records .* question/answer layout"):
        tokenize_dataset(qa, tokenizer, 128, response_template="### Assistant:")
    with pytest.raises(DataError, match="--chat-template applies to chats"):
        tokenize_dataset(qa, tokenizer, 128, chat_template="chatml")


def test_chat_template_option(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    ds = load_records(str(path))
    chatml, _ = tokenize_dataset(ds, tokenizer, 512, chat_template="chatml")
    assert tokenizer.decode(chatml[1]["input_ids"]) == tokenizer.apply_chat_template(
        CHATS[1]["messages"], tokenize=False, chat_template=CHATML)
    assert [tokenizer.decode(r) for r in trained_runs(chatml[1])] == ["Hello!<|im_end|>\n"]
    # A template file gives the same as the same template by name.
    (tmp_path / "t.jinja").write_text(CHATML)
    from_file, _ = tokenize_dataset(ds, tokenizer, 512, chat_template=str(tmp_path / "t.jinja"))
    assert from_file["input_ids"][:] == chatml["input_ids"][:]
    # builtin ignores the tokenizer's own template; tokenizer needs one.
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = CHATML
    builtin, _ = tokenize_dataset(ds, templated, 512, chat_template="builtin")
    assert builtin[1]["input_ids"] == tokenize_one(tokenizer, CHATS[1])["input_ids"]
    with pytest.raises(DataError, match="chat_template 'tokenizer': this tokenizer has no chat template"):
        tokenize_dataset(ds, tokenizer, 512, chat_template="tokenizer")
    with pytest.raises(DataError, match="chat_template 'nope.jinja': no such file"):
        tokenize_dataset(ds, tokenizer, 512, chat_template="nope.jinja")


def test_sharegpt_turns_through_the_mapping(tmp_path, tokenizer):
    sharegpt = [{"conversations": [{"from": "human", "value": m["content"]} if m["role"] == "user"
                                   else {"from": "gpt", "value": m["content"]} for m in CHATS[1]["messages"]]}]
    ds = load_records(str(write_jsonl(tmp_path / "sg.jsonl", sharegpt)), fields="messages=conversations")
    tok, _ = tokenize_dataset(ds, tokenizer, 512)
    assert tok[0]["labels"] == tokenize_one(tokenizer, CHATS[1])["labels"]


# ---- nothing silent: targets left after truncation, and what the model will see -------------------


def test_samples_left_without_targets_are_dropped_and_counted(tokenizer, small_data):
    ds = load_records(str(small_data))
    full, _ = tokenize_dataset(ds, tokenizer, 10_000)
    prompt_lengths = [next(i for i, t in enumerate(s["labels"]) if t != IGNORE) for s in full]
    cut = sorted(prompt_lengths)[len(prompt_lengths) // 2]  # about half the responses start past this
    expected = sum(n >= cut for n in prompt_lengths)
    assert 0 < expected < len(ds)
    tok, stats = tokenize_dataset(ds, tokenizer, cut)
    assert stats["no_targets"] == expected and stats["samples"] == len(ds) - expected == len(tok)
    assert stats["truncated"] == len(ds)  # every one was cut, dropped or not
    assert all(any(t != IGNORE for t in s["labels"][1:]) for s in tok)
    assert stats["target_tokens"] == count_target_tokens(tok)[0] > 0
    assert stats["tokens"] == sum(tok["length"])
    assert f"{expected} samples kept no target token after truncation to {cut} tokens: dropped" in \
        preview(tok, tokenizer, stats)


def test_no_target_left_anywhere_is_an_error(tmp_path, small_data):
    """`--max-length 16` used to train at loss 0.000 on nothing: now the run stops before it starts."""
    from tunekit.presets import tiny

    cfg = tiny(out_dir=str(tmp_path / "run"), data=str(small_data), max_length=16)
    with pytest.raises(DataError) as e:
        prepare(cfg, verbose=False)
    msg = str(e.value)
    assert f"{small_data}: no sample keeps a target token within max_length=16" in msg
    assert "nothing to train on" in msg and "raise --max-length" in msg


def test_preview_shows_the_masked_part_and_the_target_fraction(tokenizer, small_data, small_records):
    ds, stats = tokenize_dataset(load_records(str(small_data)), tokenizer, 128)
    text = preview(ds, tokenizer, stats)
    rec = small_records[0]
    prompt = format_prompt(rec, ("question",))
    assert f"⟦<|bos|>{prompt}⟧{rec['answer']}<|eos|>" in text
    batch = Collator(tokenizer.pad_token_id)([ds[i] for i in range(len(ds))])
    targets = count_targets([batch])  # what the loss divides by
    assert count_target_tokens(ds) == (targets, stats["tokens"]) and stats["target_tokens"] == targets
    assert f"{targets:,} of {stats['tokens']:,} tokens are targets ({targets / stats['tokens']:.1%})" in text
    assert "nothing in this sample is masked" not in text
    # Without stats it counts them itself; a packed row shows its first sample.
    packed = pack_dataset(ds, 512)
    packed_text = preview(packed, tokenizer)
    assert f"{targets:,} of {stats['tokens']:,} tokens" in packed_text
    first = packed[0]["input_ids"][:packed[0]["position_ids"].index(0, 1)]
    assert tokenizer.decode(first) in packed_text.replace("⟦", "").replace("⟧", "")
    # A text record with nothing masked says so, and how to mask.
    import datasets

    plain = tokenize_dataset(datasets.Dataset.from_list(GUANACO), tokenizer, 256)[0]
    assert "nothing in this sample is masked" in preview(plain, tokenizer)


# ---- whole-dataset tokenization ------------------------------------------------------------------


def test_truncation_is_counted(tokenizer, small_data):
    ds = load_records(str(small_data))
    full, full_stats = tokenize_dataset(ds, tokenizer, max_length=10_000)
    assert full_stats["truncated"] == 0
    lengths = full["length"]
    cut = sorted(lengths)[len(lengths) // 2]  # about half the samples are longer than this
    expected = sum(n > cut for n in lengths)
    assert 0 < expected < len(lengths)
    short, stats = tokenize_dataset(ds, tokenizer, max_length=cut)
    assert stats["truncated"] == expected
    assert stats["samples"] == len(ds) and stats["max_length"] == cut
    assert stats["tokens"] == sum(min(n, cut) for n in lengths)
    assert max(short["length"]) == cut
    for a, b in zip(full, short):
        assert b["input_ids"] == a["input_ids"][:cut] and b["labels"] == a["labels"][:cut]


def test_tokenize_dataset_in_parallel_matches(tokenizer, small_data):
    ds = load_records(str(small_data))
    one, s1 = tokenize_dataset(ds, tokenizer, 128, use_cache=False)
    two, s2 = tokenize_dataset(ds, tokenizer, 128, num_proc=2, use_cache=False)
    assert not s1["cached"] and not s2["cached"]
    assert one["input_ids"][:] == two["input_ids"][:] and one["labels"][:] == two["labels"][:]


def test_save_dataset_replaces_atomically(tmp_path, tokenizer, small_data):
    ds, _ = tokenize_dataset(load_records(str(small_data)), tokenizer, 128)
    target = tmp_path / "dataset"
    save_dataset(ds.select(range(10)), target)
    save_dataset(ds, target)  # over an existing one
    assert len(load_records(str(target))) == len(ds)
    assert [p.name for p in tmp_path.iterdir()] == ["dataset"]


# ---- the cache -----------------------------------------------------------------------------------


def test_load_records_converts_a_file_once(tmp_path, small_records, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", small_records[:8])
    cache = tmp_path / "cache"
    first = load_records(str(path), cache_dir=cache)
    assert first.cache_files and files_under(cache) == CONVERTED  # file-backed: what datasets caching needs
    monkeypatch.setitem(READERS, ".jsonl", lambda p: pytest.fail("read the JSONL again"))
    again = load_records(str(path), cache_dir=cache)
    assert again.cache_files == first.cache_files and again[:] == first[:]
    monkeypatch.undo()
    write_jsonl(path, small_records[:9])  # another content is another conversion
    assert len(load_records(str(path), cache_dir=cache)) == 9
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 2


def test_tokenized_cache_is_reused_and_invalidated(tmp_path, tokenizer, small_data, small_records, monkeypatch):
    cache = tmp_path / "cache"
    ds = load_records(str(small_data), cache_dir=cache)
    first, stats = tokenize_dataset(ds, tokenizer, 128)
    assert not stats["cached"]
    results = [f for f in files_under(cache) if f.startswith("cache-")]
    assert len(results) == 1

    # The same call with a freshly loaded copy of the same tokenizer: read back, tokenize_batch never called.
    same = train_tokenizer(training_texts(load_records(str(small_data))), 1024)
    assert same is not tokenizer
    monkeypatch.setattr(data.tokens, "tokenize_batch", lambda *a, **k: pytest.fail("tokenized again"))
    again, stats = tokenize_dataset(load_records(str(small_data), cache_dir=cache), same, 128)
    assert stats["cached"] and again["input_ids"][:] == first["input_ids"][:]
    assert [f for f in files_under(cache) if f.startswith("cache-")] == results
    monkeypatch.undo()

    # Another max_length or another tokenizer: tokenized again, into a new file.
    _, stats = tokenize_dataset(ds, tokenizer, 64)
    assert not stats["cached"]
    other = train_tokenizer([r["question"] + r["answer"] for r in small_records], 600)
    _, stats = tokenize_dataset(ds, other, 128)
    assert not stats["cached"]
    assert len([f for f in files_under(cache) if f.startswith("cache-")]) == 3
    _, stats = tokenize_dataset(ds, tokenizer, 128, use_cache=False)
    assert not stats["cached"]


def test_tokenizer_fingerprint_is_stable(tokenizer, small_data, small_records):
    """datasets hashes the tokenizer (with dill) into the cache key: it must not change with a reload or
    after use, and must change for another tokenizer or chat template."""
    from datasets.fingerprint import Hasher

    before = Hasher.hash(tokenizer)
    tokenizer(["some text", "more"], add_special_tokens=False)
    assert Hasher.hash(tokenizer) == before
    reloaded = train_tokenizer(training_texts(load_records(str(small_data))), 1024)
    assert Hasher.hash(reloaded) == before
    assert Hasher.hash(train_tokenizer([r["answer"] for r in small_records], 600)) != before
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = CHATML
    assert Hasher.hash(templated) != before


# ---- saving and reading tokenized data -----------------------------------------------------------


@pytest.mark.parametrize("in_memory", [False, True])
def test_tokenized_round_trips_through_disk_and_parquet(tmp_path, tokenizer, small_data, in_memory):
    ds, _ = tokenize_dataset(load_records(str(small_data)), tokenizer, 128)
    disk = load_tokenized(save_dataset(ds, tmp_path / "tokenized"), in_memory=in_memory)
    parquet = load_tokenized(save_parquet(ds, tmp_path / "tokenized.parquet"), in_memory=in_memory)
    for loaded in (disk, parquet):
        assert loaded[:] == ds[:]
        assert bool(loaded.cache_files) != in_memory  # memory-mapped files, or nothing but RAM
    assert load_records(str(tmp_path / "tokenized.parquet"))[:] == ds[:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenized", "tokenized.parquet"]


def test_jsonl_retokenized_per_epoch_matches_offline(tokenizer, small_data):
    offline, _ = tokenize_dataset(load_records(str(small_data)), tokenizer, 64)
    streamed = list(iter_jsonl_tokenized(small_data, tokenizer, 64))
    assert [s["input_ids"] for s in streamed] == offline["input_ids"][:]
    assert [s["labels"] for s in streamed] == offline["labels"][:]


# ---- loaders -------------------------------------------------------------------------------------


def _write_format(fmt: str, tmp_path, records: list[dict]):
    import datasets

    if fmt == "jsonl":
        return write_jsonl(tmp_path / "d.jsonl", records)
    if fmt == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(records))
        return path
    if fmt == "parquet":
        path = tmp_path / "d.parquet"
        datasets.Dataset.from_list(records).to_parquet(str(path))
        return path
    if fmt == "save_to_disk":
        path = tmp_path / "saved"
        datasets.Dataset.from_list(records).save_to_disk(str(path))
        return path
    raise ValueError(fmt)


@pytest.mark.parametrize("kind", ["qa", "chat"])
@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "save_to_disk"])
def test_load_records_formats(fmt, kind, tmp_path, small_records):
    records = small_records[:12] if kind == "qa" else CHATS
    path = _write_format(fmt, tmp_path, records)
    ds = load_records(str(path), cache_dir=tmp_path / "cache")
    assert len(ds) == len(records)
    assert [dict(r) for r in ds] == records
    assert ds.cache_files  # file-backed, so datasets can cache what is computed from it


def test_load_records_text(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("First paragraph,\nstill first.\n\nSecond one.\n\n\n\nThird.\n")
    ds = load_records(str(path))
    assert ds["text"] == ["First paragraph,\nstill first.", "Second one.", "Third."]


def test_relative_path_falls_back_to_repo_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ds = load_records("data/arith/train.jsonl")
    assert len(ds) == 4000 and set(ds.column_names) == {"question", "answer"}


@needs_gsm8k
def test_named_gsm8k_uses_local_copy(tokenizer):
    assert resolve_source("gsm8k") == str(GSM8K)
    ds = load_records("gsm8k")
    assert len(ds) == sum(1 for line in GSM8K.open() if line.strip())
    assert set(ds.column_names) == {"question", "answer"}
    sample = tokenize_one(tokenizer, ds[0])
    n_prompt = 1 + len(encode(tokenizer, format_prompt(ds[0], ("question",))))
    assert sample["labels"][:n_prompt] == [IGNORE] * n_prompt
    assert sample["labels"][n_prompt:] == sample["input_ids"][n_prompt:]
    assert tokenizer.decode(sample["input_ids"][n_prompt:-1]) == ds[0]["answer"]


@needs_shakespeare
def test_named_tinyshakespeare_is_text():
    ds = load_records("tinyshakespeare")
    assert ds.column_names == ["text"] and len(ds) > 1000
    assert all(t.strip() == t and t for t in ds["text"][:100])


def test_hub_name_goes_to_the_hub(monkeypatch):
    import datasets

    calls = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(tunekit_hub, "hub_unreachable", lambda: None)  # as if the hub answered
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or "hub")
    monkeypatch.setattr(data.records, "apply_fields", lambda ds, fields, source: ds)
    assert load_records("someorg/some-dataset") == "hub"
    assert calls == [(("someorg/some-dataset",), {"split": "train"})]


def test_hub_dataset_offline_fails_fast(monkeypatch):
    """HF_HUB_OFFLINE=1 and a hub name the cache lacks: one clear line in well under a second, not 25 s of
    retries ending in "Couldn't reach ... on the Hub"."""
    msg = offline_failure(monkeypatch, lambda: load_records("tunekit-tests/no-such-dataset"))
    assert "dataset 'tunekit-tests/no-such-dataset': HF_HUB_OFFLINE is set" in msg
    assert "local hub cache" in msg and "pass --data a local JSONL/JSON/parquet file" in msg


# ---- bad input -----------------------------------------------------------------------------------
# Each error names the file, the line or record, the field, and what to do; none leaves a file behind.


def test_malformed_jsonl_names_file_and_line(tmp_path, small_records):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in small_records[:4]]
    lines[2] = lines[2][:-5]  # cut the closing of the third record
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as e:
        load_records(str(path), cache_dir=tmp_path / "cache")
    assert f"{path}:3:" in str(e.value) and "Each line must be one JSON object" in str(e.value)
    assert files_under(tmp_path / "cache") == []


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"text": "ok"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r":2: expected a JSON object"):
        load_records(str(path))


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".txt"])
def test_non_utf8_names_file(tmp_path, suffix):
    path = tmp_path / f"latin1{suffix}"
    text = '{"text": "caf\u00e9"}\n' if suffix == ".jsonl" else ('[{"text": "caf\u00e9"}]' if suffix == ".json"
                                                                  else "caf\u00e9\n")
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(DataError) as e:
        load_records(str(path), cache_dir=tmp_path / "cache")
    assert str(path) in str(e.value)
    assert "UTF-8" in str(e.value)
    assert files_under(tmp_path / "cache") == []


def test_records_that_disagree_on_a_type(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"question": "1+1?", "answer": "2"},
                                                  {"question": "2+2?", "answer": 4}])
    with pytest.raises(DataError, match="one type") as e:
        load_records(str(path), cache_dir=tmp_path / "cache")
    assert str(path) in str(e.value)
    assert files_under(tmp_path / "cache") == []


def test_unknown_fields_listed(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"q": "1+1?", "a": "2"}, {"q": "2+2?", "a": "4"}])
    ds = load_records(str(path))
    with pytest.raises(DataError) as e:
        tokenize_dataset(ds, tokenizer, 64)
    assert "['a', 'q']" in str(e.value)
    assert "question/answer" in str(e.value)  # and the layouts it knows
    assert "--fields LAYOUT_FIELD=YOUR_FIELD" in str(e.value)  # and how to map them without writing code


def test_unknown_fields_error_names_the_file(tmp_path):
    from tunekit.presets import tiny

    path = write_jsonl(tmp_path / "odd.jsonl", [{"q": "1+1?", "a": "2"}] * 8)
    with pytest.raises(DataError) as e:
        prepare(tiny(out_dir=str(tmp_path / "run"), data=str(path)), verbose=False)
    assert str(path) in str(e.value)


def test_record_missing_a_field_lists_the_fields_it_has(tmp_path, tokenizer, small_records):
    records = small_records[:2] + [{"question": "What is 2+2?", "solution": "4"}] + small_records[2:4]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    ds = load_records(str(path), cache_dir=tmp_path / "cache")
    with pytest.raises(DataError) as e:
        tokenize_dataset(ds, tokenizer, 64, source=str(path))
    msg = str(e.value)
    assert f"{path}: record 3: missing field 'answer'" in msg
    assert "['question', 'solution']" in msg and "Fix or remove the record" in msg
    assert files_under(tmp_path / "cache") == CONVERTED


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found") as e:
        load_records(str(tmp_path / "nope.jsonl"))
    assert "nope.jsonl" in str(e.value)


@pytest.mark.parametrize("content, match", [
    ("", "no records"),
    ("\n\n", "no records"),
])
def test_empty_file(tmp_path, content, match):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=match):
        load_records(str(path), cache_dir=tmp_path / "cache")
    assert files_under(tmp_path / "cache") == []


def test_json_that_is_not_a_list(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text('{"question": "q", "answer": "a"}')
    with pytest.raises(DataError, match="list"):
        load_records(str(path))


def test_unknown_suffix(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("question,answer\n1,2\n")
    with pytest.raises(DataError, match=r"\.csv"):
        load_records(str(path))


@pytest.mark.parametrize("value, kind", [(4, "a number (4)"), (4.5, "a number (4.5)"), (["4"], 'a list (["4"])'),
                                         (True, "a boolean (true)")])
def test_response_of_another_type_says_the_type(tmp_path, tokenizer, value, kind):
    """Not `empty 'answer'`: the type found and the type expected."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "What is 2+2?", "answer": value}] * 2)
    ds = load_records(str(path), cache_dir=tmp_path / "cache")
    with pytest.raises(DataError) as e:
        tokenize_dataset(ds, tokenizer, 64, source=str(path))
    assert f"{path}: record 1: 'answer' is {kind}, expected text (a JSON string" in str(e.value)


@pytest.mark.parametrize("rec, field", [
    ({"question": "What is 2+2?", "answer": "   "}, "answer"),
    ({"question": "What is 2+2?", "answer": ""}, "answer"),
    ({"question": "  ", "answer": "4"}, "question"),
])
def test_empty_response_or_prompt(tmp_path, tokenizer, small_records, rec, field):
    records = small_records[:3] + [rec]
    ds = load_records(str(write_jsonl(tmp_path / "d.jsonl", records)), cache_dir=tmp_path / "cache")
    with pytest.raises(DataError) as e:
        tokenize_dataset(ds, tokenizer, 64)
    assert f"empty '{field}'" in str(e.value) and "Fill or remove the record" in str(e.value)
    assert "record 4" in str(e.value)  # 1-based: the bad record's line in the file
    assert files_under(tmp_path / "cache") == CONVERTED


def test_bad_record_in_parallel_leaves_no_cache_file(tmp_path, tokenizer, small_records):
    """With num_proc, the shard without the bad record finishes and writes its file: it must go too."""
    records = small_records[:40] + [{"question": "What is 2+2?", "answer": ""}]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    ds = load_records(str(path), cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match="record 41: empty 'answer'"):
        tokenize_dataset(ds, tokenizer, 64, num_proc=2, source=str(path))
    assert files_under(tmp_path / "cache") == CONVERTED


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": "Hi"}, {"role": "tool", "content": "{}"}],
     r"message 2 has role 'tool'; allowed roles are system, user, assistant\. Rename the role"),
    ([{"role": "user", "content": "Hi"}, {"content": "Hello"}], r"message 2 has role None"),
    ([{"role": "user", "content": "Hi"}], r"no assistant message, so nothing to train on"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}],
     r"message 2 \(assistant\) has an empty or non-text 'content'"),
    ([], r"'messages' must be a non-empty list"),
])
def test_bad_chat_records(tmp_path, tokenizer, messages, match):
    path = write_jsonl(tmp_path / "chat.jsonl", CHATS + [{"messages": messages}])
    ds = load_records(str(path), cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match=match) as e:
        tokenize_dataset(ds, tokenizer, 256, source=str(path))
    assert f"{path}: record 3:" in str(e.value)
    assert files_under(tmp_path / "cache") == CONVERTED


def test_sample_longer_than_max_length_is_kept_and_counted(tmp_path, tokenizer, small_records):
    long = {"question": "Add these up.", "answer": " + ".join(str(i) for i in range(200)) + " = 19900"}
    path = write_jsonl(tmp_path / "d.jsonl", small_records[:5] + [long])
    ds, stats = tokenize_dataset(load_records(str(path)), tokenizer, 64)
    assert stats["samples"] == 6 and stats["truncated"] == 1  # reported, not dropped: it keeps targets
    assert stats["no_targets"] == 0
    assert ds[5]["length"] == 64 and len(ds[5]["input_ids"]) == 64
    # A prompt longer than max_length leaves no target: that sample is dropped, and counted.
    long = {"question": "Add these: " + " + ".join(str(i) for i in range(200)), "answer": "19900"}
    path = write_jsonl(tmp_path / "d.jsonl", small_records[:5] + [long])
    ds, stats = tokenize_dataset(load_records(str(path)), tokenizer, 64)
    assert stats["samples"] == 5 == len(ds) and stats["truncated"] == 1 and stats["no_targets"] == 1
