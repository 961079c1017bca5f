"""Every preset value cites its source (issue 48, item 3): ``Preset.source_of``,
``Preset.source_problems``, what ``config.json`` and ``medfl plugins NAME`` say of each value,
and that every built-in preset (and the example plugin's) cites one for each value."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from medfl.cli import main
from medfl.config import preset_counts, preset_origin, preset_record
from medfl.method import SOURCE_KINDS, Method, Preset, parse_source
from medfl.plugins import describe, registry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "medfl-plugin-example"

def _example_methods() -> list[type[Method]]:
    """The example plugin's method classes (examples/medfl-plugin-example, not installed here)."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        import medfl_median
    finally:
        sys.path.remove(str(EXAMPLE))
    return [obj for obj in vars(medfl_median).values()
            if isinstance(obj, type) and issubclass(obj, Method) and obj.__dict__.get("presets")]


def _all_presets() -> list[tuple[str, str, Preset]]:
    """(method, preset name, preset) of every registered method's presets and the example's."""
    found = [(name, pname, preset) for name, r in sorted(registry()["method"].items())
             for pname, preset in sorted((getattr(r.obj, "presets", None) or {}).items())]
    found += [(cls.name, pname, preset) for cls in _example_methods() for pname, preset in sorted(cls.presets.items())]
    return found


_PRESETS = _all_presets()


def test_the_check_covers_the_methods_with_presets() -> None:
    methods = {m for m, _, _ in _PRESETS}
    assert {"fedskd", "fedsdc", "fedkper", "pfedcdp", "fedtpf", "median_snapshots"} <= methods


@pytest.mark.parametrize("method,name,preset", _PRESETS, ids=[f"{m}-{p}" for m, p, _ in _PRESETS])
def test_every_preset_value_cites_its_source(method: str, name: str, preset: Preset) -> None:
    assert preset.source_problems() == [], f"{method} preset {name!r}"
    for key in preset.entries():
        kind, citation = preset.source_of(key)
        assert kind in SOURCE_KINDS and len(citation) > 10, (method, name, key)


def test_source_of_reads_kind_and_citation() -> None:
    p = Preset(source="s", values={"a": 1, "b": 2, "c": 3}, train={"lr": 0.1},
               sources={"a": "authors_code: org/repo, x.py, line 3", "b": "open: ours", "c": "paper: eq. 2",
                        "train.lr": "paper: Tab. 1"})
    assert p.source_of("a") == ("authors_code", "org/repo, x.py, line 3")
    assert p.source_of("b") == ("open", "ours")
    assert p.source_of("c") == ("paper", "eq. 2")
    assert p.source_of("train.lr") == ("paper", "Tab. 1")
    assert p.source_of("lr") is None and p.entries() == ["a", "b", "c", "train.lr"]
    assert p.source_problems() == []
    with pytest.raises(ValueError, match=r"sources\['x'\] must be '<kind>: <citation>'"):
        Preset(source="s", values={"x": 1}, sources={"x": "papr: eq. 2"}).source_of("x")


def test_source_problems_names_each_entry_without_a_valid_source() -> None:
    p = Preset(source="s", values={"ok": 1, "none": 2, "kind": 3, "empty": 4, "read": 5}, train={"lr": 0.1},
               sources={"ok": "open: medfl's choice", "kind": "papers: eq. 1", "empty": "paper:  ",
                        "read": "reading: 'x' as y", "stale": "paper: eq. 9", "train.lrr": "open: typo"})
    problems = p.source_problems()
    assert [q.split()[0].rstrip(":") for q in problems] == ["none", "kind", "empty", "read", "train.lr",
                                                           "sources['stale']", "sources['train.lrr']"]
    assert "no source" in problems[0] and "paper, authors_code, reading, open" in problems[0]
    assert "other reading" in problems[3]
    assert parse_source("reading: 'x'; other reading: y") == ("reading", "'x'; other reading: y")
    with pytest.raises(ValueError, match=r"where must be"):
        parse_source(3, "where")


class _Sourced(Method):
    """A method with one preset, for the config.json record (nothing runs)."""

    name = "test_sourced"
    presets = {"p": Preset(source="a paper", values={"a": 1, "b": 2, "c": 3, "d": 4}, train={"lr": 0.1, "epochs": 2},
                           sources={"a": "paper: eq. 1", "b": "authors_code: o/r, f.py, line 2",
                                    "c": "reading: 'about 3'; other reading: 4", "train.lr": "open: ours"})}

    def __init__(self, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> None:
        self.a, self.b, self.c, self.d = a, b, c, d


def test_config_json_records_kind_and_citation_of_each_value(monkeypatch: pytest.MonkeyPatch) -> None:
    import medfl.config.methods as methods

    monkeypatch.setattr(methods, "lookup", lambda kind, name: _Sourced)
    spec = {"name": "test_sourced", "preset": "p", "d": 5, "train": {"epochs": 1}}
    record = preset_record(spec, _Sourced(a=1, b=2, c=3, d=5))
    assert record["values"] == {"a": {"value": 1, "from": "paper", "source": "eq. 1"},
                                "b": {"value": 2, "from": "authors_code", "source": "o/r, f.py, line 2"},
                                "c": {"value": 3, "from": "reading", "source": "'about 3'; other reading: 4"},
                                "d": {"value": 5, "from": "config"}}
    assert record["train"] == {"epochs": {"value": 1, "from": "config"},
                               "lr": {"value": 0.1, "from": "open", "source": "ours"}}
    entries = [*record["values"].values(), *record["train"].values()]
    assert preset_counts(entries) == ("1 from the paper, 1 from the authors' code, 1 readings, 1 medfl's choices, "
                                      "2 from this config")
    # a value the preset cites no source for is said to be so, never "paper"
    assert preset_origin(_Sourced.presets["p"], "d", False) == {"from": "unstated",
                                                                "source": "the preset cites no source for d"}
    assert preset_counts([{"from": "unstated"}]).endswith(", 1 without a source")


def test_medfl_plugins_name_prints_every_value_with_its_source(capsys: pytest.CaptureFixture[str]) -> None:
    (d,) = describe("fedsdc")
    paper = d["presets"]["paper"]
    # issue 48: min_hidden 2048 is a reading of sec. 2.2 (ResNet-50's 2048 units), not a value
    min_hidden = paper["sources"]["min_hidden"]
    assert min_hidden["from"] == "reading" and "sec. 2.2" in min_hidden["source"]
    assert "ResNet50" in min_hidden["source"] and "other reading: rho x the body's own embedding" in min_hidden["source"]
    assert d["presets"]["authors"]["sources"]["min_hidden"]["from"] == "authors_code"
    assert set(paper["sources"]) == set(paper["values"]) | {f"train.{k}" for k in paper["train"]}
    assert main(["plugins", "fedsdc"]) == 0
    out = capsys.readouterr().out
    block = out.split("preset 'paper':")[1].split("  preset ")[0]
    for key in paper["sources"]:
        line = next(x for x in block.splitlines() if x.split() and x.split()[0] == key)
        assert paper["sources"][key]["from"] + ": " in line, line
    assert main(["plugins", "fedkper", "--json"]) == 0
    (kper,) = json.loads(capsys.readouterr().out)
    assert kper["presets"]["paper"]["sources"]["train.lr"] == {"from": "paper",
                                                               "source": "sec. 4.1 ('a SGD optimizer with eta = 0.01')"}
    assert kper["presets"]["paper"]["train"]["lr"] == 0.01
