"""Generate the project's own instruction dataset: grade-school arithmetic word problems with worked answers.

The records use GSM8K's layout ({"question", "answer"}, the answer ending in "#### <number>"), so the tiny
run trains on the same code path as real GSM8K. Deterministic: the same seed writes the same bytes.

    python data/arith/make_arith.py            # writes data/arith/train.jsonl and test.jsonl
"""

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jon", "Kemi", "Liam",
         "Maya", "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "shells", "stamps", "cards", "eggs"]


def problem(rng: random.Random) -> dict:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(3, 90), rng.randint(2, 60)
        q = f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?"
        steps, ans = [f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}."], a + b
    elif kind == 1:
        b = rng.randint(2, 40)
        a = b + rng.randint(1, 80)
        q = f"{name} had {a} {item} and gave {b} of them to {other}. How many {item} are left?"
        steps, ans = [f"{name} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {item} left."], a - b
    elif kind == 2:
        a, b = rng.randint(2, 12), rng.randint(2, 15)
        q = f"{name} buys {a} bags of {item}. Each bag holds {b} {item}. How many {item} does {name} buy?"
        steps, ans = [f"{a} bags of {b} {item} is {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}."], a * b
    elif kind == 3:
        b, k = rng.randint(2, 9), rng.randint(2, 14)
        a = b * k
        q = f"{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?"
        steps, ans = [f"Each friend gets {a} / {b} = <<{a}/{b}={k}>>{k} {item}."], k
    else:
        a, b, c = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 30)
        total = a * b
        q = (f"{name} packs {a} boxes with {b} {item} each, then eats {min(c, total - 1)} of them. "
             f"How many {item} are left?")
        c = min(c, total - 1)
        steps = [f"The boxes hold {a} * {b} = <<{a}*{b}={total}>>{total} {item}.",
                 f"After eating {c}, {total} - {c} = <<{total}-{c}={total - c}>>{total - c} are left."]
        ans = total - c
    return {"question": q, "answer": "\n".join(steps) + f"\n#### {ans}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--train", type=int, default=4000)
    ap.add_argument("--test", type=int, default=400)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    for split, n in (("train", args.train), ("test", args.test)):
        path = args.out / f"{split}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            for _ in range(n):
                f.write(json.dumps(problem(rng)) + "\n")
        tmp.replace(path)
        print(f"wrote {n} records to {path}")


if __name__ == "__main__":
    main()
