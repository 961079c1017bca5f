"""How many torch threads each process that trains uses: ``fl.threads`` (``--threads``,
``MEDFL_THREADS``), a number or ``"auto"`` (the cores shared among the processes training on them)."""

from __future__ import annotations

import os
from typing import Any

import torch

from medfl.config_values import ConfigError

__all__ = ["THREADS_AUTO", "THREADS_ENV", "LOCAL_SITES_ENV", "check_threads", "available_cores", "sharing_processes",
           "auto_threads", "threads_setting", "resolve_threads", "set_threads", "local_sites", "actor_threads",
           "threads_record"]

#: The ``fl.threads`` value that divides the cores among the processes training on them.
THREADS_AUTO = "auto"
#: Environment variable with the ``--threads`` of the command line: it wins over ``fl.threads``
#: (so ``medfl resume --threads 1`` applies to a run whose saved config says otherwise) and
#: reaches the processes a command starts (a Flower site's worker).
THREADS_ENV = "MEDFL_THREADS"
#: Environment variable set in each Flower site process that ``medfl`` starts together with
#: others on one machine (``LocalFederation`` of the tests): how many there are.
LOCAL_SITES_ENV = "MEDFL_LOCAL_SITES"


def check_threads(value: Any, where: str = "fl.threads") -> int | str:
    """Check a threads setting: a positive integer (a string of digits too, as a command line
    gives it) or ``"auto"``.

    Returns:
        The number of threads as an ``int``, or ``"auto"``.

    Raises:
        ConfigError: anything else (0, a negative number, a fraction, a boolean, another word).
    """
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, str) and value.strip().lower() == THREADS_AUTO:
        return THREADS_AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: expected a positive number of torch threads or \"auto\" (the cores this "
                          f"process may use divided among the processes training on them), got {value!r}")
    return value


def available_cores() -> int:
    """The CPU cores this process may run on: its affinity mask where the platform has one
    (a container or ``taskset`` limit shows there, not in ``os.cpu_count()``), else every core."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):   # macOS, Windows
        return max(1, os.cpu_count() or 1)


def sharing_processes(processes: int = 1) -> int:
    """How many processes train on this machine's cores at once, counting ``processes`` of the
    job itself (1 in process; the concurrent Ray actors; ``MEDFL_LOCAL_SITES`` Flower sites that
    ``medfl`` started together) times the pytest-xdist workers (``PYTEST_XDIST_WORKER_COUNT``)
    when running under them."""
    return max(1, int(processes)) * _env_count("PYTEST_XDIST_WORKER_COUNT")


def _env_count(name: str) -> int:
    """The positive integer in environment variable ``name``; 1 when unset or not one."""
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def local_sites() -> int:
    """How many Flower sites ``medfl`` started together on this machine (``MEDFL_LOCAL_SITES``,
    set by ``LocalFederation`` of the tests; 1 when unset): the processes a
    site's ``"auto"`` threads are shared with."""
    return _env_count(LOCAL_SITES_ENV)


def actor_threads(cfg: dict[str, Any], clients: int) -> int:
    """Torch threads of each Ray actor of the simulation backend (``fl.backend`` ``ray``):
    ``fl.threads`` (or ``--threads``) when a number, else ``"auto"`` over the actors that run at
    once, ``min(clients, cores Ray may use // client_cpus)`` (Ray's ``num_cpus``, default every
    core this process may use)."""
    setting = threads_setting(cfg.get("threads"))
    if setting != THREADS_AUTO:
        return int(setting)
    backend = cfg["backend"]
    cores = int(backend.get("num_cpus") or available_cores())
    actors = max(1, min(int(clients), cores // max(1, int(backend.get("client_cpus") or 1))))
    return auto_threads(actors)


def auto_threads(processes: int = 1, cores: int | None = None) -> int:
    """The ``"auto"`` thread count: ``cores`` (default :func:`available_cores`) divided by
    :func:`sharing_processes` ``(processes)``, rounded down, at least 1. Two processes on two
    cores get one thread each instead of two each (which oversubscribes the cores)."""
    return max(1, (available_cores() if cores is None else int(cores)) // sharing_processes(processes))


def threads_setting(value: Any = THREADS_AUTO) -> int | str:
    """The threads setting in force: ``MEDFL_THREADS`` (the command line's ``--threads``) when
    set, else ``value`` (a config's ``fl.threads``; ``None``: ``"auto"``), checked."""
    env = os.environ.get(THREADS_ENV)
    if env:
        return check_threads(env, f"{THREADS_ENV} (--threads)")
    return check_threads(THREADS_AUTO if value is None else value)


def resolve_threads(value: Any = THREADS_AUTO, processes: int = 1) -> int:
    """The number of torch threads for a process that trains beside ``processes - 1`` others of
    its job: :func:`threads_setting` ``(value)``, with ``"auto"`` worked out by :func:`auto_threads`."""
    setting = threads_setting(value)
    return auto_threads(processes) if setting == THREADS_AUTO else int(setting)


def set_threads(value: Any = THREADS_AUTO, processes: int = 1, *, apply_auto: bool = True) -> int:
    """Set torch's intra-op threads of this process to :func:`resolve_threads` ``(value,
    processes)`` (once per process, before it trains) and return the number in force.

    Args:
        value: ``fl.threads`` (``None``: ``"auto"``); ``MEDFL_THREADS`` (``--threads``) wins.
        processes: the processes of the job training on this machine's cores at once.
        apply_auto: ``False`` leaves torch as it is when the setting is ``"auto"``: what a
            library call (:func:`medfl.experiment.run_experiment`) does, so that a caller's own
            ``torch.set_num_threads`` stands; the process's entry point (``medfl run``, a
            bundle run, a Flower site) applies ``"auto"`` before it.
    """
    if not apply_auto and threads_setting(value) == THREADS_AUTO:
        return torch.get_num_threads()
    threads = resolve_threads(value, processes)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def threads_record(value: Any = THREADS_AUTO) -> dict[str, Any]:
    """The ``threads`` block of a run's ``summary.json``: the setting in force
    (:func:`threads_setting`: ``--threads``, else ``fl.threads``, else ``"auto"``) and the torch
    threads of this process, the one that ran the rounds (in process: the one that trained every
    client; over Ray or Flower the coordinator's, each site set its own from the same setting)."""
    return {"setting": threads_setting(value), "torch_threads": torch.get_num_threads()}
