"""Built-in backends: ``inprocess``, ``ray``, ``flower`` and ``nvflare`` (see :mod:`medfl.backend`).

- ``inprocess`` (the default): every client in this process, one after another
  (:class:`medfl.engine.runner.Run`).
- ``ray``: the clients in parallel on Flower's simulation runtime, one Ray actor per
  simulated SuperNode (:mod:`medfl.flower.simulation`).
- ``flower``: the clients are SuperNodes at the sites, reached through a SuperLink by
  medfl's ServerApp (:mod:`medfl.flower.server`, started by ``medfl flower run``), which
  builds this backend with its grid.
- ``nvflare``: the clients are NVIDIA FLARE clients at the sites, reached by medfl's
  controller workflow (:mod:`medfl.nvflare.controller`, in a job ``medfl nvflare job`` writes),
  which builds this backend with its transport.

Flower's and NVFlare's modules are imported when a backend runs, not when the plugin loads.
"""

from __future__ import annotations

import shlex
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from medfl import hookimpl
from medfl.backend import Backend, Runs, recorded_backend
from medfl.config import check_device
from medfl.engine.runner import Run, RunError

__all__ = ["InProcess", "Ray", "Flower", "NVFlare", "register_backends"]


class InProcess(Backend):
    """Every client in this process, one after another; state on disk."""

    name = "inprocess"
    description = "every client in this process, one after another (the default)"

    @contextmanager
    def runs(self, cfg: dict[str, Any], path: Path | None = None) -> Iterator[Runs]:
        """The experiment's runs are :class:`Run`; a new experiment trains on this machine,
        so it must have the device."""
        if path is None:
            check_device(cfg["device"], available=True)
        yield Run, None


class Ray(InProcess):
    """The clients in parallel on Flower's simulation runtime (Ray actors on this machine)."""

    name = "ray"
    description = "the clients in parallel on Flower's simulation runtime (needs Ray: medfl[simulation])"

    @contextmanager
    def runs(self, cfg: dict[str, Any], path: Path | None = None) -> Iterator[Runs]:
        """:func:`medfl.flower.simulation.simulated_runs`: the runs of a simulation runtime that
        lives as long as the ``with`` (a stopped simulated run continues there too); a new
        experiment needs the device, as in process."""
        from medfl.flower.simulation import simulated_runs

        with super().runs(cfg, path), simulated_runs(cfg) as factory:
            yield factory, {"engine": "simulation"}


class Flower(Backend):
    """The clients are SuperNodes at the sites, reached over ``grid`` (a SuperLink's).

    Args:
        grid: the ServerApp's grid, or a :class:`medfl.transport.Transport` standing in for it
            (tests: sites in this process); ``None`` (as the registry builds it): there is no
            SuperLink here, and running says how to start one.
        settings: the coordinator's :class:`medfl.engine.remote_sites.RemoteSettings`.
    """

    name = "flower"
    #: what ``config.json`` says under ``"engine"``
    engine = "flower"
    description = "the clients are Flower SuperNodes at the sites (medfl flower run)"
    #: what running without a grid says
    missing = ("fl.backend 'flower': the clients are Flower SuperNodes reached through a SuperLink; run the config "
               "with `medfl flower run CONFIG` (docs/flower.md), not `medfl run`")

    def __init__(self, grid: Any = None, settings: Any = None) -> None:
        self.grid = grid
        self.settings = settings

    def _factory(self) -> Any:
        """:class:`~medfl.engine.remote.RemoteRun` on the transport (for a Flower grid, a
        :class:`~medfl.flower.transport.FlowerTransport` per run, which records its retries).

        Raises:
            RunError: no grid (:attr:`missing`).
        """
        if self.grid is None:
            raise RunError(self.missing)
        from medfl.engine.remote import RemoteSettings, remote_run_factory
        from medfl.transport import Transport

        settings = self.settings or RemoteSettings()
        if isinstance(self.grid, Transport):
            return remote_run_factory(self.grid, settings)
        from medfl.flower.transport import FlowerTransport

        return remote_run_factory(lambda log: FlowerTransport(self.grid, settings, log), settings)

    @contextmanager
    def runs(self, cfg: dict[str, Any], path: Path | None = None) -> Iterator[Runs]:
        """The experiment's runs are :class:`~medfl.engine.remote.RemoteRun` on the grid
        (``config.json`` says ``"engine": "flower"``, and under ``"launch"`` the options of
        ``medfl flower run`` that reach the SuperLink, for :meth:`resume_command`); no grid:
        :meth:`check_resume` refuses a resume."""
        if path is not None:
            self.check_resume(path)
        launch = str(getattr(self.settings, "launch", "") or "")
        yield self._factory(), {"engine": self.engine, **({"launch": launch} if launch else {})}

    def check_resume(self, path: Path) -> None:
        """Refuse a resume with no grid (``medfl resume``).

        Raises:
            RunError: the clients ran at the sites, which keep their state; the message names
                the command that resumes there (:meth:`resume_command`).
        """
        if self.grid is None:
            raise RunError(f"{path}: its clients ran at the sites over Flower, which keep their state; `medfl resume` "
                           "would train them here on this machine's copy of the data without it. Continue with "
                           f"`{self.resume_command(path, recorded_backend(path)[1])}`")

    def resume_command(self, path: Path, record: dict[str, Any]) -> str:
        """``medfl flower run --resume PATH`` and the options that reached the SuperLink when
        the run started (its ``config.json``'s ``"launch"``; a run that did not record them:
        the placeholders ``--superlink HOST:PORT`` and ``--insecure``/``--root-certificates``)."""
        launch = str(record.get("launch") or "") or "--superlink HOST:PORT (--insecure | --root-certificates CA.pem)"
        return f"medfl flower run --resume {shlex.quote(str(path))} {launch}"


class NVFlare(Flower):
    """The clients are NVIDIA FLARE clients at the sites, reached through the job's controller
    workflow (:class:`medfl.nvflare.controller.MedflController`, which builds this backend with
    its :class:`~medfl.nvflare.transport.NVFlareTransport` as ``grid``); the runs are
    :class:`~medfl.engine.remote.RemoteRun`, as over Flower.

    Args:
        grid: the workflow's transport; ``None`` (as the registry builds it): no NVFlare job
            here, and running says how to write one.
        settings: the coordinator's :class:`medfl.engine.remote_sites.RemoteSettings`.
    """

    name = "nvflare"
    engine = "nvflare"
    description = "the clients are NVIDIA FLARE clients at the sites (medfl nvflare job; needs medfl[nvflare])"
    missing = ("fl.backend 'nvflare': the clients are NVIDIA FLARE clients; write the job with `medfl nvflare job "
               "--config CONFIG --out DIR` and submit it (or run it in NVFlare's simulator: `nvflare simulator "
               "DIR/JOB -w WORKSPACE -n SITES`), docs/nvflare.md")

    def check_resume(self, path: Path) -> None:
        """Refuse a resume outside an NVFlare job (``medfl resume``).

        Raises:
            RunError: the sites keep their state; the message names the command that writes
                the job continuing the run.
        """
        if self.grid is None:
            raise RunError(f"{path}: its clients ran at the sites over NVIDIA FLARE, which keep their state; "
                           "`medfl resume` would train them here without it. Continue with "
                           f"`{self.resume_command(path, {})}`")

    def resume_command(self, path: Path, record: dict[str, Any]) -> str:
        """``medfl nvflare job --resume PATH --out medfl_resume_job``: writes the job that
        continues the run (run where the run directory is, on the NVFlare server's machine; the
        command then says how to submit the job, as the first one was)."""
        from medfl.nvflare import RESUME_JOB

        return f"medfl nvflare job --resume {shlex.quote(str(path))} --out {RESUME_JOB}"


@hookimpl
def register_backends(register: Any) -> None:
    """Register the built-in backends."""
    for backend in (InProcess, Ray, Flower, NVFlare):
        register(backend)
