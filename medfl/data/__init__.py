"""Data: manifests, dataset sources, partitioners, generated datasets."""

from __future__ import annotations

from medfl.data.partition import (
    PARTITIONERS, Partition, PartitionError, class_counts, dirichlet, iid, label_skew,
    natural, partition_table, quantity_skew, stratified_split,
)
from medfl.data.source import ArrayDataset, DataError, FederatedSource, read_manifest

__all__ = [
    "PARTITIONERS", "Partition", "PartitionError", "class_counts", "dirichlet", "iid",
    "label_skew", "natural", "partition_table", "quantity_skew", "stratified_split",
    "ArrayDataset", "DataError", "FederatedSource", "read_manifest",
]
