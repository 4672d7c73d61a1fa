"""The README introduces and docs/ holds the reference: every local link in them resolves
(the file, and the heading a ``#fragment`` names), and the README stays short."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LINES = 300

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """``text`` without its code blocks and inline code (links and headings there are code)."""
    return _CODE.sub("", _FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """The fragments GitHub gives the headings of a markdown page: lower case, punctuation
    dropped, spaces as hyphens, a repeated heading numbered from -1."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _FENCE.sub("", text).splitlines():
        heading = re.match(r"#{1,6} (.*)", line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def local_links(page: pathlib.Path) -> list[str]:
    return [target for target in _LINK.findall(_prose(page.read_text()))
            if not re.match(r"[a-z]+:", target)]


def test_anchors_follow_githubs_rule():
    text = '# A `b="c"` and "d"\n## A `b="c"` and "d"\n```\n# not a heading\n```\n'
    assert anchors(text) == {"a-bc-and-d", "a-bc-and-d-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_local_link_resolves(page):
    broken = []
    for target in local_links(page):
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT)}")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file.read_text()):
            broken.append(f"{target}: no heading #{fragment} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_page_in_docs_is_linked_from_the_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve()
              for target in local_links(ROOT / "README.md")}
    assert set(PAGES[1:]) <= linked, sorted(p.name for p in set(PAGES[1:]) - linked)


def test_readme_opens_with_the_two_commands_and_stays_short():
    text = (ROOT / "README.md").read_text()
    first_block = _FENCE.search(text).group(0)
    assert re.search(r"^make demo ", first_block, re.M)
    assert re.search(r"^make test ", first_block, re.M)
    assert text.count("\n") < README_LINES
