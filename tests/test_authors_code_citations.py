"""Every preset value labelled ``authors_code`` cites a file and line(s) of the authors' code.

A value said to come from the authors' code must name the file it was read in (a path with an
extension: ``.py``, ``.toml``, ``.json``, ...) and where in it (``line N`` or ``lines N-M``), so
that anyone can re-read it; a citation marked "not re-read" has not been checked against the
code and must be re-read (or relabelled ``reading:``/``open:``) before it ships.
"""

from __future__ import annotations

import re

import pytest

from medfl.method import Preset
from medfl.plugins import registry

#: a file path with an extension (``config/fedkper.json``, ``pyproject.toml``, ``server_app.py``)
FILE = re.compile(r"[\w./-]*\w\.(?:py|toml|json|ya?ml|cfg|ini|txt|md|sh|ipynb)\b")
#: a line reference: ``line 30``, ``lines 72-75``, ``lines 16 and 26``
LINE = re.compile(r"\blines? \d+(?:\s*[-\u2013]\s*\d+)?\b")


def _builtin_presets() -> list[tuple[str, str, Preset]]:
    """(method, preset name, preset) of every registered (built-in) method's presets."""
    return [(name, pname, preset) for name, r in sorted(registry()["method"].items())
            for pname, preset in sorted((getattr(r.obj, "presets", None) or {}).items())]


def _authors_code_citations() -> list[tuple[str, str, str, str]]:
    """(method, preset, key, citation) of every value whose source is ``authors_code``."""
    found = []
    for method, pname, preset in _builtin_presets():
        for key in preset.entries():
            source = preset.source_of(key)
            if source is not None and source[0] == "authors_code":
                found.append((method, pname, key, source[1]))
    return found


_CITATIONS = _authors_code_citations()


def test_the_check_covers_the_methods_that_cite_their_authors_code() -> None:
    methods = {m for m, _, _, _ in _CITATIONS}
    assert {"fedsdc", "fedkper"} <= methods
    # the presets named after the authors' code cite it for most of their values
    assert sum(1 for m, p, _, _ in _CITATIONS if (m, p) == ("fedsdc", "authors")) >= 15
    assert sum(1 for m, p, _, _ in _CITATIONS if (m, p) == ("fedkper", "authors")) >= 10


def test_the_patterns_accept_citations_and_reject_vague_ones() -> None:
    good = ["o/r (commit abc1234), pyproject.toml, line 83 (x = 0.2)",
            "o/r, algorithms/fedkper/Server.py, lines 72-75 (...)",
            "o/r, algorithms/fedkper/loss.py, lines 16 and 26 (...)",
            "o/r, config/fedkper.json, line 7"]
    for text in good:
        assert FILE.search(text) and LINE.search(text), text
    assert not LINE.search("o/r, client1.py, FlowerClient.fit: Quantization(num_bits=12)")
    assert not FILE.search("o/r, the v1.7 server's fixed teacher weights, line 3")
    assert not LINE.search("o/r, x.py, inline 3")


@pytest.mark.parametrize("method,preset,key,citation", _CITATIONS,
                         ids=[f"{m}-{p}-{k}" for m, p, k, _ in _CITATIONS])
def test_every_authors_code_value_cites_a_file_and_line(method: str, preset: str, key: str,
                                                        citation: str) -> None:
    where = f"{method} preset {preset!r}, {key}: authors_code: {citation}"
    assert FILE.search(citation), f"{where}\n  names no file of the authors' code (path.ext)"
    assert LINE.search(citation), f"{where}\n  names no line ('line N' or 'lines N-M')"
    assert "not re-read" not in citation.lower(), f"{where}\n  was not re-read against the authors' code"
