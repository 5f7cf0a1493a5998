"""Every relative link of README.md and docs/*.md points to a file of the
repository, and a link's ``#anchor`` to a heading of that file (GitHub's
heading slugs). Links inside fenced code blocks are not links."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(markdown: str) -> str:
    return re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", prose(path.read_text()), flags=re.M)}


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path.read_text())) if not re.match(r"[a-z]+:", t)]


def test_slugs_follow_github():
    assert slug("When pages may be reused: the write fence") == "when-pages-may-be-reused-the-write-fence"
    assert slug("CUDA pools: `send(..., ready=event)`") == "cuda-pools-send-readyevent"
    assert relative_links_of("[a](b.md) [c](https://x) `[d](e.md)`\n```\n[f](g.md)\n```\n") == ["b.md", "e.md"]


def relative_links_of(text: str) -> list[str]:
    return [t for t in LINK.findall(prose(text)) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.is_file() or REPO not in dest.parents:
            broken.append(f"{target} (no file {dest.relative_to(REPO) if REPO in dest.parents else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with anchor #{anchor} in {dest.relative_to(REPO)})")
    assert not broken, f"{page.relative_to(REPO)} has broken links: {broken}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO / t.partition("#")[0]).resolve() for t in relative_links(REPO / "README.md")}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md's documentation list does not link {missing}"
