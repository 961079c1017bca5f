"""Start Flower's SuperLink or SuperNode with a task-start window a loaded machine can meet.

A SuperNode (and the SuperLink, for the ServerApp) hands each task to a fresh process
(``flwr-clientapp``, ``flwr-serverapp``) with a task token, and takes the token back when the
process has not sent its first heartbeat within Flower's heartbeat interval (30 s). That
first heartbeat comes only once the new process has imported Flower (about 1.4 s of CPU
time); on a machine at load 30-70 that takes longer than 30 s, so the token expires, the task
is handed to yet another process (every 30 s, each adding to the load), and the late one is
refused with ``401 Runtime task-token authentication failed``: no site ever answers.

``medfl flower superlink`` and ``medfl flower site`` therefore start Flower through this file
(``python flwr_launcher.py flower-supernode ARGS...``), which widens the window of the task
states in that process to :func:`task_window` seconds (environment variable
:data:`TASK_WINDOW_ENV`, default :data:`DEFAULT_TASK_WINDOW`) before it runs Flower's own
command. A task process that dies without a word is then noticed after twice the window
instead of after 60 s; the coordinator's round timeout covers a site whose answer does not
come either way.

The file is run by path, not as ``python -m medfl...``: it imports Flower only, not medfl
(and torch), so the SuperLink and SuperNodes start as fast as Flower's own commands.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import sys
from typing import Mapping

__all__ = ["TASK_WINDOW_ENV", "DEFAULT_TASK_WINDOW", "COMMANDS", "task_window", "widen_task_window", "main"]

logger = logging.getLogger(__name__)

#: Environment variable: seconds a new ClientApp/ServerApp process has to report (default below).
TASK_WINDOW_ENV = "MEDFL_FLOWER_TASK_WINDOW"
#: The default window, in seconds (Flower's own is 30 s).
DEFAULT_TASK_WINDOW = 300.0
#: The Flower commands this starts: name -> (module, function) of its console script.
COMMANDS = {"flower-superlink": ("flwr.superlink.cli", "flower_superlink"),
            "flower-supernode": ("flwr.supernode.cli", "flower_supernode")}
#: Flower's task-state modules whose heartbeat interval sets how long a claimed task may stay silent.
_STATE_MODULES = ("flwr.supercore.corestate.in_memory_corestate", "flwr.supercore.corestate.sql_corestate")
_FLOWER_WINDOW = 30.0


def task_window(env: Mapping[str, str] | None = None) -> float:
    """The task-start window in seconds: :data:`TASK_WINDOW_ENV` of ``env`` (default: this
    process's environment), else :data:`DEFAULT_TASK_WINDOW`.

    Raises:
        ValueError: the variable is not a finite number of at least Flower's 30 s.
    """
    raw = (os.environ if env is None else env).get(TASK_WINDOW_ENV, "").strip()
    if not raw:
        return DEFAULT_TASK_WINDOW
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < _FLOWER_WINDOW:
        raise ValueError(f"{TASK_WINDOW_ENV}={raw!r}: expected the seconds a new ClientApp or ServerApp process "
                         f"has to report to its SuperNode or SuperLink, a number of at least {_FLOWER_WINDOW:g} "
                         f"(Flower's own window; default {DEFAULT_TASK_WINDOW:g})")
    return value


def widen_task_window(seconds: float) -> None:
    """Give a claimed task ``seconds`` (instead of Flower's 30 s) to send its first heartbeat,
    in this process's Flower task states.

    Raises:
        RuntimeError: this Flower release keeps the window elsewhere (medfl must be updated
            for it; starting anyway would bring back the 401s on a loaded machine).
    """
    for name in _STATE_MODULES:
        module = importlib.import_module(name)
        if not isinstance(getattr(module, "HEARTBEAT_DEFAULT_INTERVAL", None), (int, float)):
            raise RuntimeError(f"{name} has no HEARTBEAT_DEFAULT_INTERVAL: this Flower release keeps the task "
                               "heartbeat window elsewhere; medfl cannot widen it")
        module.HEARTBEAT_DEFAULT_INTERVAL = max(float(seconds), float(module.HEARTBEAT_DEFAULT_INTERVAL))


def main(argv: list[str]) -> int:
    """``flwr_launcher.py NAME ARGS...``: run Flower's command ``NAME`` (one of
    :data:`COMMANDS`) with ``ARGS`` after widening the task window; its exit code."""
    from medfl.logs import configure_console

    configure_console()
    if not argv or argv[0] not in COMMANDS:
        logger.error(f"usage: {os.path.basename(__file__)} {{{','.join(COMMANDS)}}} ARGS...")
        return 2
    try:
        window = task_window()
    except ValueError as exc:
        logger.error(f"medfl: error: {exc}")
        return 2
    widen_task_window(window)
    module, function = COMMANDS[argv[0]]
    entry = getattr(importlib.import_module(module), function)
    # Flower reads its own name from argv[0] (logs, exit handling), as its console script sets it
    sys.argv = [os.path.join(os.path.dirname(sys.executable), argv[0]), *argv[1:]]
    result = entry()
    return int(result) if isinstance(result, int) else 0


if __name__ == "__main__":
    # run by path: Python put this file's folder (medfl/flower, with modules named site, server,
    # proxy...) first on sys.path, where it could shadow what Flower imports
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or os.curdir) == here:
        del sys.path[0]
    sys.exit(main(sys.argv[1:]))
