"""medfl across real sites with Flower: a SuperLink, one SuperNode per site, medfl's
coordinator as the ServerApp.

- :mod:`medfl.flower.coordinator`: :class:`FlowerRun` (the engine's ``Run`` whose two transport
  methods talk to SuperNodes), what the ``flower`` and ``ray`` backends run;
- :mod:`medfl.flower.server`: the ``ServerApp`` (the top of the coordinator's process, like the
  CLI: it runs experiments, :func:`run_flower_experiment`, on the ``flower`` backend);
- :mod:`medfl.flower.site`: the ``ClientApp`` each SuperNode runs: the method's client
  steps on the site's own data, its persistent state kept at the site;
- :mod:`medfl.flower.protocol`: message types and the partition fingerprint (the messages'
  content is built by :mod:`medfl.wire`, shared with the in-process engine, which measures it);
- :mod:`medfl.flower.records`: the one conversion of those contents to Flower's records and back;
- :mod:`medfl.flower.deploy`: the commands of the three steps, and
  :class:`LocalFederation` (a whole federation of processes on one machine).

See ``docs/flower.md``. This package needs Flower (``flwr``); an in-process run does not: the
engine builds the same message contents (:mod:`medfl.wire`, which imports no Flower) to
measure its traffic.
"""

from __future__ import annotations

from typing import Any

from medfl.flower.deploy import FlowerDeployError, LocalFederation, free_port
from medfl.flower.coordinator import FlowerRun, FlowerSettings, SiteFailure
from medfl.flower.site import Site, SiteError, SiteSettings

__all__ = ["FlowerRun", "FlowerSettings", "SiteFailure", "run_flower_experiment", "resume_flower", "Site",
           "SiteSettings", "SiteError", "LocalFederation", "FlowerDeployError", "free_port"]


def __getattr__(name: str) -> Any:
    """:func:`run_flower_experiment` and :func:`resume_flower`, from :mod:`medfl.flower.server`
    on first use: the ServerApp's module sits above the experiment level, which this package's
    backends must not import."""
    if name in ("run_flower_experiment", "resume_flower"):
        from medfl.flower import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
