"""The README and docs/ say what is true: short enough to read, every link lands, and the main
job's output shown in the README is what the code prints.

Words are counted as a person reading the page would count them: every whitespace-separated
token of prose and code that holds a letter or a digit. A link's target (`](docs/x.md)`) is
not read, so it is not counted; table rules (`|---|`), box-drawing lines and lone symbols are
not words.

The main job's output is checked two ways. A fast test checks the block against itself and
the suite file (its counts add up, its gaps are where its record numbers say, the probes it
names are the suite's). A slow test runs the documented command, as the README shows it, and
compares what does not depend on timing: the planned line, each shown record's name and
status, each shown row of the results table but its measured figures, each row of the table
of records to look at (its numbers masked: they are this CPU's rounding), the phases of the
time line and the final counts. Running the command is the only way to know the block is what
the code prints; from a cold ground-truth cache it took 41-60 s on 2 shared cores, so it is
marked slow.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package (a diag dependency there)
    import tomli as tomllib

from conftest import REPO_ROOT, diag_script

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
MAX_WORDS = 1500
MAIN_JOB = "diag run --suite matmul"
# The width the README's block was produced at (a terminal of 100 columns).
COLUMNS = "100"


# --- words --------------------------------------------------------------------------------------

def words(markdown: str) -> int:
    """Words of prose and code a reader sees: tokens with a letter or digit, link targets out."""
    text = re.sub(r"\]\([^)\s]*\)", "]", markdown)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    return sum(1 for token in text.split() if re.search(r"[^\W_]", token))


def test_the_word_counter_counts_what_a_reader_reads():
    text = """# Title here

| a | b |
|---|---|
| `diag run` | [the docs](docs/a-long/path.md#anchor) |

```
┏━━━━┳━━━┓
$ diag run --suite x   # two-3 words
```
"""
    # "Title here" 2, "a b" 2, "`diag run` [the docs]" 4 (the link's target is not read), the
    # box-drawing line 0, "diag run --suite x two-3 words" 6 ("$" and "#" are not words).
    assert words(text) == 2 + 2 + 4 + 6


def test_the_readme_is_at_most_1500_words():
    n = words(README.read_text())
    assert n <= MAX_WORDS, f"README.md has {n} words (at most {MAX_WORDS}); move detail to docs/"


# --- links --------------------------------------------------------------------------------------

def _outside_code(markdown: str) -> str:
    """The text with fenced code blocks and inline code blanked (links there are not links)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", markdown, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "``", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces
    to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", path.read_text(), flags=re.S | re.M)
    for line in text.splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", _outside_code(path.read_text()))


def test_slug_is_githubs():
    # Computed by hand from GitHub's rule, independently of slug().
    assert slug("Exit codes (stable)") == "exit-codes-stable"
    assert slug("The main job and the CI suite (`bench_suite.py`)") == (
        "the-main-job-and-the-ci-suite-bench_suitepy")
    assert slug("Sampling: softmax, top-k, approx_max_k, greedy tokens") == (
        "sampling-softmax-top-k-approx_max_k-greedy-tokens")


def test_anchors_skip_code_blocks_and_number_repeats(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A\n\n```\n# not a heading\n```\n\n## A\n### B `c`\n")
    assert anchors(page) == {"a", "a-1", "b-c"}


PAGES = [README, DOCS / "README.md", *sorted(DOCS.glob("*.md")),
         REPO_ROOT / "benchmarks" / "README.md"]


@pytest.mark.parametrize("page", sorted(set(PAGES)), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto: (not checked offline)
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(REPO_ROOT)}: " + "; ".join(broken)


def test_docs_index_links_every_doc_on_one_line_each():
    index = DOCS / "README.md"
    listed: dict[str, int] = {}
    for line in index.read_text().splitlines():
        for target in re.findall(r"\]\(([^)#\s]+)\)", line):
            if line.lstrip().startswith("- ") and (DOCS / target).parent == DOCS:
                listed[target] = listed.get(target, 0) + 1
    docs = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert docs - set(listed) == set(), "docs/README.md does not list these pages"
    assert {d for d, n in listed.items() if n > 1} == set(), "a page listed twice"
    assert set(listed) - docs == set(), "docs/README.md lists pages that do not exist"


def test_the_readme_links_the_docs_index_and_the_benchmarks():
    targets = set(links(README))
    assert {"docs/README.md", "benchmarks/README.md"} <= targets


def test_the_readme_test_command_is_what_ci_runs():
    """.ci/run installs with the README's set-up command and runs its test command."""
    readme, ci = README.read_text(), (REPO_ROOT / ".ci" / "run").read_text()
    for command in ("pip install torch==2.13.0 -e '.[jax,torch,test]'", "python -m pytest -q"):
        assert command in readme
        assert re.search(rf"^{re.escape(command)}\s*$", ci.replace("pip install -q", "pip install"),
                         re.M), command


# --- the main job's output ----------------------------------------------------------------------

GAP = re.compile(r"^\[\.\.\. (\d+) lines?: .* \.\.\.\]$")
PROGRESS = re.compile(r"^diag run: \[(\d+)/(\d+)\] (.*): (\w+) \([\d.]+ s\)$")
PLANNED = re.compile(r"^diag run: (\d+) record\(s\) planned on backends: (.*)$")
COUNTS = re.compile(r"^diag: ((?:\d+ \w+(?:, )?)+); run folder: (\S+)$")
TIME = re.compile(r"^diag: time: (.*)$")


def readme_block() -> list[str | int]:
    """The README's main-job block: its lines, and the number of lines each gap leaves out."""
    text = README.read_text()
    m = re.search(rf"^```\n\$ {re.escape(MAIN_JOB)}\n(.*?)^```$", text, re.S | re.M)
    assert m, f"README.md shows no block starting `$ {MAIN_JOB}`"
    items: list[str | int] = []
    for line in m.group(1).splitlines():
        gap = GAP.match(line)
        items.append(int(gap.group(1)) if gap else line.rstrip())
    return items


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("│┃").split("│")]


def parse(items: list[str | int]) -> dict:
    """The stable facts of a main-job output: plan, progress, the two tables, time, counts.

    `items` are lines, or ints (a gap of that many lines, in the README's block); a line's
    position counts the gaps before it, so a shown line is compared with the actual line at
    the same position in its section.
    """
    out: dict = {"progress": {}, "results": [], "look": [], "gaps": 0}
    section, row = None, None
    pos = 0
    for item in items:
        if isinstance(item, int):
            out["gaps"] += item
            pos += item
            continue
        line = item.rstrip()
        if m := PLANNED.match(line):
            out["planned"] = (int(m.group(1)), m.group(2))
        elif m := PROGRESS.match(line):
            out["progress"][int(m.group(1))] = (m.group(3), m.group(4), pos)
        elif line.strip() == "diag: results":
            section, start = "results", pos
        elif "record(s) to look at" in line:
            section, start = "look", pos
            out["look_title"] = line.strip()
        elif m := TIME.match(line):
            out["time"] = {b.split(" ")[0]: re.findall(r"([a-z]+) [\d.]+", b.split("(", 1)[1])
                           for b in m.group(1).split("; ")}
        elif m := COUNTS.match(line):
            out["counts"] = dict((k, int(n)) for n, k in
                                 (c.split(" ") for c in m.group(1).split(", ")))
            out["run_folder"] = m.group(2)
        elif line.startswith("│") and section == "results":
            c = _cells(line)  # probe, backend, dtype, verdict, bound ratio, ULP, records
            out["results"].append((pos - start, c[0], c[1], c[2], c[3], c[6]))
        elif line.startswith("│") and section == "look":
            c = _cells(line)  # status, backend, probe, case, reason
            if c[0]:
                row = [pos - start, c[0], c[1], c[2], c[3], c[4]]
                out["look"].append(row)
            else:
                row[4] += " " + c[3]
                row[5] += " " + c[4]
        pos += 1
    for row in out["look"]:
        row[4] = " ".join(row[4].split())
        # The reason's numbers are this CPU's rounding; its wording and its structure are not.
        row[5] = re.sub(r"\d[\d.,e+-]*", "#", re.sub(r"\s+", "", row[5]))
    return out


def test_the_readme_block_adds_up():
    """Its record numbers run 1..N with the gaps where they fall, its counts sum to N, and the
    probes it names are the matmul suite's."""
    items = readme_block()
    got = parse(items)
    total, _ = got["planned"]
    numbers, shown = sorted(got["progress"]), got["progress"]
    assert numbers[-1] <= total
    # Between two shown records, the gap holds exactly the records in between.
    seen = 0
    for item in items:
        if isinstance(item, str) and (m := PROGRESS.match(item)):
            assert int(m.group(1)) == seen + 1, item
            seen += 1
        elif isinstance(item, int) and seen and seen < total:
            seen += item
    assert seen == total
    assert sum(got["counts"].values()) == total
    skips = [n for n, (_, status, _) in shown.items() if status == "skip"]
    assert got["look_title"].endswith(f"{got['counts']['skip']} backend(s) not run")
    assert skips and got["counts"]["skip"] >= len(skips)
    suite = tomllib.loads((REPO_ROOT / "probes" / "suites" / "matmul.toml").read_text())
    probes = {p["name"] for p in suite["probe"]}
    named = {label.split()[1].split(".")[1] for label, _, _ in shown.values()
             if label.split()[1].startswith("matmul.")}
    assert named and named <= probes
    assert {r[1] for r in got["results"]} <= probes
    warned = [n for n, (_, status, _) in shown.items() if status in ("warn", "fail")]
    assert len([r for r in got["look"] if r[1] in ("warn", "fail")]) == len(warned) == (
        got["counts"].get("warn", 0) + got["counts"].get("fail", 0))


def _arithmetic(run_folder: Path) -> dict[tuple[str, str, str], str]:
    import json

    meta = json.loads((run_folder / "run.json").read_text())
    return {(b, f["precision"], f["via"]): f["label"]
            for b, v in meta["backends"].items() for f in v.get("fingerprints", [])}


# The arithmetic the README's machine measured (docs/verified.md says so): torch-cpu's float32
# matmul under `medium` in bf16, everything else float32. The records that depend on it are the
# `precision=medium` ones; on a CPU that measures otherwise, diag's verdict must follow what it
# measured there instead of the README.
README_MEDIUM = "BF16_BF16_F32"


@pytest.mark.slow
def test_the_readme_block_is_what_the_main_job_prints(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIAG_PYTHON_")}
    env.update(COLUMNS=COLUMNS, PYTHONPATH=str(REPO_ROOT))
    cmd = MAIN_JOB.split()
    assert cmd[0] == "diag"
    proc = subprocess.run([diag_script(), *cmd[1:]], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (proc.stderr + proc.stdout).splitlines()
    got = parse(lines)
    want = parse(readme_block())
    if got["planned"] != want["planned"]:
        pytest.skip(f"this machine plans {got['planned']}; the README's is a CPU-only machine "
                    f"({want['planned']})")
    run_folder = tmp_path / got["run_folder"]
    medium = _arithmetic(run_folder).get(("torch-cpu", "medium", "config"))
    same_arithmetic = medium == README_MEDIUM

    def depends(label: str) -> bool:
        return not same_arithmetic and "precision=medium" in label

    # Every shown record: the same name and status at the same number.
    for n, (label, status, _) in want["progress"].items():
        assert n in got["progress"], f"record {n} ({label}) not printed"
        g_label, g_status, _ = got["progress"][n]
        assert g_label == label
        if depends(label):
            assert g_status == ("pass" if medium == "F32_F32_F32" else "warn"), (label, medium)
        else:
            assert g_status == status, (n, label)
    # Every shown row of the results table, at its row (its figures are this CPU's).
    got_rows = {r[0]: r[1:] for r in got["results"]}
    for pos, *row in want["results"]:
        assert pos in got_rows, f"results row {row} is not printed"
        if same_arithmetic or row[0] != "precision":
            assert got_rows[pos] == tuple(row)
        else:
            assert got_rows[pos][:3] == tuple(row[:3])
    assert max(got_rows) == want["results"][-1][0], "the table has another number of rows"
    # Records to look at, in order (the README leaves the skip rows out); one skip row per
    # backend not run.
    g_look = [tuple(r[1:]) for r in got["look"] if r[1] != "skip" and not depends(r[4])]
    w_look = [tuple(r[1:]) for r in want["look"] if r[1] != "skip" and not depends(r[4])]
    assert g_look == w_look
    measured = [r for r in got["look"] if r[1] != "skip" and "precision=medium" in r[4]]
    assert bool(measured) == (medium != "F32_F32_F32"), (medium, measured)
    skips = [r for r in got["look"] if r[1] == "skip"]
    assert len(skips) == got["counts"]["skip"] == want["counts"]["skip"]
    # Time: the same backends and phases; counts: the same, or the same total where the
    # arithmetic differs.
    assert got["time"] == want["time"]
    if same_arithmetic:
        assert got["counts"] == want["counts"]
    else:
        assert sum(got["counts"].values()) == sum(want["counts"].values())
    assert got["run_folder"].startswith("reports/") and run_folder.is_dir()
    assert (run_folder / "report.html").is_file()
