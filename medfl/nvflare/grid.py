"""The coordinator's messages as NVFlare tasks: :class:`TaskGrid` and :class:`NVFlareRun`.

medfl's coordinator over Flower (:class:`medfl.flower.coordinator.FlowerRun`) talks to its
sites through a grid: it lists the nodes, pushes messages and pulls their replies. Under
NVIDIA FLARE the same coordinator runs inside an NVFlare controller workflow
(:mod:`medfl.nvflare.controller`), and :class:`TaskGrid` is its grid: each NVFlare client is a
node, each message is an NVFlare :class:`~nvflare.apis.controller_spec.Task` sent to one client
(the task's name is the medfl message type: ``query.hello``, ``train``, ``evaluate``,
``evaluate.validate``, ``evaluate.score``), its data the message's records as Flower's
protobuf bytes (:func:`medfl.flower.proxy.encode_records`), and the client's result comes back
as the reply. The traffic a run records is the coordinator's count of medfl's own contents
(:func:`medfl.wire.encoded_size`, before they become Flower records), the same bytes as in
process and over Flower. So the rounds, the hello with its partition check, dropouts, quorum waits,
checkpoints and resume are the Flower coordinator's, unchanged, and the site answers with the
Flower site's own code (:mod:`medfl.nvflare.executor`).

What does not cross: SecAgg+ (``fl.secure_aggregation``) needs Flower's ``secaggplus_mod`` at
the sites; :class:`NVFlareRun` refuses it.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from pathlib import Path
from typing import Any

from flwr.app import Error, Message

from medfl.engine.data import FederatedData
from medfl.engine.runner import RunError
from medfl.flower.coordinator import FlowerRun, FlowerSettings
from medfl.flower.proxy import decode_records, encode_records

__all__ = ["TaskGrid", "NVFlareRun", "nvflare_run_factory", "RECORDS", "ERROR", "TASKS"]

#: the key of a task's (and a result's) Shareable holding the message's records
RECORDS = "medfl.records"
#: the key of a result's Shareable holding the site's error text (return code EXECUTION_EXCEPTION)
ERROR = "medfl.error"
#: the NVFlare task names: medfl's message types (:mod:`medfl.flower.protocol`)
TASKS = ("query.hello", "train", "evaluate", "evaluate.validate", "evaluate.score")

# Flower's error codes as FlowerRun reads them: 2 (the site raised) fails that site's reply; 3
# (the message was lost: the client left, the task expired) is a dropout
_RAISED, _LOST = 2, 3


def _flower_identity() -> None:
    """Flower's ``Message`` takes its sender from the process's task identity, which only a
    Flower runtime sets; here the coordinator is the NVFlare server (node 0 of run 0)."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("run_id", "node_id", "task_id"):
        try:
            getattr(TaskIdentity, attr)
        except RuntimeError:
            setattr(TaskIdentity, attr, 0)


class TaskGrid:
    """A Flower-grid view of an NVFlare controller: what :class:`FlowerRun` calls
    (:meth:`get_node_ids`, :meth:`push_messages`, :meth:`pull_messages`), done with the
    controller's non-blocking :meth:`~nvflare.apis.impl.controller.Controller.send`.

    Args:
        controller: the running controller workflow (its ``send`` delivers a task).
        fl_ctx: the workflow's ``FLContext``.
        clients: ``() -> names of the connected NVFlare clients`` (default: the engine's).
    """

    #: what the coordinator's messages call the transport, a site's node and the hub
    #: (:data:`medfl.flower.coordinator.FLOWER_TERMS`)
    terms = {"name": "NVIDIA FLARE", "node": "NVFlare client", "hub": "NVFlare server"}

    def __init__(self, controller: Any, fl_ctx: Any, clients: Any = None) -> None:
        _flower_identity()
        self.controller = controller
        self.fl_ctx = fl_ctx
        self._clients = clients or (lambda: [c.name for c in fl_ctx.get_engine().get_clients()])
        self._ids = itertools.count(1)
        self.node_of: dict[str, int] = {}     # NVFlare client name -> node id
        self.name_of: dict[int, str] = {}
        self._sent: dict[str, Message] = {}
        self._replies: dict[str, Message] = {}
        self._lock = threading.Lock()

    def _node(self, name: str) -> int:
        if name not in self.node_of:
            node = next(self._ids)
            self.node_of[name], self.name_of[node] = node, name
        return self.node_of[name]

    def get_node_ids(self) -> list[int]:
        """One node id per connected NVFlare client (the same id for a client's whole run)."""
        return [self._node(name) for name in sorted(self._clients())]

    def push_messages(self, messages: list[Message]) -> list[str]:
        """Send each message as a task to its node's client; the message ids ("" for a node
        that is not an NVFlare client of this job)."""
        from nvflare.apis.controller_spec import Task
        from nvflare.apis.shareable import Shareable

        ids = []
        for msg in messages:
            name = self.name_of.get(msg.metadata.dst_node_id)
            if name is None:
                ids.append("")
                continue
            mid = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid   # the SuperLink's job under Flower
            data = Shareable()
            data[RECORDS] = encode_records(msg.content)
            task = Task(name=msg.metadata.message_type, data=data, props={"medfl.message": mid},
                        timeout=int(max(1.0, msg.metadata.ttl)), result_received_cb=self._received)
            with self._lock:
                self._sent[mid] = msg
            self.controller.send(task, self.fl_ctx, targets=[name])
            ids.append(mid)
        return ids

    def _received(self, client_task: Any, fl_ctx: Any) -> None:
        """NVFlare's callback with one client's result: kept as the message's reply."""
        from nvflare.apis.fl_constant import ReturnCode

        mid = client_task.task.props.get("medfl.message")
        with self._lock:
            sent = self._sent.pop(mid, None)
        if sent is None:
            return
        result = client_task.result
        code = result.get_return_code(ReturnCode.OK) if result is not None else ReturnCode.EMPTY_RESULT
        who = f"NVFlare client {client_task.client.name}"    # the site's name in the error
        if code == ReturnCode.OK and RECORDS in result:
            reply = Message(decode_records(result[RECORDS]), reply_to=sent)
        elif code == ReturnCode.EXECUTION_EXCEPTION:
            reason = f"{who}: {result.get(ERROR) or 'the executor raised'}"
            reply = Message(Error(code=_RAISED, reason=reason), reply_to=sent)
        else:
            reply = Message(Error(code=_LOST, reason=f"{who}: NVFlare return code {code}"), reply_to=sent)
        # NVFlare keeps a task's results: this one is handed over once, through pull_messages
        client_task.result = None
        with self._lock:
            self._replies[mid] = reply

    def pull_messages(self, message_ids: list[str]) -> list[Message]:
        """The replies to ``message_ids`` that arrived since the last pull."""
        with self._lock:
            return [self._replies.pop(mid) for mid in message_ids if mid in self._replies]


class NVFlareRun(FlowerRun):
    """:class:`FlowerRun` whose grid is an NVFlare controller's (:class:`TaskGrid`).

    Raises:
        RunError: ``fl.secure_aggregation`` is set (SecAgg+ is Flower's), or the method pools
            the clients' data (as over Flower).
    """

    transport = "over NVIDIA FLARE, at the sites"
    connect_hint = ("every site of the job must run medfl's executor with a client id "
                    "(docs/nvflare.md: the job's client_ids, or MEDFL_CLIENT_ID at the site)")

    def __init__(self, cfg: dict[str, Any], method_spec: dict[str, Any], run_dir: str | Path,
                 data: FederatedData, grid: TaskGrid, settings: FlowerSettings | None = None,
                 fold: int | None = None) -> None:
        if cfg.get("secure_aggregation"):
            raise RunError("fl.secure_aggregation: SecAgg+ runs over Flower only (its masks are exchanged by "
                           "Flower's secaggplus_mod at each site); unset it under fl.backend 'nvflare', or use "
                           "`medfl flower run`")
        super().__init__(cfg, method_spec, run_dir, data, grid, settings, fold)
        # an NVFlare job's clients are fixed when it starts (the server's job process lists its
        # participants): once each has answered its hello, or been refused, the run waits no more
        self.sites.fixed_nodes = True

    def resume_command(self, top: Path) -> str:
        """A stopped NVFlare run continues as a new job (:meth:`medfl_plugins.backends.NVFlare.resume_command`)."""
        from medfl.backend import recorded_backend
        from medfl.plugins import lookup

        return lookup("backend", "nvflare")().resume_command(top, recorded_backend(top)[1])


def nvflare_run_factory(grid: TaskGrid, settings: FlowerSettings | None) -> Any:
    """The runner's ``run_factory`` building :class:`NVFlareRun` on ``grid``."""
    def build(cfg: dict[str, Any], spec: dict[str, Any], run_dir: Path, data: FederatedData) -> NVFlareRun:
        return NVFlareRun(cfg, spec, run_dir, data, grid, settings)
    return build


