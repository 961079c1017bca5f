"""medfl's messages as NVFlare tasks: :class:`NVFlareTransport`.

Under NVIDIA FLARE the coordinator (:class:`medfl.engine.remote.RemoteRun`) runs inside an
NVFlare controller workflow (:mod:`medfl.nvflare.controller`), and this is its
:class:`~medfl.transport.Transport`: each NVFlare client is a node, each message an NVFlare
:class:`~nvflare.apis.controller_spec.Task` sent to one client (the task's name is the medfl
message type, :data:`TASKS`; its data the content's bytes, :func:`medfl.wire.encode`, under
:data:`CONTENT`), and the client's result (:mod:`medfl.nvflare.executor`) comes back as the
answer. So the rounds, the hello with its partition check, dropouts, quorum waits,
checkpoints and resume are the same as over Flower, and the traffic a run records is the
same bytes. Nothing of Flower is needed: SecAgg+ (``fl.secure_aggregation``), which needs
Flower's ``secaggplus_mod`` at the sites, is refused.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from typing import Any, Callable

from medfl import wire
from medfl.transport import Answer, Outgoing, Transport

__all__ = ["NVFlareTransport", "CONTENT", "ERROR", "TASKS"]

#: the key of a task's (and a result's) Shareable holding the message's content (its bytes)
CONTENT = "medfl.content"
#: the key of a result's Shareable holding the site's error text (return code EXECUTION_EXCEPTION)
ERROR = "medfl.error"
#: the NVFlare task names: medfl's message types (:mod:`medfl.engine.protocol`)
TASKS = ("query.hello", "train", "evaluate", "evaluate.validate", "evaluate.score")


class NVFlareTransport(Transport):
    """An NVFlare controller's clients as medfl's transport, with the controller's
    non-blocking :meth:`~nvflare.apis.impl.controller.Controller.send`.

    Args:
        controller: the running controller workflow (its ``send`` delivers a task).
        fl_ctx: the workflow's ``FLContext``.
        clients: ``() -> names of the connected NVFlare clients`` (default: the engine's).
    """

    terms = {"name": "NVIDIA FLARE", "node": "NVFlare client", "hub": "NVFlare server"}
    #: an NVFlare job's clients are fixed when it starts (the server's job process lists its
    #: participants): once each has answered its hello, or been refused, the run waits no more
    fixed_nodes = True
    connect_hint = ("every site of the job must run medfl's executor with a client id "
                    "(docs/nvflare.md: the job's client_ids, or MEDFL_CLIENT_ID at the site)")

    def __init__(self, controller: Any, fl_ctx: Any, clients: Callable[[], list[str]] | None = None) -> None:
        self.controller = controller
        self.fl_ctx = fl_ctx
        self._clients = clients or (lambda: [c.name for c in fl_ctx.get_engine().get_clients()])
        self._ids = itertools.count(1)
        self.node_of: dict[str, int] = {}     # NVFlare client name -> node id
        self.name_of: dict[int, str] = {}
        self._sent: set[str] = set()
        self._answers: dict[str, Answer] = {}
        self._lock = threading.Lock()

    def nodes(self) -> list[int]:
        """One node id per connected NVFlare client (the same id for a client's whole run)."""
        names = sorted(self._clients())
        for name in names:
            if name not in self.node_of:
                node = next(self._ids)
                self.node_of[name], self.name_of[node] = node, name
        return [self.node_of[name] for name in names]

    def send(self, messages: list[Outgoing]) -> list[str]:
        """Send each message as a task to its node's client; the message ids ("" for a node
        that is not an NVFlare client of this job)."""
        from nvflare.apis.controller_spec import Task
        from nvflare.apis.shareable import Shareable

        ids = []
        for msg in messages:
            name = self.name_of.get(msg.node)
            if name is None:
                ids.append("")
                continue
            mid = uuid.uuid4().hex
            data = Shareable()
            data[CONTENT] = wire.encode(msg.content)
            task = Task(name=msg.kind, data=data, props={"medfl.message": mid}, timeout=int(max(1.0, msg.ttl)),
                        result_received_cb=self._received)
            with self._lock:
                self._sent.add(mid)
            self.controller.send(task, self.fl_ctx, targets=[name])
            ids.append(mid)
        return ids

    def _received(self, client_task: Any, fl_ctx: Any) -> None:
        """NVFlare's callback with one client's result: kept as the message's answer."""
        from nvflare.apis.fl_constant import ReturnCode

        mid = client_task.task.props.get("medfl.message")
        with self._lock:
            if mid not in self._sent:
                return
            self._sent.discard(mid)
        result = client_task.result
        code = result.get_return_code(ReturnCode.OK) if result is not None else ReturnCode.EMPTY_RESULT
        who = f"NVFlare client {client_task.client.name}"    # the site's name in the error
        if code == ReturnCode.OK and CONTENT in result:
            try:
                answer = Answer(mid, wire.decode(result[CONTENT]))
            except wire.WireError as exc:
                answer = Answer(mid, error=f"{who}: its answer cannot be read: {exc}")
        elif code == ReturnCode.EXECUTION_EXCEPTION:
            answer = Answer(mid, error=f"{who}: {result.get(ERROR) or 'the executor raised'}")
        else:   # the client left, the task expired
            answer = Answer(mid, error=f"{who}: NVFlare return code {code}", lost=True)
        # NVFlare keeps a task's results: this one is handed over once, through receive
        client_task.result = None
        with self._lock:
            self._answers[mid] = answer

    def receive(self, ids: list[str]) -> list[Answer]:
        """The answers to ``ids`` that arrived since the last call."""
        with self._lock:
            return [self._answers.pop(mid) for mid in ids if mid in self._answers]
