"""JSON-lines files a kill can tear: the one repair every appender of the run's records makes
before it appends (`train.records.JsonlLog`, the episodes' steps log), reading only the tail."""

from __future__ import annotations

import json
from pathlib import Path


def end_torn_line(path: Path) -> None:
    """Ends the file's unterminated last line, if any: a record torn by a kill mid-write is
    cut off (it never was one), a whole one gets its newline. No file, or an empty one:
    nothing to do."""
    if path.exists() and path.stat().st_size > 0 and not _ends_with_newline(path):
        _cut_or_end(path)


def _cut_or_end(path: Path) -> None:
    """`end_torn_line`'s repair, reading back from the end a block at a time."""
    with path.open("rb+") as f:
        end = f.seek(0, 2)
        start = end
        while start > 0:  # back to the last newline, a block at a time
            start = max(0, start - 65536)
            f.seek(start)
            cut = f.read(end - start).rfind(b"\n")
            if cut >= 0:
                start += cut + 1
                break
        f.seek(start)
        if is_torn(f.read(end - start)):
            f.truncate(start)
        else:
            f.seek(end)
            f.write(b"\n")


def is_torn(raw: bytes) -> bool:
    """A line that is the start of a JSON record cut short (what a kill mid-write leaves):
    it fails to decode only because its text ran out."""
    try:
        json.loads(raw)
    except json.JSONDecodeError as err:  # an open string reports where it began
        return err.pos >= len(raw.rstrip()) or err.msg.startswith("Unterminated string")
    except UnicodeDecodeError:  # a multi-byte character cut in two
        return True
    return False


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"
