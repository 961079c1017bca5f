"""Parallel clients on one machine: medfl on Flower's simulation runtime (Ray).

``"backend": "ray"`` in the ``fl`` section (or ``{"name": "ray", "client_cpus": 1,
"client_gpus": 0.25}``; :data:`medfl.config.BACKEND_DEFAULTS`), or ``medfl run CONFIG
--backend ray``, runs the experiment through :func:`flwr.simulation.run_simulation`: the
coordinator is :class:`~medfl.engine.remote.RemoteRun` (the deployment's ServerApp code,
over Flower's in-memory grid instead of a SuperLink: :class:`SimulatedTransport`) and every
client is a simulated SuperNode whose messages are handled by the deployment's own
:func:`medfl.site_messages.handle` in a Ray actor. Ray runs as many actors as the resources
allow (cores / ``client_cpus``, GPUs / ``client_gpus``), so the clients of a round train in
parallel; each actor keeps torch, the plugins and the sites it served loaded between
messages.

Compared with the in-process engine, for the same seed the metrics are the same (a test
proves it): the sites draw the split themselves from the same config, privacy noise comes
from the run seed (as in process; a deployed site mixes in its own secret) and
``ClientContext.deployed`` is false. What differs: each actor sets its torch threads to
``fl.threads`` (``"auto"``: the cores divided among the actors that run at once,
:func:`medfl.config.actor_threads`); the run directory also has ``flower.json`` and
``flower_events.csv``;
the sites' persistent state is kept under ``<output_dir>/.simulation/<run id>/`` (the run
id is in ``flower.json``), which ``medfl resume`` needs to continue the run and which can
be deleted once a run will not be continued.

Ray is an optional dependency: ``pip install "medfl[simulation]"`` (Flower's own
``flwr[simulation]`` extra).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import queue
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from medfl.config import actor_threads
from medfl.engine.data import FederatedData, client_order, split_data
from medfl.engine.remote import RemoteRun, RemoteSettings
from medfl.engine.runner import RunError, RunFactory, build_source
from medfl.site import Site, SiteSettings
from medfl.site_messages import handle
from medfl.flower.proxy import answer_with, client_app
from medfl.flower.transport import FLOWER_TERMS, FlowerTransport

__all__ = ["SimulatedTransport", "SimulatedSites", "simulated_runs", "ray_missing", "shutdown_ray", "STATE_FOLDER"]

logger = logging.getLogger(__name__)

#: Folder of ``output_dir`` holding the simulated sites' persistent state, by run id.
STATE_FOLDER = ".simulation"


def ray_missing() -> str:
    """Empty when Ray can be imported, else what to install."""
    if importlib.util.find_spec("ray") is None:
        return ("fl.backend 'ray' runs the clients on Flower's simulation runtime, which needs Ray: "
                "pip install \"medfl[simulation]\" (or \"flwr[simulation]\")")
    return ""


class SimulatedTransport(FlowerTransport):
    """:class:`FlowerTransport` over the simulation runtime's in-memory grid: every simulated
    node exists from the start (the run waits until each has answered its hello or been
    refused, not for nodes to come), and its sites draw privacy noise from the run seed."""

    terms = {**FLOWER_TERMS, "where": "on Flower's simulation runtime"}
    fixed_nodes = True
    connect_hint = "every simulated node serves one client of the config's partition (fl.num_clients)"
    noise_source = ("the run seed: a reproducible simulation on Flower's simulation runtime (as in process; "
                    "whoever knows the seed could regenerate the noise)")


class SimulatedSites:
    """The ClientApp handler of every simulated SuperNode: node ``partition-id`` k serves
    the k-th client of the partition, as a :class:`~medfl.site.Site` built from the
    coordinator's resolved config. Pickled to each Ray actor; the sites an actor built stay
    cached there.

    Args:
        cfg: the resolved ``fl`` config (what the coordinator runs).
        client_ids: the clients, in the order of the simulated nodes.
        state_dir: where the sites keep their persistent state.
        workdir: where relative paths of the config are read (the coordinator's folder).
        threads: torch threads of each actor (:func:`medfl.config.actor_threads`: ``fl.threads``,
            or ``"auto"``: the cores shared among the actors that run at once).
    """

    def __init__(self, cfg: dict[str, Any], client_ids: list[str], state_dir: Path, workdir: Path,
                 threads: int) -> None:
        self.cfg = cfg
        self.client_ids = list(client_ids)
        self.state_dir = Path(state_dir)
        self.workdir = Path(workdir)
        self.threads = int(threads)
        self._sites: dict[str, Site] = {}
        self._source: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # what travels to each Ray actor: the settings, not a site or dataset built here
        return {**self.__dict__, "_sites": {}, "_source": None}

    def site(self, partition_id: int) -> Site:
        """The site of simulated node ``partition_id`` (built on first use)."""
        if not 0 <= partition_id < len(self.client_ids):
            raise RunError(f"simulated node {partition_id}: the partition has {len(self.client_ids)} clients")
        cid = self.client_ids[partition_id]
        if cid not in self._sites:
            import torch

            if torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
            site = Site(SiteSettings(client_id=cid, config=Path("<simulation>"), state_dir=self.state_dir,
                                     workdir=self.workdir, resolved=self.cfg, simulated=True))
            # the sites of one actor read one dataset object (one cache, one file index), not one each
            if self._source is None:
                self._source = build_source(site.cfg["dataset"])
            site._source = self._source
            self._sites[cid] = site
        return self._sites[cid]

    def __call__(self, msg: Message, context: Context) -> Message:
        site, kind = self.site(int(context.node_config["partition-id"])), msg.metadata.message_type
        return Message(answer_with(msg.content, lambda data: handle(site, kind, data)), reply_to=msg)


def _backend_config(backend: dict[str, Any]) -> dict[str, Any]:
    init = {k: int(backend[k]) for k in ("num_cpus", "num_gpus") if backend.get(k) is not None}
    return {"client_resources": {"num_cpus": int(backend["client_cpus"]), "num_gpus": float(backend["client_gpus"])},
            "init_args": init}


@contextmanager
def simulated_runs(cfg: dict[str, Any]) -> Iterator[RunFactory]:
    """The runs of an experiment of ``cfg`` (the ``ray`` backend) on Flower's simulation
    runtime, one simulated SuperNode per client (every client of every seed's partition), which
    runs in a thread of its own for as long as the ``with``: its ServerApp hands medfl its grid
    and waits, and the experiment runs its loop in the caller's thread over that grid
    (:class:`SimulatedTransport`). Ctrl-C in the main thread sets the coordinator's stop event:
    it saves its rounds and stops (``KeyboardInterrupt``); a second Ctrl-C stops at once.

    Raises:
        RunError: Ray is not installed, a CUDA device without ``client_gpus``, or the runtime
            ended before its ServerApp started (its log is above).
    """
    _check_runtime(cfg)
    from flwr.simulation import run_simulation

    client_ids = _client_ids(cfg)
    state_dir = (Path(cfg["output_dir"]) / STATE_FOLDER).resolve()
    handler = SimulatedSites(cfg, client_ids, state_dir, Path.cwd(), actor_threads(cfg, len(client_ids)))
    grids: queue.Queue[Grid | None] = queue.Queue()
    done = threading.Event()
    failed: list[BaseException] = []
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        # the experiment runs in the caller's thread over this grid; the runtime ends when this returns
        grids.put(grid)
        done.wait()

    def runtime() -> None:
        try:
            run_simulation(server_app=server, client_app=client_app(handler), num_supernodes=len(client_ids),
                           backend_config=_backend_config(cfg["backend"]))
        except BaseException as exc:  # noqa: BLE001 - said in the caller's thread
            failed.append(exc)
        finally:
            grids.put(None)   # a runtime that ended before its ServerApp started

    # Ray's coming default (it warns otherwise): a client holding no GPU is not hidden the
    # machine's; a CUDA run without client_gpus is refused above
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    stopping = _Stopping()
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addFilter(stopping)
    previous = None
    in_main = threading.current_thread() is threading.main_thread()
    # Ray sets its own SIGTERM handler where it starts in the main thread: put back ours (a
    # process forked later inherits it: a pool worker that caught Pool.terminate's SIGTERM with
    # Ray's handler never ended)
    term = signal.getsignal(signal.SIGTERM) if in_main else None
    if in_main and signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, None):
        previous = signal.signal(signal.SIGINT, stopping)
    thread = threading.Thread(target=runtime, name="medfl-simulation-runtime", daemon=True)
    thread.start()
    try:
        grid = grids.get()
        if grid is None:
            raise RunError("Flower's simulation runtime ended before the experiment started (its log is above)"
                           + (f": {type(failed[0]).__name__}: {failed[0]}" if failed else "")) \
                from (failed[0] if failed else None)
        yield _factory(grid, stopping.event)
    except KeyboardInterrupt:
        stopping.event.set()
        raise
    finally:
        done.set()   # the ServerApp returns; the runtime ends once the clients' messages are answered
        thread.join(_STOP_WAIT)
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        flwr_logger.removeFilter(stopping)
        shutdown_ray()
        if term is not None:
            signal.signal(signal.SIGTERM, term)
    if failed:   # after the experiment finished: its results are complete
        logger.warning(f"medfl: Flower's simulation runtime ended with {type(failed[0]).__name__}: {failed[0]}")


def shutdown_ray() -> None:
    """End Ray in this process (its actors and daemons) if it still runs: Flower's runtime
    ends it when the simulation ends, but not on every way out (an error before its backend
    was built, a second Ctrl-C), and an actor left there keeps a core busy after medfl ended."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _check_runtime(cfg: dict[str, Any]) -> None:
    """Refuse a run the simulation runtime cannot do (:func:`simulated_runs`).

    Raises:
        RunError: Ray is not installed, or a CUDA device without ``client_gpus``.
    """
    missing = ray_missing()
    if missing:
        raise RunError(missing)
    if str(cfg["device"]).startswith("cuda") and not cfg["backend"]["client_gpus"]:
        raise RunError(f"fl.device is {cfg['device']!r} but fl.backend.client_gpus is 0: a simulated client sees a GPU "
                       "only when it holds one; set e.g. {\"name\": \"ray\", \"client_gpus\": 0.5} (two clients per "
                       "GPU)")


class _Stopping(logging.Filter):
    """Ctrl-C on the simulation runtime: the SIGINT handler (call it) and Flower's log filter.

    The first Ctrl-C sets :attr:`event`: the coordinator saves and raises
    ``KeyboardInterrupt`` at its next poll, the ServerApp ends and Flower's runtime stops once
    the clients' current messages are answered (ending the actors under a pending answer
    instead can leave Flower's runtime threads waiting on Ray for ever); a second Ctrl-C stops
    at once. The filter drops Flower's notice that ``run_simulation`` is deprecated in favour
    of ``flwr run`` (medfl calls it for the user, who cannot act on it; docs/flower.md says
    so) and, once the run is stopping, the errors of clients whose actors Ctrl-C ended too.
    """

    def __init__(self) -> None:
        super().__init__()
        #: set once the run is to stop (the coordinator's ``RemoteSettings.stop``)
        self.event = threading.Event()

    def __call__(self, *_: Any) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.event.set()
        logger.warning("medfl: stopping (the finished rounds are kept; the clients finish the message they "
                       "are on; Ctrl-C again to stop at once)")

    def filter(self, record: logging.LogRecord) -> bool:
        if self.event.is_set() and record.levelno >= logging.ERROR:
            return False
        return "run_simulation" not in str(record.getMessage())


#: Seconds the main thread waits, after Ctrl-C, for the coordinator to save and stop.
_STOP_WAIT = 60.0


def _factory(grid: Grid, stop: threading.Event | None = None) -> Any:
    def build(cfg: dict[str, Any], spec: dict[str, Any], run_dir: Path, data: FederatedData) -> RemoteRun:
        # every simulated node is there from the start and replies arrive through memory, but each
        # node's actor must first start (torch, the dataset), which a loaded machine slows down:
        # fl.backend.connect_timeout seconds for every node's hello at the start
        settings = RemoteSettings(poll_interval=0.01, connect_timeout=float(cfg["backend"]["connect_timeout"]),
                                  hello_timeout=60.0, progress_interval=30.0, stop=stop)
        return RemoteRun(cfg, spec, run_dir, data, lambda log: SimulatedTransport(grid, settings, log), settings)
    return build


def _client_ids(cfg: dict[str, Any]) -> list[str]:
    """Every client of the experiment's partitions (each seed's, with ``seeds``): one
    simulated node each."""
    fold = 0 if int((cfg.get("cv") or {}).get("folds") or 0) > 1 else None
    source = build_source(cfg["dataset"])
    ids: set[str] = set()
    for seed in cfg.get("seeds") or [cfg["seed"]]:
        ids.update(split_data(source, {**cfg, "seed": seed}, fold=fold).client_ids)
    return client_order(list(ids))
