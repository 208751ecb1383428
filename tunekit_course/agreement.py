"""Whether the committed notebooks say what the published results say. A notebook executed before its results
were re-measured or its code changed shows an older verdict or older figures; this finds them, line by line, so
the two cannot drift apart unseen. Two checks:

- verdicts (`disagreements`): every verdict a notebook printed (a line `[yours, GPU: | published, GPU:
  ]CLAIM verdict: VERDICT — EVIDENCE`, and each row of a claims table it displayed) against the verdict
  `claims.judge` gives today from `notebooks/results/`, the files the README's tables are generated from;
- figures (`figure_disagreements`): the notebook executed again in replay mode (TUNEKIT_REPLAY=1: the published
  results read back, nothing measured, on any machine, `pages.replay_all`), and every line of it that starts with a
  published result's name (a table row, a result beside another, a whole run's summary) held against the
  committed cell's lines that start with that name: each figure the code prints today from the file must be
  among the figures the committed cell printed there, as printed (rounded as the replayed line rounds it).
  Lines that depend on the mode by design (where a result was read from) are left out; a committed cell that
  has no line for a result the code prints today is a disagreement (an output older than the cell's code). A
  line labelled "published" that names no result (a figure read from several results at once, lesson 5's FP8
  band) must be in the committed cell as the replay prints it.

    python -m tunekit_course.agreement [NOTEBOOK...]            each disagreement, one a line; exit code 1 if any
    python -m tunekit_course.agreement --figures [NOTEBOOK...]  the figure check too (replays each notebook)
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

from tunekit.config import REPO_ROOT

NOTEBOOKS = REPO_ROOT / "notebooks"

# a verdict printed by `notebook.verdict` or `print(claims.judge(...))`: an optional "yours, GPU: " or
# "published, GPU (replayed): " before it; "—" between the verdict and its evidence (claims.Verdict.__str__)
VERDICT_LINE = re.compile(r"^(?:(?P<side>yours|published)\b[^:]*: )?(?P<claim>[\w ]+?) verdict: (?P<verdict>.+?) — "
                          r"(?P<evidence>.*)$")
# a row of a claims table a notebook displayed (claims.claims_table): | claim | says | **verdict** | evidence |...
TABLE_ROW = re.compile(r"^\| (?P<claim>[^|]+?) \| [^|]*\| \*\*(?P<verdict>.+?)\*\* \| (?P<evidence>.*?) \| [^|]* \| "
                       r"[^|]* \|$")


@dataclass
class Printed:
    """A verdict as a committed notebook shows it: where (notebook, cell index), whose (yours, published, or
    "" where the notebook printed one alone), and what."""
    notebook: str
    cell: int
    side: str
    claim: str
    verdict: str
    evidence: str


def _texts(cell) -> list[str]:
    """The text of a code cell's outputs: streams, and the plain or markdown form of displayed data."""
    out = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            out.append(o.get("text", ""))
        elif data := o.get("data"):
            out.append(data.get("text/markdown") or data.get("text/plain") or "")
    return out


def printed(path: str | Path) -> list[Printed]:
    """Every verdict the committed notebook at `path` shows in its outputs, in order."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for text in _texts(cell):
            for line in text.split("\n"):
                line = line.rstrip()
                if m := VERDICT_LINE.match(line):
                    found.append(Printed(path.name, i, m["side"] or "", m["claim"], m["verdict"], m["evidence"]))
                elif m := TABLE_ROW.match(line):
                    evidence = re.sub(r" \((?:`[^`]+`(?:, )?)+\)$", "", m["evidence"])  # its result files, apart
                    found.append(Printed(path.name, i, "table", m["claim"], m["verdict"], evidence))
    return found


def disagreements(paths: list[Path] | None = None, rs: dict[str, dict] | None = None) -> list[str]:
    """One line for each verdict the notebooks at `paths` (default: every lesson) show that differs from the
    verdict judged from the published results `rs` (default: notebooks/results): the verdict itself, or its
    evidence (the figures). A claim the judging code no longer knows is one too."""
    from tunekit import results
    from tunekit_course import claims

    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")) if paths is None else paths
    rs = results.by_name(NOTEBOOKS / "results") if rs is None else rs
    judged: dict[str, claims.Verdict | None] = {}
    out = []
    for path in paths:
        for p in printed(path):
            where = f"{p.notebook}, cell index {p.cell}" + (f" ({p.side})" if p.side else "")
            if p.claim not in judged:
                judged[p.claim] = claims.judge_any(p.claim, rs)
            if (now := judged[p.claim]) is None:
                out.append(f"{where}: {p.claim} is not a claim the course judges any more")
                continue
            if p.verdict != now.verdict:
                out.append(f"{where}: {p.claim} verdict printed {p.verdict!r}, the published results give "
                           f"{now.verdict!r}")
            elif p.evidence != now.evidence:
                out.append(f"{where}: {p.claim} verdict {p.verdict!r} agrees, its figures do not: printed "
                           f"{_first_difference(p.evidence, now.evidence)}")
    return out


def _first_difference(printed: str, now: str, context: int = 40) -> str:
    """Where two evidence strings first part: `...printed...` against `...now...`, a little context each side."""
    i = next((k for k, (a, b) in enumerate(zip(printed, now)) if a != b), min(len(printed), len(now)))
    start = max(0, i - context)
    return f"...{printed[start:i + context]!r}... where the published results give ...{now[start:i + context]!r}..."


# a figure as printed: 13,252 / 0.618 / ±0.6% / +2.6% / 3.04x; not the digits of a word (H200, b4x2048, fp8)
FIGURE = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?![A-Za-wyz_\d])")
# where a result was read from, which replay mode says in its own words by design (no figure of the result's)
WHERE_FROM = re.compile(r": (?:replaying the published|no published result to replay|your measurement of|measured "
                        r".+ (?:on another|read from your results folder)|the published result of|reusing the result "
                        r"of|not saved \(replay mode)")


def _named(line: str, names: list[str]) -> tuple[str | None, str]:
    """The published result `line` starts with (a table row's first cell counts), and the rest of the line."""
    text = line.strip().lstrip("|").strip()
    for name in names:  # longest first: l4_lora_fp8 is not l4_lora_fp8_torchao
        if text.startswith(name) and not text[len(name):len(name) + 1].strip("_-").isalnum():
            return name, text[len(name):]
    return None, text


def _figures(text: str) -> list[str]:
    return FIGURE.findall(text)


def _shown(figure: str, printed: list[str]) -> bool:
    """Whether `figure` (as the replayed line prints it) is among `printed`, rounded as `figure` is."""
    number = lambda f: float(f.replace(",", ""))
    places = len(figure.partition(".")[2])
    return any(round(number(p), places) == round(number(figure), places) for p in printed)


def _published_alone(line: str) -> bool:
    """Whether `line` is a figure a cell prints from the published results alone, under a "published" label and
    naming no result (lesson 5's FP8 band, read from six results at once), which replay mode prints as a GPU
    run does; verdicts are left to `disagreements`, which reads them whole."""
    text = line.strip()
    return text.startswith("published") and bool(_figures(text)) and not VERDICT_LINE.match(text)


def figure_disagreements(committed, replayed, names: list[str], notebook: str = "",
                         held: list[str] | None = None) -> list[str]:
    """One line for each line of `replayed` (the notebook `committed` executed in replay mode) that starts with
    one of `names` (the published results) and whose figures the committed cell at the same index does not show
    on its own lines for that result: "cell index I: NAME: the code prints ... today; the committed cell does not
    show F for it", or that the committed cell shows no line for NAME at all. Each replayed line held against
    the committed cell is appended to `held`, where given."""
    names = sorted(names, key=len, reverse=True)
    out = []
    for i, (mine, now) in enumerate(zip(committed.cells, replayed.cells)):
        if mine.cell_type != "code":
            continue
        shown: dict[str, list[str]] = {}
        for line in "\n".join(_texts(mine)).split("\n"):
            name, rest = _named(line, names)
            if name and not WHERE_FROM.search(line):
                shown.setdefault(name, []).extend(_figures(rest))
        lines = {line.strip() for line in "\n".join(_texts(mine)).split("\n")}
        cell = f"{notebook + ', ' if notebook else ''}cell index {i}"
        for line in "\n".join(_texts(now)).split("\n"):
            name, rest = _named(line, names)
            if _published_alone(line):  # read from the published results alone: the committed cell shows it as is
                if held is not None:
                    held.append(line)
                if line.strip() not in lines:
                    out.append(f"{cell}: the code prints {line.strip()[:200]!r} today; the committed cell does not "
                               "show that line")
                continue
            if not name or WHERE_FROM.search(line):
                continue
            where = f"{cell}: {name}"
            if held is not None:
                held.append(line)
            if name not in shown:
                out.append(f"{where}: the code prints {line.strip()!r} today; the committed cell shows no line "
                           "for it (an output older than its cell)")
            elif missing := [f for f in _figures(rest) if not _shown(f, shown[name])]:
                out.append(f"{where}: the code prints {line.strip()!r} today; the committed cell does not show "
                           f"{', '.join(missing)} for it")
    return out


def replayed_disagreements(paths: list[Path] | None = None, held: dict[str, list[str]] | None = None) -> list[str]:
    """`figure_disagreements` of every lesson at `paths` (default: all), each replayed; a lesson whose replay
    fails is one line naming the cell. `held`, where given, gets each lesson's replayed lines held against it."""
    import nbclient

    from tunekit import results
    from tunekit_course import pages

    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")) if paths is None else paths
    names = list(results.by_name(NOTEBOOKS / "results"))
    out = []
    for path, now in pages.replay_all(paths).items():
        if isinstance(now, nbclient.exceptions.CellExecutionError):
            out.append(f"{path.name}: its replay fails: {str(now).strip().splitlines()[-1][:300]}")
            continue
        if isinstance(now, Exception):
            raise now
        lines = [] if held is None else held.setdefault(path.name, [])
        out += figure_disagreements(nbformat.read(path, as_version=4), now, names, path.name, lines)
    return out


def main(argv: list[str]) -> int:
    figures = argv[:1] == ["--figures"]
    paths = [Path(a) for a in argv[figures:]] or None
    held: dict[str, list[str]] = {}
    found = disagreements(paths) + (replayed_disagreements(paths, held) if figures else [])
    for name, lines in held.items():
        print(f"{name}: {len(lines)} replayed line(s) held against its committed outputs")
    for line in found:
        print(line)
    print(f"{len(found)} disagreement(s)" if found else f"every verdict {'and figure ' if figures else ''}the "
          "notebooks show agrees with the published results")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
