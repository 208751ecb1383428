"""Measuring learning honestly: GSM8K answers extracted and scored, the no-training baselines computed on
exactly the tokens the loss scores, and a run's GSM8K accuracy end to end on a tiny run."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import SMALL_ARCH

from tunekit import evaluate as ev
from tunekit import export, train
from tunekit.data.batching import IGNORE
from tunekit.data.layouts import DataError
from tunekit.data.records import shared_data
from tunekit.data.tokens import tokenize_batch
from tunekit.presets import tiny

GSM8K_DIR = shared_data() / "gsm8k"
needs_gsm8k = pytest.mark.skipif(not (GSM8K_DIR / "test.jsonl").exists() or not (GSM8K_DIR / "train.jsonl").exists(),
                                 reason=f"real GSM8K not present under {GSM8K_DIR} (TUNEKIT_DATA_DIR)")


def read_gsm8k(split: str, n: int | None = None) -> list[dict]:
    with open(GSM8K_DIR / f"{split}.jsonl") as f:
        return [json.loads(line) for i, line in enumerate(f) if n is None or i < n]


# ---- extraction --------------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [
    ("so 1000 + 234 = 1234\n#### 1,234", "1234"),
    ("#### $5", "5"),
    ("#### -3.", "-3"),
    ("#### 0.50", "0.5"),
    ("#### 42.0", "42"),
    ("#### .5", "0.5"),
    ("first try #### 7\nno wait\n#### 9", "9"),  # the last #### wins
    ("#### 18 dollars a day", "18"),  # a number followed by text
    ("#### 12\n\nQuestion: what is 3 + 4?", "12"),
    ("#### $1,234,567.00.", "1234567"),
    ("#### -$4", "-4"),
    ("The answer is 42.", "42"),  # no ####: 'answer is' counts
    ("3 + 4 = 7, so the answer is: $1,200", "1200"),
    ("42", "42"),  # the whole text is one number
    (" -7. ", "-7"),
])
def test_extract_answer_reads_the_final_number(text, want):
    assert ev.extract_answer(text) == want


@pytest.mark.parametrize("text", [
    "",
    "I don't know",
    "Janet has 16 eggs and sells 9 of them",  # numbers, but no stated answer: none counts
    "#### ",  # a #### with nothing after it
    "#### seven",
    "#### 5\n####",  # the last #### has no number
])
def test_extract_answer_finds_none(text):
    assert ev.extract_answer(text) is None


def test_extract_answer_without_fallback_needs_hashes():
    assert ev.extract_answer("The answer is 42", fallback=False) is None
    assert ev.extract_answer("x #### 42", fallback=False) == "42"


@needs_gsm8k
def test_real_gsm8k_references_extract_to_their_gold():
    for rec in read_gsm8k("test", 20):
        gold = rec["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        assert ev.extract_answer(rec["answer"]) == gold
        assert ev.reference_answer(rec["answer"]) == gold


def test_exact_match_counts():
    preds = ["... #### 18", "The answer is 3.", "no idea", "#### 1,000", "#### 5"]
    refs = ["blah #### 18", "3", "#### 4", "#### 1000", "#### 6"]
    assert ev.exact_match(preds, refs) == {"accuracy": 3 / 5, "n": 5, "correct": 3, "no_answer": 1}
    assert ev.exact_match([], [])["n"] == 0
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        ev.exact_match(["1", "2"], ["1"])
    with pytest.raises(DataError, match="reference 1: no answer number"):
        ev.exact_match(["1"], ["the answer is unknown"])


# ---- baselines ---------------------------------------------------------------------------------


def test_uniform_is_ln_v_exactly(tokenizer):
    r = ev.unigram_bigram_baselines(tokenizer, ["2 + 2 = 4"], ["3 + 3 = 6"])
    assert r["uniform"] == math.log(len(tokenizer)) and r["vocab_size"] == len(tokenizer)


def test_unigram_matches_a_hand_computation():
    # training targets 0, 0, 1: counts (2, 1, 0, 0), N = 3, V = 4; held-out targets 1, 2
    r = ev.token_baselines(4, [[0, 0, 1]], [[1, 2]], k=1.0)
    p1, p2 = (1 + 1) / (3 + 4), (0 + 1) / (3 + 4)
    assert r["unigram"] == pytest.approx(-(math.log(p1) + math.log(p2)) / 2, rel=1e-12)
    assert r["uniform"] == math.log(4) and r["train_tokens"] == 3 and r["heldout_tokens"] == 2
    assert r["heldout_unseen"] == 0.5
    # Witten-Bell bigram by hand: held-out pairs (start, 1), (1, 2). Start: seen once, followed by 1 types
    # T=1: P(1|start) = (0 + 1 * p1) / (1 + 1); context 1 was never a context in training: the unigram.
    want = -(math.log(p1 / 2) + math.log(p2)) / 2
    assert r["bigram"] == pytest.approx(want, rel=1e-12)


def test_bigram_beats_unigram_on_bigram_structure():
    # each token always followed by the next one (mod 8): the unigram is nearly uniform, the bigram certain
    seqs = [[(s + i) % 8 for i in range(40)] for s in range(8)]
    r = ev.token_baselines(16, seqs, [[(3 + i) % 8 for i in range(40)]])
    assert r["bigram"] < r["unigram"] / 4 and r["unigram"] < r["uniform"]


def test_bad_inputs_are_said():
    with pytest.raises(ValueError, match="outside the vocabulary of 4"):
        ev.token_baselines(4, [[0, 9]], [[1]])
    with pytest.raises(ValueError, match="k=0"):
        ev.token_baselines(4, [[0]], [[1]], k=0)
    with pytest.raises(ValueError, match="no target tokens in the held-out"):
        ev.token_baselines(4, [[0]], [])
    with pytest.raises(DataError, match="record 2: 'answer' is missing"):
        ev.answer_texts([{"question": "q", "answer": "a"}, {"question": "q", "answer": ""}])


@needs_gsm8k
def test_the_baselines_score_the_tokens_the_loss_scores(tokenizer):
    """`target_sequences` of the answers are the labels tunekit trains on (prompt masked, EOS kept), and rows
    tokenized by tunekit give the same unigram (which ignores context) as the answer texts."""
    records = read_gsm8k("test", 30)
    batch = {k: [r[k] for r in records] for k in ("question", "answer")}
    out = tokenize_batch(batch, tokenizer, 10**6, ("question",), "answer")
    seqs = ev.target_sequences(tokenizer, ev.answer_texts(records))
    for labels, seq in zip(out["labels"], seqs):
        assert [t for t in labels[1:] if t != IGNORE] == seq
    rows = [{"input_ids": i, "labels": lab} for i, lab in zip(out["input_ids"], out["labels"])]
    by_rows = ev.row_baselines(len(tokenizer), rows[:20], rows[20:])
    by_texts = ev.unigram_bigram_baselines(tokenizer, ev.answer_texts(records[:20]), ev.answer_texts(records[20:]))
    assert by_rows["unigram"] == pytest.approx(by_texts["unigram"], rel=1e-12)
    assert by_rows["heldout_tokens"] == by_texts["heldout_tokens"] == sum(out["targets"][20:])


@needs_gsm8k
def test_gsm8k_answers_order_the_baselines(tokenizer):
    r = ev.unigram_bigram_baselines(tokenizer, ev.answer_texts(read_gsm8k("train")),
                                    ev.answer_texts(read_gsm8k("test")))
    print(f"GSM8K test answers, V={r['vocab_size']}: uniform {r['uniform']:.4f}, unigram {r['unigram']:.4f}, "
          f"bigram {r['bigram']:.4f} nats/token over {r['heldout_tokens']:,} tokens "
          f"({r['train_tokens']:,} training; {r['heldout_unseen']:.2%} unseen)")
    assert r["uniform"] > r["unigram"] > r["bigram"]


# ---- a run's accuracy, end to end --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, small_data):
    cfg = tiny(out_dir=str(tmp_path_factory.mktemp("runs") / "run"), data=str(small_data), max_steps=2,
               batch_size=4, max_length=128, warmup_steps=1, **SMALL_ARCH)
    train.train(cfg, progress=False)
    return cfg.run_dir()


@needs_gsm8k
def test_gsm8k_accuracy_end_to_end(tiny_run):
    records = read_gsm8k("test", 4)
    r = ev.gsm8k_accuracy(tiny_run, records, n=3, max_new_tokens=8, batch_size=2)
    assert r["n"] == len(r["rows"]) == 3 and 0.0 <= r["accuracy"] <= 1.0
    row = r["rows"][0]
    assert set(row) == {"question", "reference", "prediction", "extracted", "correct"}
    assert row["question"] == records[0]["question"] and row["reference"] == "18"
    assert r["correct"] == sum(x["correct"] for x in r["rows"])


def test_batched_generation_is_export_generate(tiny_run):
    """Left-padded batches give the answers each prompt gets alone (`export.generate`, one at a time)."""
    prompts = ["Question: 2 + 2?\nAnswer: ", "Question: what is 17 times 3, then minus 4?\nAnswer: ", "Q"]
    want = export.generate(tiny_run, prompts, max_new_tokens=6, dtype=torch.float32)
    model, tokenizer, _ = export.load_run(tiny_run, dtype=torch.float32)
    assert export.generate_texts(model, tokenizer, prompts, max_new_tokens=6, batch_size=3) == want
    r = ev.gsm8k_accuracy((model, tokenizer), [{"question": "2 + 2?", "answer": "#### 4"}], max_new_tokens=4)
    assert r["n"] == 1 and r["rows"][0]["reference"] == "4"
    with pytest.raises(DataError, match="record 1: a GSM8K record needs text fields"):
        ev.gsm8k_accuracy((model, tokenizer), [{"prompt": "x"}])


def test_run_baselines_score_the_run_s_own_held_out_rows(tmp_path):
    from tunekit.presets import tiny

    cfg = tiny(out_dir=str(tmp_path / "run"), eval_split=0.2, max_length=64)
    b = ev.run_baselines(cfg)
    assert b["uniform"] == pytest.approx(math.log(b["vocab_size"])) and b["unigram"] < b["uniform"]
    assert b["heldout_tokens"] > 0 and not (tmp_path / "run").exists()  # nothing written into the run's folder
    with pytest.raises(ValueError, match="holds nothing out"):
        ev.run_baselines(tiny(out_dir=str(tmp_path / "run")))
