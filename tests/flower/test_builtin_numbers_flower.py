"""Every built-in method gives its recorded numbers over Flower (issue 65).

Each method's job of ``tests/engine/test_builtin_numbers.py`` runs on the ``flower`` backend
over a Flower grid in this process (:class:`flower_grid.LoopGrid`: Flower's own ``Message``
objects, medfl's :class:`~medfl.flower.transport.FlowerTransport`, packing and the
ClientApp's :func:`~medfl.flower.proxy.answer_with`, every content through Flower's protobuf
and back), three sites with their own state; its ``metrics.csv`` and ``train_metrics.csv``
must hold the numbers ``builtin_numbers.json`` records for the run in one process.
``centralized`` pools every client's data, so it has no Flower run (it is refused there).
Real Flower processes run some of these jobs in test_flower.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from medfl.config import resolve_config  # noqa: E402
from medfl.engine.remote import RemoteSettings  # noqa: E402
from medfl.flower.server import run_flower_experiment  # noqa: E402
from medfl.site import REPRODUCIBLE_NOISE_ENV, Site, SiteSettings  # noqa: E402

from flower_cases import write_config  # noqa: E402
from flower_grid import LoopGrid  # noqa: E402
from test_builtin_numbers import REMOTE, assert_recorded, job_config, metrics_files  # noqa: E402

#: generous waits: a grid in this process answers when it is pulled
SETTINGS = RemoteSettings(round_timeout=600.0, connect_timeout=60.0, hello_timeout=60.0, poll_interval=0.01)


@pytest.mark.parametrize("method", REMOTE)
def test_builtin_method_over_flower_gives_its_recorded_numbers(method: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPRODUCIBLE_NOISE_ENV, "1")   # the sites draw privacy noise from the run seed, as in process
    fl = job_config(method, tmp_path)
    config = write_config(tmp_path / "site.json", fl)
    sites = {101 + i: Site(SiteSettings(client_id=str(i), config=config, state_dir=tmp_path / f"site{i}"))
             for i in range(fl["num_clients"])}
    out = run_flower_experiment(resolve_config(fl), LoopGrid(sites), SETTINGS)
    run_dir = Path(out["dir"]) / method
    assert not list((run_dir / "clients").rglob("state_r*.pt")), "client state at the coordinator"
    assert_recorded(method, metrics_files(run_dir))
