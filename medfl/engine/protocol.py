"""What the coordinator and the sites say to each other over Flower: message types, record
names and the partition fingerprint both sides compute.

Every medfl message carries a ``medfl`` config record of control fields (JSON values:
the run and session ids, the round, the run seed, the addressed client id, the method and
model specs, the local-training settings...) next to its payload records; every
message's content is a :class:`medfl.wire.Content` built by :mod:`medfl.wire` (shared with the
in-process engine, which measures the same contents), converted to and from Flower's records
only where a message meets Flower (:mod:`medfl.flower.proxy`); :data:`PROTOCOL` and
:data:`CONTROL` are defined in :mod:`medfl.wire`.
Message types (``<category>.<action>``, Flower's convention):

``query.hello``
    which client id does this node serve, and what does its partition look like
    (split sizes, :func:`partition_digest`); no state is touched.
``train``
    one ``client_update`` (an :class:`~medfl.messages.Instruction` under ``ins``); the
    reply holds the :class:`~medfl.messages.Reply` (``reply``) and ``num_examples``.
``evaluate``
    one evaluation (:func:`medfl.engine.client_eval.run_client_evaluate`) on the listed own
    splits; metrics come back as one metrics record per split (``eval.<split>``), and,
    when ``cross_test`` is asked for, the evaluation model's state (``model``).
``evaluate.validate``
    the method's validation exchange (``Method.configure_validate`` /
    ``client_validate``): an instruction under ``ins``; the scalars come back as one
    metrics record (``validate``).
``evaluate.score``
    ``cross_test``: other clients' evaluation models (``models``: ``{client id: state}``)
    scored on this site's local test split; only the metrics come back (``score.<id>``).
    Each model is rebuilt with the method's ``eval_model_skeleton`` from its owner's model
    spec and evaluation instruction (``ins.<k>.payload``/``ins.<k>.config``, shared by the
    owners that ``ins_of`` maps to ``k``), so any method's evaluation model can be scored.
"""

from __future__ import annotations

import hashlib

from medfl.engine.data import FederatedData
from medfl.engine.exchanges import ROLES
from medfl.wire import CONTROL, PROTOCOL

__all__ = ["PROTOCOL", "HELLO", "TRAIN", "EVALUATE", "VALIDATE", "SCORE", "CONTROL", "ROLES", "OWN_SPLIT_ROLES",
           "partition_digest", "split_sizes"]

HELLO = "query.hello"
TRAIN = "train"
EVALUATE = "evaluate"
VALIDATE = "evaluate.validate"
SCORE = "evaluate.score"

#: The roles whose sizes a client knows as its own (the reply guard and ``split_sizes``):
#: those of a client's context (:data:`medfl.engine.exchanges.ROLES`) but the shared global test.
OWN_SPLIT_ROLES = [r for r in ROLES if r != "global_test"]


def split_sizes(data: FederatedData, client_id: str) -> dict[str, int]:
    """Number of samples of each of ``client_id``'s own splits."""
    return data.sizes(client_id, OWN_SPLIT_ROLES)


def partition_digest(data: FederatedData, client_id: str) -> int:
    """A fingerprint (a 60-bit integer) of ``client_id``'s rows and roles and of the global
    test rows: equal on coordinator and site exactly when both drew the same split.

    Only row positions, roles and labels enter it, never sample content; the site sends it
    so the coordinator can refuse a site whose data or config differs from its own."""
    h = hashlib.sha256()
    for role in ROLES:
        pos = data.positions(client_id, role)
        labels = data.source.table["label"].to_numpy()[pos] if len(pos) else []
        h.update(f"{role}:{','.join(map(str, pos))}|{','.join(map(str, labels))};".encode())
    return int(h.hexdigest()[:15], 16)
