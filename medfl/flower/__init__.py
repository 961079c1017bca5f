"""medfl across real sites with Flower: a SuperLink, one SuperNode per site, medfl's
coordinator as the ServerApp.

- :mod:`medfl.flower.transport`: :class:`~medfl.flower.transport.FlowerTransport`, the
  ServerApp's grid as the transport of medfl's remote coordinator
  (:class:`medfl.engine.remote.RemoteRun`), what the ``flower`` and ``ray`` backends run;
- :mod:`medfl.flower.server`: the ``ServerApp`` (the top of the coordinator's process, like the
  CLI: it runs experiments, :func:`run_flower_experiment`, on the ``flower`` backend);
- :mod:`medfl.flower.worker`: ``medfl flower site``, the site's worker beside its SuperNode,
  answering the messages the ``ClientApp`` forwards with :mod:`medfl.site` (the site of every
  backend: the method's client steps on the site's own data, its state kept there);
- :mod:`medfl.flower.proxy`: the ClientApp, and the one conversion of medfl's message
  contents (:mod:`medfl.wire_format`; their types, :mod:`medfl.engine.protocol`) to Flower's
  records and back;
- :mod:`medfl.flower.deploy`: the commands of the three steps, and ``flwr run`` of a run.

See ``docs/flower.md``. Importing this package imports nothing (its names load on first use).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["run_flower_experiment", "resume_flower", "FlowerDeployError", "free_port"]

_MODULE = {"run_flower_experiment": "server", "resume_flower": "server", "FlowerDeployError": "deploy",
           "free_port": "deploy"}


def __getattr__(name: str) -> Any:
    """The names of :data:`__all__`, from their modules on first use (the ServerApp's module
    sits above the experiment level, which this package's backends must not import)."""
    if name in _MODULE:
        return getattr(importlib.import_module(f"medfl.flower.{_MODULE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
