"""Measuring what a run learned, honestly: the held-out loss set against baselines that need no training, and
GSM8K answers scored by exact match.

A held-out loss of 1.9 nats means little alone. `unigram_bigram_baselines` gives, for the same tokenizer and
the same held-out answers, the loss of three models that learn nothing a network must: uniform over the
vocabulary (ln V), the training answers' token frequencies (unigram), and which token follows which (bigram).
They score exactly the tokens tunekit's loss scores (`tunekit/data/tokens.py`): a prompt/response record
trains on its response's tokens, encoded on their own (no special tokens), then EOS; the prompt and BOS are
masked. So `target_sequences(tokenizer, answers)` is each answer's ids + EOS, the labels training takes, and a
model's held-out loss (`summary["eval_loss"]`, a mean over target tokens) and these baselines are means over
the same tokens, in the same unit (nats per token). `row_baselines` takes tokenized rows themselves (what
`prepare` + `split_eval` give): any layout, truncation and packing included, each target's context the
token before it in the row.

Smoothing, chosen on nothing held out: the unigram adds `k` (0.5 unless told) to every token's count, so a
token the training answers never used still has probability k / (N + kV). The bigram is Witten-Bell
interpolated with that unigram: P(w | v) = (c(v, w) + T(v) P_uni(w)) / (c(v) + T(v)), T(v) the number of
different tokens seen after v, so its weight on the unigram, T(v) / (c(v) + T(v)), comes from the training
counts alone; a context never seen in training is the unigram. An answer's first token has the context
"start of answer" (the model sees the prompt there: the bigram is given less, one token in each answer).

`extract_answer` reads a GSM8K answer (the number after the last `####`), `exact_match` scores texts against
references, and `gsm8k_accuracy` generates a run's greedy answers to GSM8K questions and scores them.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

import numpy as np
import torch

from tunekit.data.batching import IGNORE
from tunekit.data.layouts import DataError, detect_layout, format_prompt

UNIGRAM_K = 0.5  # add-k: what every token's training count is raised by

# ---- baselines ---------------------------------------------------------------------------------


def answer_texts(records, source: str = "records") -> list[str]:
    """The response field of each record of a prompt/response layout (GSM8K's `answer`): what training scores.
    `records` is a list of dicts or a `datasets.Dataset` (e.g. `load_records("gsm8k-test")`). Chats and single
    texts have no one response field: tokenize them and pass the rows to `row_baselines`."""
    rows = list(records)
    if not rows:
        raise DataError(f"{source}: no records, so no answers to score")
    _, response = detect_layout(list(rows[0]), source)
    if response in ("messages", "text"):
        raise DataError(f"{source}: the {response} layout has no response field; tokenize the records "
                        "(tokenize_dataset) and pass the rows to row_baselines")
    out = []
    for i, rec in enumerate(rows, 1):
        if not isinstance(rec.get(response), str) or not rec[response].strip():
            raise DataError(f"{source}: record {i}: '{response}' is missing or empty. Fix or remove the record.")
        out.append(rec[response])
    return out


def target_sequences(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each response text's target tokens as training labels them: its ids (no special tokens) then EOS."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token: tunekit's training labels end in one; set "
                         "tokenizer.eos_token")
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []
    return [list(t) + [tokenizer.eos_token_id] for t in ids]


def _pairs_of_sequences(seqs: list[list[int]], start: int) -> tuple[np.ndarray, np.ndarray]:
    """(contexts, targets): every token of every sequence with the token before it, `start` before the first."""
    seqs = [s for s in seqs if s]

    def flat(xs):
        return np.fromiter((t for s in xs for t in s), dtype=np.int64)

    return flat([[start, *s[:-1]] for s in seqs]), flat(seqs)


def _pairs_of_rows(rows, start: int) -> tuple[np.ndarray, np.ndarray]:
    """(contexts, targets) at the positions the loss takes: label i (i >= 1) that is not IGNORE, predicted from
    input token i - 1 (`step.StepModule` shifts the labels by one)."""
    ctx, tgt = [], []
    for n, row in enumerate(rows, 1):
        ids, labels = np.asarray(row["input_ids"], dtype=np.int64), np.asarray(row["labels"], dtype=np.int64)
        if ids.shape != labels.shape:
            raise ValueError(f"row {n}: input_ids and labels differ in length ({len(ids)}, {len(labels)}); "
                             "tokenize the data again")
        keep = np.flatnonzero(labels[1:] != IGNORE) + 1
        ctx.append(ids[keep - 1])
        tgt.append(labels[keep])
    if not ctx:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(ctx), np.concatenate(tgt)


def _baselines(vocab_size: int, train: tuple[np.ndarray, np.ndarray], held: tuple[np.ndarray, np.ndarray],
               k: float) -> dict:
    """Cross-entropies (nats per held-out target) of uniform, add-k unigram and Witten-Bell bigram."""
    (train_ctx, train_tgt), (held_ctx, held_tgt) = train, held
    V, states = vocab_size, vocab_size + 1  # context `V` is the start of an answer
    if not len(train_tgt) or not len(held_tgt):
        raise ValueError(f"no target tokens in the {'training' if not len(train_tgt) else 'held-out'} texts")
    if k <= 0:
        raise ValueError(f"k={k}: the unigram's add-k must be > 0, or a token unseen in training has probability 0")
    for name, arr in (("training", train_tgt), ("held-out", held_tgt)):
        if arr.min() < 0 or arr.max() >= V:
            raise ValueError(f"a {name} token id ({arr.min()} .. {arr.max()}) is outside the vocabulary of "
                             f"{V}: pass the tokenizer the ids came from (len(tokenizer))")
    counts = np.bincount(train_tgt, minlength=V).astype(np.float64)
    n = len(train_tgt)
    p_uni = (counts + k) / (n + k * V)
    keys, pair_counts = np.unique(train_ctx * states + train_tgt, return_counts=True)
    ctx_counts = np.bincount(train_ctx, minlength=states).astype(np.float64)
    followers = np.bincount(keys // states, minlength=states).astype(np.float64)
    held_keys = held_ctx * states + held_tgt
    at = np.minimum(np.searchsorted(keys, held_keys), len(keys) - 1)
    c_vw = np.where(keys[at] == held_keys, pair_counts[at], 0).astype(np.float64)
    c_v, t_v, pu = ctx_counts[held_ctx], followers[held_ctx], p_uni[held_tgt]
    seen = c_v > 0
    p_bi = np.where(seen, (c_vw + t_v * pu) / np.where(seen, c_v + t_v, 1.0), pu)
    return {"uniform": math.log(V), "unigram": float(-np.log(pu).mean()), "bigram": float(-np.log(p_bi).mean()),
            "vocab_size": V, "train_tokens": int(n), "heldout_tokens": len(held_tgt),
            "heldout_unseen": float((counts[held_tgt] == 0).mean()), "k": k}


def token_baselines(vocab_size: int, train_seqs: list[list[int]], heldout_seqs: list[list[int]],
                    k: float = UNIGRAM_K) -> dict:
    """The baselines (see the module's docstring) of target-token sequences, each sequence one answer whose
    every token is a target: {uniform, unigram, bigram} in nats per held-out token, with the counts behind
    them (train_tokens, heldout_tokens, heldout_unseen: the share of held-out tokens training never saw)."""
    return _baselines(vocab_size, _pairs_of_sequences(train_seqs, vocab_size),
                      _pairs_of_sequences(heldout_seqs, vocab_size), k)


def unigram_bigram_baselines(tokenizer, train_texts: list[str], heldout_texts: list[str],
                             k: float = UNIGRAM_K) -> dict:
    """Cross-entropy in nats per token of `heldout_texts` under uniform (ln V, V = len(tokenizer)), add-k
    unigram and interpolated bigram models fit on `train_texts`. The texts are responses (`answer_texts`);
    each is scored as training scores it, its ids then EOS (`target_sequences`), so a run's held-out loss on
    the same answers is directly comparable. Returns the dict of `token_baselines`."""
    return token_baselines(len(tokenizer), target_sequences(tokenizer, train_texts),
                           target_sequences(tokenizer, heldout_texts), k)


def row_baselines(vocab_size: int, train_rows, heldout_rows, k: float = UNIGRAM_K) -> dict:
    """The baselines on tokenized rows ({input_ids, labels}, e.g. `prepare(cfg)` then `split_eval`): exactly the
    positions the loss takes, whatever the layout, truncation or packing; a target's bigram context is the
    input token before it (for an answer's first token, the prompt's last). Returns `token_baselines`' dict."""
    return _baselines(vocab_size, _pairs_of_rows(train_rows, vocab_size), _pairs_of_rows(heldout_rows, vocab_size), k)


def run_baselines(cfg) -> dict:
    """`row_baselines` of a run's config: its tokenizer, training rows and held-out rows (`eval_data` or
    `eval_split`) as its training prepared them, packed if it packs (tokenized offline here either way: the same
    tokens; nothing is written into the run's folder)."""
    import dataclasses

    from tunekit.prepare import prepare, split_eval

    offline = dataclasses.replace(cfg, tokenize="offline")
    tokenizer, ds, stats = prepare(offline, verbose=False, commit=False)
    train, held = split_eval(ds, offline, tokenizer, stats)
    if held is None:
        raise ValueError("the config holds nothing out (no eval_data, eval_split 0): no held-out loss to compare")
    return row_baselines(len(tokenizer), train, held)


# ---- GSM8K exact match -------------------------------------------------------------------------

_NUMBER = r"[-+]?\$?\s?[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\$?\.\d+"
_ANSWER_IS = re.compile(r"answer\s+is\s*[:=]?\s*(" + _NUMBER + ")", re.IGNORECASE)


def normalize_number(text: str) -> str | None:
    """A number's canonical text: `$`, commas, spaces and a trailing `.` dropped, trailing decimal zeros too
    ("1,234.50" -> "1234.5", "$5" -> "5", "-3." -> "-3", ".5" -> "0.5", "-0" -> "0"); None if it is no number."""
    s = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    s = s.replace("+-", "-").replace("-+", "-").lstrip("+")
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_answer(text: str, fallback: bool = True) -> str | None:
    """The final answer of a GSM8K-style solution, normalized (`normalize_number`), or None.

    The first number after the last `####` (GSM8K's own format; a later `####` wins, text after the number is
    ignored: "#### 18 dollars" -> "18"). If there is a `####` with no number after it: None. Without any
    `####` and with `fallback` (the default): the number after the last "answer is" ("The answer is 42."), or
    the text itself when it is just one number ("42"). No other number counts: a model that never states an
    answer gets none, rather than credit for the last number it happened to write."""
    if not isinstance(text, str):
        raise TypeError(f"extract_answer takes the model's text, got {type(text).__name__}")
    if "####" in text:
        found = re.search(_NUMBER, text.rsplit("####", 1)[1])
        return normalize_number(found.group()) if found else None
    if not fallback:
        return None
    said = _ANSWER_IS.findall(text)
    if said:
        return normalize_number(said[-1])
    return normalize_number(text) if re.fullmatch(r"\s*(?:" + _NUMBER + r")\s*\.?\s*", text) else None


def reference_answer(reference: str, where: str = "reference") -> str:
    """A gold answer's number: GSM8K's full answer text ("... #### 18") or the number itself ("18")."""
    got = extract_answer(reference, fallback=False) if "####" in reference else normalize_number(reference)
    if got is None:
        raise DataError(f"{where}: no answer number in {reference[-60:]!r}; a GSM8K reference ends in "
                        "'#### NUMBER' or is the number itself")
    return got


def exact_match(predictions: list[str], references: list[str]) -> dict:
    """Score model texts against references by their extracted, normalized numbers ("42.0" matches "42").
    Returns {accuracy, n, correct, no_answer (predictions with no answer found, counted wrong)}."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references: give one per question")
    got = [extract_answer(p) for p in predictions]
    gold = [reference_answer(r, f"reference {i}") for i, r in enumerate(references, 1)]
    correct = sum(g is not None and g == r for g, r in zip(got, gold))
    n = len(gold)
    return {"accuracy": correct / n if n else 0.0, "n": n, "correct": correct,
            "no_answer": sum(g is None for g in got)}


# ---- generating and scoring -------------------------------------------------------------------


@torch.no_grad()
def _gsm8k_records(records, n: int | None) -> list[dict]:
    if isinstance(records, (str, Path)):
        from tunekit.data.records import load_records

        records = load_records(str(records))
    rows = [records[i] for i in range(len(records) if n is None else min(n, len(records)))]
    for i, rec in enumerate(rows, 1):
        if not isinstance(rec, dict) or not all(isinstance(rec.get(f), str) for f in ("question", "answer")):
            raise DataError(f"record {i}: a GSM8K record needs text fields 'question' and 'answer' "
                            f"(it has {sorted(rec) if isinstance(rec, dict) else type(rec).__name__})")
    return rows


def gsm8k_accuracy(run_dir_or_model, records="gsm8k-test", n: int | None = 100, max_new_tokens: int = 256,
                   batch_size: int = 8, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """Greedy answers to the first `n` GSM8K questions (all with n=None), scored by exact match.

    `run_dir_or_model`: a run folder (loaded once with `export.load_run`) or a (model, tokenizer) pair (e.g.
    `Finished.load()`). `records`: GSM8K records (a list, a dataset) or a source (`gsm8k-test`). Each question
    is rendered as training renders the question/answer layout ("Question: ...\\nAnswer: ", `format_prompt`);
    a model that goes on past its answer to a new "Question:" is cut there before extracting. Returns
    {accuracy, n, correct, no_answer, rows: [{question, reference, prediction, extracted, correct}]}. A
    random-init model scores 0: expected."""
    from tunekit.export import generate_texts, load_run  # the run floor: export imports the model's floors

    rows = _gsm8k_records(records, n)
    if isinstance(run_dir_or_model, (str, Path)):
        dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
        model, tokenizer, _ = load_run(run_dir_or_model, device, dtype)
    else:
        model, tokenizer = run_dir_or_model
    layout = detect_layout(list(rows[0]), "GSM8K records") if rows else (("question",), "answer")
    prompts = [format_prompt(r, layout[0]) for r in rows]
    texts = generate_texts(model.eval(), tokenizer, prompts, max_new_tokens, batch_size, device)
    texts = [t.split("Question:", 1)[0] for t in texts]
    scored = []
    for i, (rec, text) in enumerate(zip(rows, texts), 1):
        gold, got = reference_answer(rec["answer"], f"record {i}"), extract_answer(text)
        scored.append({"question": rec["question"], "reference": gold, "prediction": text, "extracted": got,
                       "correct": got == gold})
    result = exact_match(texts, [r["reference"] for r in scored]) if scored else \
        {"accuracy": 0.0, "n": 0, "correct": 0, "no_answer": 0}
    return {**result, "rows": scored}
