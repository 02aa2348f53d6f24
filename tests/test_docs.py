"""The README and the pages under docs/: every relative link resolves (anchors included), every Python example
runs as shown, and the README stays a front door."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README = PAGES[0].read_text()
BLOCKS = [(page, code) for page in PAGES for code in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_the_readme_links_to_the_pages():
    assert len(PAGES) > 10 and len(relative_links(PAGES[0])) >= 10


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.relative_to(ROOT)}: {target} points at a missing file"
        if anchor:
            assert dest.suffix == ".md" and anchor in anchors(dest), f"{page.relative_to(ROOT)}: no anchor {target}"


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = set(), [PAGES[0]]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md":
            continue
        seen.add(page)
        todo += [(page.parent / t.partition("#")[0]).resolve() for t in relative_links(page) if t.partition("#")[0]]
    assert set(PAGES) <= seen, sorted(str(p.relative_to(ROOT)) for p in set(PAGES) - seen)


def test_the_readme_is_a_front_door():
    assert len(README.splitlines()) <= 300
    fences = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    assert any("pytest -q" in f for f in fences) and "pytest -q -m slow" in README


def test_the_pages_have_examples():
    assert sum(page == PAGES[0] for page, _ in BLOCKS) >= 2


@pytest.mark.parametrize(
    ("page", "code"), BLOCKS, ids=[f"{p.relative_to(ROOT)}:{i}" for i, (p, _) in enumerate(BLOCKS)]
)
def test_example_runs(page, code):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    for expected in re.findall(r"print\(.*\)\s+# (\S+)", code):  # "# 32768 bytes" -> the output shows 32768
        assert expected.split()[0].rstrip(":") in result.stdout, (expected, result.stdout)


def test_the_readme_rl_table_is_the_benchmarks_result():
    """Each cell of the README's GRPO table is ``benchmarks/rl.py``'s iteration (results/rl.json), or says it
    does not fit."""
    import json

    rows = json.loads((ROOT / "benchmarks" / "results" / "rl.json").read_text())["rows"]
    best: dict[tuple[str, str, str], float | None] = {}
    for r in rows:  # the search's layout per model, machine and placement: the first row of each
        best.setdefault((r["model"], r["machine"], r["placement"]), r.get("iteration_s"))
    table = re.search(r"\| model \| placement \|(.*?)\n\n", README, flags=re.S).group(0)
    machines = re.findall(r"`([^`]+)`", table.splitlines()[0])
    cells = [line.strip("|").split("|") for line in table.splitlines()[2:] if line]
    assert len(cells) == 4 and machines
    for model, placement, *figures in cells:
        for machine, cell in zip(machines, figures, strict=True):
            want = best[(model.strip(), machine, placement.strip())]
            shown = cell.strip().strip("*")
            assert shown == ("does not fit" if want is None else f"{want:.0f}"), (model, machine, placement)
