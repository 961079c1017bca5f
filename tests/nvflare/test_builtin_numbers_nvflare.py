"""Every built-in method gives its recorded numbers over NVIDIA FLARE's transport (issue 65).

Each method's job of ``tests/engine/test_builtin_numbers.py`` runs on the ``nvflare`` backend
over medfl's :class:`~medfl.nvflare.transport.NVFlareTransport` (NVFlare's ``Task`` and
``Shareable`` carrying the content's bytes) and medfl's real executor
(:class:`~medfl.nvflare.executor.MedflExecutor`, one NVFlare client per site), with a
controller in this process that hands each task to the executor at once (:class:`LoopController`);
its ``metrics.csv`` and ``train_metrics.csv`` must hold the numbers ``builtin_numbers.json``
records for the run in one process. NVFlare's own simulator (its server, clients and task
exchange) runs five of these jobs in test_nvflare.py. ``centralized`` pools every client's
data, so it has no NVFlare run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("nvflare", reason="NVIDIA FLARE is medfl's optional extra: pip install -e '.[nvflare]'")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from nvflare.apis.signal import Signal  # noqa: E402

from medfl.config import resolve_config  # noqa: E402
from medfl.engine.remote import RemoteSettings  # noqa: E402
from medfl.experiment import run_experiment  # noqa: E402
from medfl.site import REPRODUCIBLE_NOISE_ENV  # noqa: E402
from medfl.nvflare.executor import MedflExecutor  # noqa: E402
from medfl.nvflare.transport import NVFlareTransport  # noqa: E402
from medfl.plugins import lookup  # noqa: E402

from test_builtin_numbers import REMOTE, assert_recorded, job_config, metrics_files  # noqa: E402


class _Client:
    """What the executor reads of NVFlare's ``FLContext``: the client's name and its workspace."""

    def __init__(self, name: str, root: Path) -> None:
        self.name, self.root = name, root

    def get_identity_name(self) -> str:
        return self.name

    def get_engine(self) -> "_Client":
        return self

    def get_workspace(self) -> "_Client":
        return self

    def get_root_dir(self) -> str:
        return str(self.root)


class LoopController:
    """A controller whose ``send`` runs the task at its client's executor at once and hands the
    result to the task's callback, as NVFlare's controller does when the result comes back."""

    def __init__(self, executor: MedflExecutor, work: Path) -> None:
        self.executor, self.work = executor, work

    def send(self, task: Any, fl_ctx: Any, targets: list[str]) -> None:
        (name,) = targets
        result = self.executor.execute(task.name, task.data, _Client(name, self.work / name), Signal())
        task.result_received_cb(SimpleNamespace(task=task, client=SimpleNamespace(name=name), result=result), fl_ctx)


@pytest.mark.parametrize("method", REMOTE)
def test_builtin_method_over_nvflare_gives_its_recorded_numbers(method: str, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPRODUCIBLE_NOISE_ENV, "1")   # the sites draw privacy noise from the run seed, as in process
    fl = job_config(method, tmp_path)
    names = {f"site-{i + 1}": str(i) for i in range(fl["num_clients"])}
    executor = MedflExecutor(bundle={"fl": fl}, client_ids=names)
    transport = NVFlareTransport(LoopController(executor, tmp_path), None, clients=lambda: sorted(names))
    settings = RemoteSettings(round_timeout=600.0, connect_timeout=60.0, hello_timeout=60.0, poll_interval=0.01)
    out = run_experiment(resolve_config(fl), backend=lookup("backend", "nvflare")(transport, settings))
    run_dir = Path(out["dir"]) / method
    assert not list((run_dir / "clients").rglob("state_r*.pt")), "client state at the coordinator"
    for name in names:
        assert list((tmp_path / name / "medfl_state").rglob("session.json")), f"{name} kept no state"
    assert_recorded(method, metrics_files(run_dir))
