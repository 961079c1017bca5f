"""medfl.data.partition as a package: its public names are the family modules' own."""

from __future__ import annotations

import warnings

import pytest

import medfl.data.partition as partition
from medfl.data.partition import base, groups, rules, skew, splits, tables

__all__: list[str] = []


def test_public_names_are_the_family_modules_own_and_quiet() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in [*partition.__all__, "REST_ROLES"]:
            getattr(partition, name)
    assert partition.dirichlet is skew.dirichlet and partition.natural is rules.natural
    assert partition.Partition is base.Partition and partition.class_counts is tables.class_counts
    assert partition.per_class_holdout is splits.per_class_holdout
    assert partition.DEFAULT_GROUP_COLUMN == groups.DEFAULT_GROUP_COLUMN == "subject_id"
    assert sorted(partition.PARTITIONERS) == ["class_sample", "dirichlet", "iid", "label_skew", "natural",
                                              "quantity_skew", "subset"]


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'nosuch'"):
        partition.nosuch  # noqa: B018
