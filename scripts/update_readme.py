"""Regenerates the README's config reference from the config field docstrings (`make docs`)."""

from __future__ import annotations

import re
from pathlib import Path

from asyncrl.config_keys import reference_markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def main() -> None:
    text = README.read_text()
    block = f"<!-- config-reference -->\n{reference_markdown()}\n<!-- /config-reference -->"
    new, count = re.subn(
        r"<!-- config-reference -->.*?<!-- /config-reference -->", lambda _: block, text, flags=re.S
    )
    if count != 1:
        raise SystemExit("README.md: config-reference markers not found")
    README.write_text(new)
    print("README.md: config reference updated" if new != text else "README.md: up to date")


if __name__ == "__main__":
    main()
