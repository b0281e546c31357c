"""The README and docs/*.md: every relative link points to a file that exists, and to a
heading of it where the link names one (GitHub's anchors); the README stays at most 200
lines and every page of docs/ at most 600, so that moved tables are found by a link,
not by scrolling."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_LINES = {ROOT / "README.md": 200}  # every other page: 600

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without fenced blocks (shell and Python) and code spans."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: its rendered text, lower case, punctuation other than
    hyphens and underscores dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(_prose(page.read_text()))
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:
    ]


def test_the_link_and_anchor_checks_catch_what_they_should(tmp_path):
    page = tmp_path / "a.md"
    page.write_text(
        "# A page\n\n## Step time on a `rate-limited` link (DDP)\n\n## Twice\n\n## Twice\n\n"
        "[ok](b.md#x) [code](`no`) `[no](c.md)` [web](https://x.org/y.md) ![img](p.png)\n"
        "```\n[no](d.md)\n# not a heading\n```\n"
    )  # fmt: skip
    assert links(page) == ["b.md#x", "p.png"]
    assert anchors(page) == {
        "a-page", "step-time-on-a-rate-limited-link-ddp", "twice", "twice-1",
    }  # fmt: skip


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file_and_heading_that_exist(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert broken == [], f"{page.relative_to(ROOT)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_stay_short(page):
    limit = MAX_LINES.get(page, 600)
    lines = len(page.read_text().splitlines())
    assert lines <= limit, f"{page.relative_to(ROOT)}: {lines} lines, at most {limit}"


def test_the_readme_links_every_benchmark_page():
    """The tables that left the README are one link away from it."""
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    pages = {p.resolve() for p in (ROOT / "docs").glob("benchmarks*.md")}
    pages.add((ROOT / "docs" / "usage.md").resolve())
    assert pages - linked == set()
