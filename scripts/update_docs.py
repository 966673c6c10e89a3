"""Regenerates the config reference in docs/config.md from the config field docstrings
(`make docs`)."""

from __future__ import annotations

import re
from pathlib import Path

from asyncrl.config.keys import reference_markdown

CONFIG_DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def main() -> None:
    text = CONFIG_DOC.read_text()
    block = f"<!-- config-reference -->\n{reference_markdown()}\n<!-- /config-reference -->"
    new, count = re.subn(
        r"<!-- config-reference -->.*?<!-- /config-reference -->", lambda _: block, text, flags=re.S
    )
    if count != 1:
        raise SystemExit("docs/config.md: config-reference markers not found")
    CONFIG_DOC.write_text(new)
    print(f"docs/config.md: {'config reference updated' if new != text else 'up to date'}")


if __name__ == "__main__":
    main()
