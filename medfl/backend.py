"""Backends: where an experiment's runs meet their clients.

An experiment (:mod:`medfl.experiment`) plans its methods x folds x seeds and drives each
method's run; a backend decides where those runs' clients are and how their messages get
there. ``fl.backend`` names one from the registry (the ``register_backends`` hook of
:mod:`medfl.hookspecs`; built in: ``inprocess``, ``ray``, ``flower``), and
:func:`backend_of` builds it.

A backend does not loop over methods, folds or seeds: the experiment does, inside the
backend's :meth:`Backend.runs` (a context manager)::

    with backend.runs(cfg) as (run_factory, meta):
        ...   # every method, fold and seed: run_factory(cfg, spec, run_dir, data).run()

``run_factory`` builds each method's run (``(cfg, method_spec, run_dir, data) -> Run``:
:class:`medfl.engine.runner.Run` itself, or :class:`medfl.engine.remote.RemoteRun` bound to a
transport); ``meta`` is added to the experiment's ``config.json`` files (e.g. ``{"engine":
"flower"}``; ``None``: nothing). What a backend must hold open while the runs reach their
clients (Flower's simulation runtime and its Ray actors) lives as long as the ``with``.

The experiment's ``config.json`` records the backend that ran it (``"backend"``: its
registered name). A stopped run continues on that backend, with the command its
:meth:`Backend.resume_command` gives (:func:`resume_command`): ``medfl resume DIR`` for the
backends whose clients this machine starts (``inprocess``, ``ray``); ``medfl flower run
--resume DIR ...`` for ``flower``, whose clients ran at the sites and kept their state there.
A backend whose runs cannot continue in ``medfl resume`` refuses it,
naming that command (:meth:`Backend.check_resume`).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from contextlib import AbstractContextManager
from typing import Any

from medfl.engine.runner import RunError, RunFactory
from medfl.plugins import lookup
from medfl.rundir import recorded_backend, resume_command

__all__ = ["Backend", "RunFactory", "Runs", "backend_name", "backend_of", "recorded_backend", "resume_command"]

#: What :meth:`Backend.runs` gives the experiment: ``(run_factory, meta)``.
Runs = tuple[RunFactory, dict[str, Any] | None]


class Backend:
    """What a backend gives the experiment: a way to run it and a way to resume it.

    Subclasses set :attr:`name` (the ``fl.backend`` name they are registered under) and
    implement :meth:`runs`; the registry builds them with no arguments.
    """

    #: the ``fl.backend`` name
    name: str = ""
    #: one line for ``medfl plugins``
    description: str = ""

    def runs(self, cfg: dict[str, Any], path: Path | None = None) -> AbstractContextManager[Runs]:
        """The runs of an experiment of the resolved ``fl`` config ``cfg``, a new one or (with
        ``path``) the stopped run or experiment in ``path`` (``cfg``: its saved config): a
        context manager giving ``(run_factory, meta)`` (:data:`Runs`; ``meta`` is ignored when
        resuming), inside which the experiment runs every method."""
        raise NotImplementedError(f"backend {self.name!r} implements no runs(cfg, path=None) (docs/plugins.md, "
                                  "Backends)")

    def check_resume(self, path: Path) -> None:
        """Refuse to continue ``path`` from here before anything is written (default: accept).

        Raises:
            RunError: the run's clients cannot be reached from here; the message names the
                command that continues it (:meth:`resume_command`).
        """

    def resume_command(self, path: Path, record: dict[str, Any]) -> str:
        """The whole command that continues the stopped run or experiment ``path`` on this
        backend (``record``: its experiment's ``config.json``, where :meth:`runs`' ``meta`` left what the
        command needs). Default: ``medfl resume PATH``, for clients this machine starts."""
        return f"medfl resume {shlex.quote(str(path))}"


def backend_name(cfg: dict[str, Any]) -> str:
    """The backend a resolved (or saved) ``fl`` config names: ``fl.backend`` as a name or as
    ``{"name": ...}``; ``inprocess`` when it names none (a config saved before backends)."""
    backend = cfg.get("backend") or "inprocess"
    return str(backend if isinstance(backend, str) else backend.get("name") or "inprocess")


def backend_of(cfg: dict[str, Any]) -> Backend:
    """The registered backend ``cfg`` names (:func:`backend_name`), built.

    Raises:
        PluginError: no backend of that name is registered (the message lists those that are).
        RunError: what is registered under the name is not a :class:`Backend`.
    """
    backend = lookup("backend", backend_name(cfg))()
    if not isinstance(backend, Backend):
        raise RunError(f"backend {backend_name(cfg)!r} is not a medfl.backend.Backend: {backend!r}")
    return backend

