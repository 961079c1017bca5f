"""A method refuses its settings with ``MethodConfigError``, from ``__init__`` or from
``setup`` (where it first sees the training settings): one ``medfl: error:`` line and no run
directory, under ``medfl run``, ``medfl.bundle.run`` and a bundle's ``python -m monai.bundle
run`` (issue 51, point 4: a refusal in ``setup`` left a run that ``medfl runs`` listed as
crashed). A plain ``ValueError`` from ``setup`` is a bug and keeps its traceback and its run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from medfl.bundle import USER_ERROR_EXIT
from medfl.cli import main
from medfl.runs import list_runs

from contract_methods import methods_registered
from refusing_method import LINES, Refusing, entry

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def refusing() -> Iterator[None]:
    """:class:`Refusing` registered for each test here."""
    with methods_registered(Refusing, name="refusing-test"):
        yield


def _config(tmp_path: Path, tiny_fl: dict[str, Any], *methods: dict[str, Any]) -> Path:
    """A bundle config of ``tiny_fl`` (one round) with ``methods``, written to ``tmp_path``."""
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"fl": {**tiny_fl, "rounds": 1, "methods": list(methods)}}))
    return path


def _errors(err: str) -> list[str]:
    """The lines of ``err`` that report a failure (an error line, a traceback)."""
    return [ln for ln in err.splitlines() if "error" in ln.lower() or "Traceback" in ln]


def test_medfl_run_refusal_is_one_line_and_leaves_no_run(tmp_path: Path, tiny_fl: dict[str, Any],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """From ``__init__`` (as before) and from ``setup`` alike."""
    for where in ("init", "setup"):
        assert main(["run", str(_config(tmp_path, tiny_fl, entry(where)))]) == USER_ERROR_EXIT
        assert _errors(capsys.readouterr().err) == [LINES[where]], where
        assert not Path(tiny_fl["output_dir"]).exists(), (where, sorted(Path(tiny_fl["output_dir"]).rglob("*")))


def test_bundle_run_refusal_is_one_line_and_leaves_no_run(tiny_fl: dict[str, Any],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``medfl.bundle.run``, the ``run`` expression of every bundle's ``train.json``."""
    from medfl.bundle import run

    for where in ("init", "setup"):
        with pytest.raises(SystemExit) as stop:
            run({**tiny_fl, "rounds": 1, "methods": [entry(where)]})
        assert stop.value.code == USER_ERROR_EXIT
        assert _errors(capsys.readouterr().err) == [LINES[where]], where
        assert not Path(tiny_fl["output_dir"]).exists(), where


def test_a_refusal_removes_only_its_own_run(tmp_path: Path, tiny_fl: dict[str, Any],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """In an experiment whose first method ran, the second's refusal in ``setup`` removes its
    own directory only; a plain ``ValueError`` there is a bug: its traceback, and its run kept
    for a look (listed as crashed)."""
    cfg = _config(tmp_path, tiny_fl, {"name": "fedavg"}, entry("setup"))
    assert main(["run", str(cfg)]) == USER_ERROR_EXIT
    assert _errors(capsys.readouterr().err) == [LINES["setup"]]
    exp = Path(tiny_fl["output_dir"]) / "t"
    assert (exp / "fedavg" / "summary.json").is_file() and not (exp / "refusing").exists()
    assert [row["method"] for row in list_runs(tiny_fl["output_dir"])] == ["fedavg"]

    with pytest.raises(ValueError, match="a bug in setup"):
        main(["run", str(_config(tmp_path, tiny_fl, entry("bug")))])
    rows = list_runs(tiny_fl["output_dir"])
    assert [(r["method"], r["status"].split(" ")[0]) for r in rows] == [("fedavg", "finished"), ("refusing", "crashed")]


def test_monai_bundle_run_refusal_in_setup_is_one_line(tmp_path: Path, tiny_fl: dict[str, Any], run_bundle,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m monai.bundle run`` of a bundle whose method refuses in ``setup``: the last
    line is medfl's, nothing is left in the bundle's ``runs/``."""
    (tmp_path / "refusing_plugin.py").write_text(
        "import sys\nfrom medfl import hookimpl\nfrom medfl.plugins import get_plugin_manager\n"
        "from refusing_method import Refusing\n\n\n@hookimpl\ndef register_methods(register):\n"
        "    register(Refusing)\n\n\nget_plugin_manager().register(sys.modules[__name__], name='refusing-test')\n")
    fl = {**tiny_fl, "rounds": 1, "output_dir": "@output_dir", "methods": [entry("setup")]}
    config = tmp_path / "train.json"
    config.write_text(json.dumps({
        "imports": ["$import medfl", "$import medfl.bundle", "$import refusing_plugin"],
        "bundle_root": str(tmp_path), "output_dir": "$@bundle_root + '/runs'", "fl": fl,
        "run": "$medfl.bundle.run(@fl)"}))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{TESTS}:{':'.join(sys.path[1:])}")
    proc = run_bundle(config, "--bundle_root", tmp_path, check=False, timeout=240)
    assert proc.returncode == USER_ERROR_EXIT, proc.stderr[-3000:]
    assert _errors(proc.stderr) == [LINES["setup"]], proc.stderr[-3000:]
    assert not (tmp_path / "runs").exists()
