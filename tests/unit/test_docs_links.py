"""Every relative link in the README, BENCHMARKS and docs/ points at a file of this repository (and a heading of it,
when it names one), and no text cites a design document the repository does not contain."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"(?m)^#+ (.+)$", page.read_text())}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+://|^mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def test_no_citations_of_documents_outside_the_repository():
    pattern = re.compile(r"\.\./shared|\b(DESIGN|ALGORITHMS|TRAPS|USERS|STYLE)(\.md| §)")
    offenders = []
    for path in [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("astratk/**/*.py"), *ROOT.glob("envs/**/*.py"),
                 *ROOT.glob("losses/*.py"), *ROOT.glob("tutorials/*"), *ROOT.glob("bench/*.py")]:
        if path.is_file() and pattern.search(path.read_text(errors="replace")):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders
