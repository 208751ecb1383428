"""Whether the committed notebooks say what the published results say: every verdict a notebook printed (a line
`[yours, GPU: | published, GPU: ]CLAIM verdict: VERDICT — EVIDENCE`, and each row of a claims table it
displayed) against the verdict `claims.judge` gives today from `notebooks/results/`, the files the README's
tables are generated from. A notebook executed before its results were re-measured or its judging code changed
shows an older verdict or older figures; this finds it, line by line, so the two cannot drift apart unseen.

    python -m tunekit_course.agreement [NOTEBOOK...]     each disagreement, one a line; exit code 1 if any
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


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or None
    found = disagreements(paths)
    for line in found:
        print(line)
    print(f"{len(found)} disagreement(s)" if found else "every verdict the notebooks show agrees with the published "
          "results")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
