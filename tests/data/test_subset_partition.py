"""The ``subset`` partitioner (FedTPF's extreme quantity skew: one class is at least 90 % of
each client's data), its feasibility checks and its place among the partitioners."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from medfl.data.partition import PARTITIONERS, PartitionError, check_partition, subset

__all__: list[str] = []

LABELS = np.random.default_rng(0).choice(9, size=3000, p=np.arange(1, 10) / 45)  # imbalanced, 9 classes
TABLE = pd.DataFrame({"label": LABELS})


def _shares(parts) -> list[float]:
    return [np.bincount(LABELS[pos]).max() / len(pos) for pos in parts.values()]


@pytest.mark.parametrize("clients", [9, 10, 20])
def test_each_client_is_dominated_by_one_class_and_every_row_is_assigned(clients: int) -> None:
    parts = subset(TABLE, clients, 0)
    check_partition(parts, TABLE)  # disjoint and complete
    assert min(_shares(parts)) >= 0.9
    dominant = [int(np.bincount(LABELS[pos]).argmax()) for pos in parts.values()]
    assert sorted(set(dominant)) == list(range(9))  # every class dominates some client
    assert all(len(np.unique(LABELS[pos])) > 1 for pos in parts.values())  # and the minor classes are there


def test_share_and_minor_fraction_are_parameters_and_the_draw_is_seeded() -> None:
    strict = subset(TABLE, 12, 3, share=0.97, minor_fraction=0.02)
    assert min(_shares(strict)) >= 0.97
    pure = subset(TABLE, 9, 3, minor_fraction=0.0)
    assert min(_shares(pure)) == 1.0
    again, other = subset(TABLE, 12, 3, share=0.97, minor_fraction=0.02), subset(TABLE, 12, 4, share=0.97,
                                                                                minor_fraction=0.02)
    assert all(np.array_equal(strict[k], again[k]) for k in strict)
    assert any(not np.array_equal(strict[k], other[k]) for k in strict)
    assert PARTITIONERS["subset"] is subset


@pytest.mark.parametrize("kwargs, message", [
    ({"share": 1.0}, r"share must be a number in \(0, 1\)"),
    ({"share": "0.9"}, r"share must be a number in \(0, 1\)"),
    ({"minor_fraction": 0.2}, r"minor_fraction must be in \[0, 1 - share = 0.1\]"),
    ({"num_clients": 5}, r"the \d+ rows for the minor classes do not fit: .*room \d+ in all"),
    ({"num_clients": 2000}, r"clients \[.*\] get no rows of their dominant class"),
])
def test_bad_or_infeasible_requests_say_why(kwargs, message) -> None:
    args = {"num_clients": 9, **kwargs}
    with pytest.raises(PartitionError, match=message):
        subset(TABLE, args.pop("num_clients"), 0, **args)
