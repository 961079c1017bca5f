"""CHANGELOG.md's layout: release headings (dated, or the next one marked unreleased), each
beginning with its migration section."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

CHANGELOG = Path(__file__).resolve().parents[1] / "CHANGELOG.md"
HEADING = re.compile(r"^## (?P<version>\d+\.\d+\.\d+\S*) (\(unreleased\)|- (?P<date>\d{4}-\d{2}-\d{2}))$")


def _releases(text: str) -> list[tuple[str, list[str]]]:
    """``(heading, its lines)`` for every ``## `` heading."""
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("## "):
            out.append((line, []))
        elif out:
            out[-1][1].append(line)
    return out


def test_release_headings_are_dated_and_open_with_their_migration_section():
    releases = _releases(CHANGELOG.read_text())
    assert releases, "CHANGELOG.md has no release heading"
    unreleased = [k for k, (h, _) in enumerate(releases) if h.endswith("(unreleased)")]
    assert unreleased in ([], [0]), "at most one release is unreleased, and it comes first"
    dates = []
    for heading, lines in releases:
        m = HEADING.match(heading)
        assert m, f"{heading!r}: expected '## <version> - <YYYY-MM-DD>' or '## <version> (unreleased)'"
        if m.group("date"):
            dates.append(dt.date.fromisoformat(m.group("date")))
        sections = [line for line in lines if line.startswith("### ")]
        assert sections and sections[0] == "### Breaking changes / migration", (
            f"{heading}: its first section must be '### Breaking changes / migration', got {sections[:1]}")
        body = "\n".join(lines).split("### Breaking changes / migration", 1)[1].split("\n### ", 1)[0]
        assert body.strip(), f"{heading}: an empty migration section (write 'none')"
    assert dates == sorted(dates, reverse=True), "releases are listed newest first"
