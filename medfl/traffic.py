"""The exchanges of a round and the layout of ``communication.csv``, beside the messages.

A run's exchanges with each client (one request, at most one answer, counted in encoded
bytes: :func:`medfl.wire.encoded_size`) fall into phases; the engine's recorder
(:class:`medfl.engine.traffic.Traffic`) sums them per ``(round, client_id, phase)``; phases
are :data:`PHASES`:

``profile``
    the method's profile exchange before round 1 (:meth:`medfl.method.Method.configure_profile`),
    counted in round 1;
``train``
    every training step's instruction and reply (a method with several steps per round,
    :meth:`medfl.method.Method.round_steps`, adds them up);
``secagg``
    SecAgg+'s key exchange and unmasking under ``fl.secure_aggregation`` (its setup,
    share-keys and unmask stages; the stage that carries the training instruction and the
    masked update is ``train``);
``validate``
    the method's validation exchange (:meth:`medfl.method.Method.configure_validate`);
``evaluate``
    the evaluation instruction and the metrics (plus, with ``cross_test``, the evaluation
    model's state);
``score``
    ``cross_test``: every evaluation model and the shared evaluation instructions sent to
    each site, one metrics record per model back;
``final``
    the coordinator's final models (:meth:`medfl.method.Method.final_models`) sent to each
    client after the last round and their metrics back, counted in the last round.

A request a client never answered (a Flower site that dropped out) counts its bytes to the
client only. Flower's ``query.hello`` exchanges (no round) are not counted.
"""

from __future__ import annotations

__all__ = ["PHASES", "COLUMNS"]

#: The exchanges of a round, in the order a round runs them.
PHASES = ("profile", "train", "secagg", "validate", "evaluate", "score", "final")

#: The columns of ``communication.csv``.
COLUMNS = ["round", "client_id", "phase", "bytes_to_client", "bytes_from_client", "messages"]
