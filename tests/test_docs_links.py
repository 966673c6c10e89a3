"""The README and docs/*.md: every relative link resolves to a file, and the README stays short.

Pure file reads (no process, milliseconds), so it runs in `make test-fast`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 15_000

# [text](target) and ![alt](target); the target ends at whitespace or ")" (an optional
# "title" after it is ignored). Inline code spans are removed first: `[x](y)` in code is not a link.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
EXTERNAL = ("http://", "https://", "mailto:")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(text: str) -> list[str]:
    """The link targets of `text` that name a file of this repository, #fragment stripped:
    external links (http, https, mailto) and pure #anchors are left out."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    found = []
    for target in LINK.findall(text):
        if target.startswith(EXTERNAL) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if path:
            found.append(path)
    return found


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """The relative links of the file at `path` (or of `text`, as if it were that file) that do
    not resolve to an existing file, relative to the file's own directory."""
    text = path.read_text() if text is None else text
    return [t for t in relative_links(text) if not (path.parent / t).is_file()]


def test_the_link_extractor_finds_links_and_a_broken_one():
    """Negative control: the check below cannot pass by finding nothing."""
    text = (
        "See [the guide](docs/checkpoint.md#resume), ![plot](docs/img/missing.png),\n"
        "[web](https://example.com), [mail](mailto:a@b.c), [here](#anchor), `[code](no.md)`,\n"
        "and [gone](docs/no_such_page.md).\n```\n[fenced](fenced.md)\n```\n"
    )
    assert relative_links(text) == [
        "docs/checkpoint.md",
        "docs/img/missing.png",
        "docs/no_such_page.md",
    ]
    assert broken_links(ROOT / "README.md", text) == [
        "docs/img/missing.png",
        "docs/no_such_page.md",
    ]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file(path):
    assert relative_links(path.read_text()) or path.name != "README.md"  # the README has links
    assert broken_links(path) == [], f"{path.relative_to(ROOT)}: links to missing files"


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / t).resolve() for t in relative_links((ROOT / "README.md").read_text())}
    missing = [p.name for p in markdown_files()[1:] if p.resolve() not in linked]
    assert missing == [], f"README.md's docs index lacks {missing}"


def test_the_readme_is_at_most_15000_bytes():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail into docs/"
