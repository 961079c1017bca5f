"""Split a dataset's rows across federated clients, and each client's rows into local splits.

Every partitioner has the signature ``func(table, num_clients, seed, **params)``:

* ``table`` is the manifest (a :class:`pandas.DataFrame` with at least an integer ``label``
  column; :func:`natural` also needs its grouping column, ``site`` by default),
* ``num_clients`` is the number of clients wanted,
* ``seed`` seeds :func:`numpy.random.default_rng`; the result is a pure function of the
  arguments.

It returns a :class:`Partition`: a ``dict`` mapping client ids ``"0"``, ``"1"``, ... (strings,
in order) to sorted ``int64`` arrays of row *positions* (``iloc`` positions, ``0 ..
len(table) - 1``), with the human-readable client names in :attr:`Partition.names`. Every
row goes to exactly one client (disjoint and complete); the exceptions are
:func:`label_skew` with ``allow_unassigned=True``, which drops the rows of labels no client
owns, and :func:`class_sample`, whose leftover rows become the global test set
(:attr:`Partition.rest`). Bad input raises :class:`PartitionError` naming the parameter and what was expected.

Every built-in partitioner also takes ``group_column`` (default ``"subject_id"``, the
engine passes ``fl.group_column``): rows sharing its value (one patient's or lesion's
images) go to one client, so no subject trains at two sites and ``cross_test`` never scores
a model on its own subject's images. A group counts for its most frequent label (ties: the
largest); sizes and ``min_size`` count rows; a blank cell (NaN) makes its row a group of its
own; a table without the default column, or ``group_column=None``, is dealt row by row, and
so is one with one row per group (the draw is then exactly the row-level one). Each
partitioner's docstring says how grouping bends its statistics.

The built-in partitioners are listed in :data:`PARTITIONERS`. :func:`partition_table` turns a
partition into a table that can be saved (and :func:`partition_from_table` reads it back),
:func:`class_counts` tabulates labels per client, :func:`stratified_split` splits one
client's rows into e.g. train/val/test, and :func:`per_class_holdout` holds out a fixed
number of rows per class as a test set (the engine's ``global_test_per_class``).

The package holds one module per family, each importable on its own:
:mod:`~medfl.data.partition.skew` (:func:`dirichlet`, :func:`label_skew`,
:func:`quantity_skew`, :func:`iid`), :mod:`~medfl.data.partition.rules` (:func:`natural`,
:func:`subset`, :func:`class_sample`), :mod:`~medfl.data.partition.splits` (local splits and
the per-class holdout) and :mod:`~medfl.data.partition.tables` (saved tables), over
:mod:`~medfl.data.partition.base` (:class:`Partition`, the shared checks) and
:mod:`~medfl.data.partition.groups` (dealing whole groups). A new partitioner goes in the
module of its family (or a plugin's own module) and, when built in, in :data:`PARTITIONERS`.
"""

from __future__ import annotations

from collections.abc import Callable

from medfl.data.partition.base import REST_ROLES  # noqa: F401 - importable from here, as before
from medfl.data.partition.base import Partition, PartitionError, check_partition
from medfl.data.partition.groups import DEFAULT_GROUP_COLUMN
from medfl.data.partition.rules import class_sample, natural, subset
from medfl.data.partition.skew import dirichlet, iid, label_skew, quantity_skew
from medfl.data.partition.splits import grouped_stratified_split, per_class_holdout, stratified_split
from medfl.data.partition.tables import class_counts, partition_from_table, partition_table

__all__ = [
    "DEFAULT_GROUP_COLUMN", "grouped_stratified_split", "PARTITIONERS", "Partition", "PartitionError",
    "check_partition", "class_counts", "class_sample", "dirichlet", "iid", "label_skew", "natural",
    "partition_from_table", "partition_table", "per_class_holdout", "quantity_skew", "stratified_split", "subset",
]


#: The built-in partitioners by name.
PARTITIONERS: dict[str, Callable[..., Partition]] = {
    f.__name__: f for f in (dirichlet, label_skew, quantity_skew, iid, natural, class_sample, subset)}

