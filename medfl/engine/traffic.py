"""What a run sends to and receives from each client: the recorder behind ``communication.csv``.

Every exchange of a run - a training step's instruction and reply, a validation, an
evaluation, a ``cross_test`` scoring - is one request to a client and at most one answer.
Its size is the length of medfl's own encoding of the message contents
(:func:`medfl.wire.encoded_size`, the contents built by :mod:`medfl.wire`), whichever transport
carries them: over Flower and NVIDIA FLARE the coordinator measures the contents it sends and
receives (:class:`medfl.engine.remote.RemoteRun`) before a transport carries them; in
process the engine builds the same contents and measures them (:class:`medfl.engine.runner.Run`),
so a run counts the same bytes on every transport. The transport's own framing (Flower's
protobuf, its envelope) is not counted.

:class:`Traffic` sums them per ``(round, client_id, phase)``; the phases and the columns of
``communication.csv`` are :mod:`medfl.traffic`'s (:data:`~medfl.traffic.PHASES`,
:data:`~medfl.traffic.COLUMNS`), beside the messages, where the report reads them too.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from medfl.traffic import COLUMNS, PHASES

__all__ = ["Traffic", "PHASES", "COLUMNS"]

class Traffic:
    """Bytes to and from each client, per ``(round, client_id, phase)``.

    ``bytes_to_client`` sums the encoded requests sent to the client, ``bytes_from_client``
    its answers, ``messages`` counts the requests (each exchange is one request and at most
    one answer). Rows keep the order in which they were first recorded (round by round,
    phase by phase, clients in the engine's order).
    """

    def __init__(self) -> None:
        self._rows: dict[tuple[int, str, str], list[int]] = {}
        self._tally: dict[tuple[str, str], list[int]] = {}

    def add(self, round: int, client_id: str, phase: str, to_client: int, from_client: int = 0) -> None:
        """Record one exchange with ``client_id``: a request of ``to_client`` bytes and an
        answer of ``from_client`` bytes (0: none came back).

        Raises:
            ValueError: an unknown phase.
        """
        if phase not in PHASES:
            raise ValueError(f"unknown traffic phase {phase!r}; expected one of {PHASES}")
        row = self._rows.setdefault((int(round), str(client_id), phase), [0, 0, 0])
        row[0] += int(to_client)
        row[1] += int(from_client)
        row[2] += 1
        tally = self._tally.setdefault((phase, str(client_id)), [0, 0])
        tally[0] += int(to_client)
        tally[1] += int(from_client)

    def begin(self) -> None:
        """Start a new tally (:meth:`tally`): e.g. before one training step."""
        self._tally = {}

    def tally(self, phase: str = "train") -> dict[str, tuple[int, int]]:
        """``{client_id: (bytes to, bytes from)}`` of ``phase`` recorded since :meth:`begin`."""
        return {cid: (v[0], v[1]) for (p, cid), v in self._tally.items() if p == phase}

    def frame(self) -> pd.DataFrame:
        """The rows as ``communication.csv`` holds them (:data:`COLUMNS`)."""
        rows = [{"round": r, "client_id": cid, "phase": phase, "bytes_to_client": v[0],
                 "bytes_from_client": v[1], "messages": v[2]} for (r, cid, phase), v in self._rows.items()]
        return pd.DataFrame(rows, columns=COLUMNS)

    def load(self, df: pd.DataFrame) -> None:
        """Replace the rows by those of a ``communication.csv`` (a resumed run's rounds so far)."""
        self._rows = {}
        self._tally = {}
        for rec in df.to_dict("records"):
            self._rows[(int(rec["round"]), str(rec["client_id"]), str(rec["phase"]))] = [
                int(rec["bytes_to_client"]), int(rec["bytes_from_client"]), int(rec["messages"])]

    def summary(self, rounds: int) -> dict[str, Any]:
        """The ``communication`` block of ``summary.json``.

        ``bytes_to_clients`` / ``bytes_from_clients``
            everything sent to / received from all clients over the run (encoded message
            contents, :func:`medfl.wire.encoded_size`); ``messages``: requests sent.
        ``per_round``
            those totals divided by the run's ``rounds`` (mean bytes per round, all clients
            and phases together), without the one-off ``final`` phase (the final models sent
            for scoring after the last round), which ``by_phase`` reports.
        ``train_per_client_round``
            the mean over the ``train`` rows (one per client that was sent a training
            instruction in a round) of ``bytes_to_client`` / ``bytes_from_client``: what one
            client receives and sends for training in one round (``None`` without any).
        ``by_phase``
            per phase (:data:`PHASES`), the totals and the number of requests.
        """
        df = self.frame()
        to, frm = int(df["bytes_to_client"].sum()), int(df["bytes_from_client"].sum())
        rounds_only = df[df["phase"] != "final"]
        to_r, frm_r = int(rounds_only["bytes_to_client"].sum()), int(rounds_only["bytes_from_client"].sum())
        n = max(1, int(rounds))
        train = df[df["phase"] == "train"]

        def mean(col: str) -> float | None:
            v = float(train[col].mean()) if len(train) else float("nan")
            return None if math.isnan(v) else v

        by_phase = {}
        for phase in PHASES:
            part = df[df["phase"] == phase]
            if len(part):
                by_phase[phase] = {"bytes_to_clients": int(part["bytes_to_client"].sum()),
                                   "bytes_from_clients": int(part["bytes_from_client"].sum()),
                                   "messages": int(part["messages"].sum())}
        return {"bytes_to_clients": to, "bytes_from_clients": frm, "messages": int(df["messages"].sum()),
                "rounds": int(rounds),
                "per_round": {"bytes_to_clients": to_r / n, "bytes_from_clients": frm_r / n},
                "train_per_client_round": {"bytes_to_client": mean("bytes_to_client"),
                                           "bytes_from_client": mean("bytes_from_client")},
                "by_phase": by_phase}
