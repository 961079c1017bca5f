"""``medfl flower run`` of a method that refuses its settings with ``MethodConfigError``,
from ``__init__`` (the coordinator reads the config) or from ``setup`` (the coordinator's run
starts): one ``medfl: error:`` line, exit 2 as ``medfl run``, no traceback in the ServerApp's
log and no run directory (issue 51, point 4).

The ServerApp (:func:`medfl.flower.server.main`) runs in this process over the loop-back transport
of ``test_coordinator.py``, standing in for ``flwr run``, which reports an exception of the
ServerApp as Flower does: its traceback in the run's log stream (``medfl flower run``'s
stdout). Before, both refusals ended with that traceback and ``medfl flower run: the run
failed: ...`` (exit 1), and a refusal in ``setup`` left a run ``medfl runs`` listed as crashed.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from medfl.cli import main  # noqa: E402

from contract_methods import methods_registered  # noqa: E402
from flower_cases import FEDAVG, fl_config, write_config  # noqa: E402
from refusing_method import LINES, Refusing, entry  # noqa: E402
from test_coordinator import LoopTransport, _sites  # noqa: E402


@pytest.fixture(autouse=True)
def refusing() -> Iterator[None]:
    """:class:`Refusing` registered for each test here (the sites run in this process too)."""
    with methods_registered(Refusing, name="refusing-test"):
        yield


@pytest.mark.parametrize("where", ["init", "setup"])
def test_flower_run_refusal_is_one_line_and_leaves_no_run(tmp_path: Path, where: str,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import medfl.flower.deploy as deploy
    from medfl.flower import server

    fl = fl_config(tmp_path, "refused", {**FEDAVG, "rounds": 1, "methods": [entry(where)]})
    config = write_config(tmp_path / "train.json", fl)
    ran: list[int] = []

    def flwr_run(app: Any, superlink: str, rc: dict[str, Any], **kw: Any) -> int:
        """The ServerApp on the loop-back transport; an exception of it is reported as Flower's
        ``run_serverapp`` does (its traceback in the streamed log) and ends the run."""
        ran.append(1)
        # the sites' own config (their data; the method comes from the coordinator)
        grid = LoopTransport(_sites(tmp_path, {**fl, "methods": [{"name": "fedavg"}]}))
        try:
            server.main(grid, SimpleNamespace(run_config=rc))
        except Exception:   # noqa: BLE001 - as Flower: "ServerApp raised an exception" and its traceback
            print("ServerApp raised an exception\n" + traceback.format_exc())
            return 1
        return 0

    monkeypatch.setattr(deploy, "flwr_run", flwr_run)
    monkeypatch.chdir(tmp_path)
    assert main(["flower", "run", str(config), "--insecure"]) == 2
    out, err = capsys.readouterr()
    assert ran == [1]
    assert "Traceback" not in out + err and "ServerApp raised" not in out, out[-3000:]
    assert [ln for ln in err.splitlines() if "error" in ln.lower() or "failed" in ln] == [LINES[where]], err
    assert not (tmp_path / "runs").exists(), sorted((tmp_path / "runs").rglob("*"))
