"""The content guard: recognise a client's own labels and images in what leaves the client.

A method's client code runs where the data is, so no rule on what a message *looks like*
can stop a plugin that means to leak (what protects a site is its operator approving the
code that runs there, :mod:`medfl.approval`, and differential privacy on what leaves). This
guard catches *mistakes*: a plugin that puts the client's labels or images in a reply, its
metrics or an evaluation model, whatever the dtype, shape or container. It compares the
*content* of everything that leaves with the client's own data, and never refuses a tensor
because of its shape, so model weights of any dtype pass.

What is compared (:class:`ContentGuard`, built lazily from the client's datasets and cached
per dataset for the life of the process):

Labels
    each split's label vector (from the dataset's ``labels`` or its items) and, for the
    training split, the same vector in the order of the client's seeded training loader
    (first epochs), which is how a plugin collecting ``y`` from its batches would send it.
    Every tensor, every list of numbers and the run of all scalars of the message (a dict
    of per-sample metrics) is scanned, flattened row- and (2-D) column-major, as ints,
    floats or bools, for a split's labels as a contiguous run (inside padding too); a 2-D
    block (or a 1-D vector of ``n * K`` values) holding one-hot rows or class
    probabilities is also read through its argmax along either axis. A match counts only
    if it is improbable by chance. Its *surprise* is ``-sum_i log2 q(y_i) - log2(places it
    could start)``, with ``q`` the frequency of each label value among the scanned sequence's
    label-like values (integers in the labels' range, where alone a run can match; the whole
    sequence for an argmax reading): the probability of the match if those values were random
    with their own frequencies; it must reach :data:`LABEL_MIN_BITS` plus ``log2`` of the number of
    (sequence, label vector) tests in the message that could have matched. So a chance
    match has probability below ``2 ** -16`` per message even in tensors made of 0/1
    values (1-bit quantised weights); a constant label vector (surprise 0) never counts.
    The price: a split whose label vector carries fewer bits (fewer than about 20-30
    balanced binary samples) is not recognised.
Images
    for each sample of each split (seen without training augmentation), up to
    :data:`VALUE_PROBES` *probe values*: exact float32 bit patterns of distinct pixel values
    drawn from the brighter half of the sample, keeping only values that float16 and
    bfloat16 cannot represent (``0``, ``1``, ``0.5``, small integers... also occur in
    weights). A float32/float64/integer tensor (and the message's scalars) hits a probe
    when the value occurs anywhere in it: order, shape, transposition and splitting across
    several tensors do not matter, hits are pooled over the whole message. A sample is
    recognised when at least half of its probes (and at least 4) are hit; samples with
    fewer than :data:`MIN_VALUE_PROBES` usable values have no value probes.

    float16/bfloat16 tensors cannot be compared value by value (65,536 codes: a large
    tensor holds most of them), so each sample also has *gram probes*: runs of
    :data:`GRAM` consecutive pixels along each axis (both directions), rounded to float16
    and to bfloat16, at up to :data:`GRAM_POSITIONS` places per axis; a low-precision
    tensor hits a gram probe when the same run occurs in it flattened (a flattened,
    channel-squeezed or transposed image keeps the runs of one axis). Samples with too few
    distinct non-round values for value probes (integer-valued or heavily quantised
    images) get exact (float32) gram probes instead. Runs with fewer than 3 distinct values
    or more than half zeros are not used as probes (backgrounds, constant regions). A
    sample is recognised when half of its gram positions along one axis (at least 3) occur.
Images, transformed (issue 38: the plain mistakes of a careless plugin)
    *plane signatures*: for each channel of each sample (a 2D image or a 3D volume) and
    for three views of it (the plane itself; halved along every axis by ``2 x 2`` means,
    which average pooling, area and bilinear resizing by 1/2 compute; and every second
    pixel, which nearest resizing by 1/2 keeps), the values at :data:`PLANE_PIXELS` fixed
    positions of the view, centred and scaled to norm 1. A tensor of the message is read
    as planes of a view's shape where its shape allows (last dimensions, flattened planes,
    a vector of several planes, channel-last; dimensions of 1 dropped), the same positions
    are read from each plane, and a plane whose Pearson correlation with a sample's
    signature reaches :data:`PLANE_MIN_CORR` is that sample: correlation does not change
    under scaling and offset, and hardly under uint8 quantisation (per-image min-max) or
    small noise. Signatures whose values are not varied and spread enough (a quarter of
    the positions at least distinct, no value on more than three quarters: backgrounds,
    masks; 8 pixels carrying more than 90 % of the variance) are not kept
    (:func:`~medfl.guard.probes._standardised`); a plane of independent random values
    correlates above 0.95 with a kept signature of 64 (128) pixels with odds of about
    ``1e-32`` (``1e-64``), the fraction of the sphere within that angle.

    *crop probes*: 64-bit keys of runs of :data:`CROP` exact float32 pixels along the last
    axis (first channel), starting at every pixel of every line whose other coordinates
    are multiples of :data:`CROP`, so every crop of at least ``CROP`` pixels a side holds
    one; runs of values float16/bfloat16 represent exactly are left out (they occur in
    weights), and :data:`CROP_KEYS` are kept per sample: every start in an image up to
    about 45 x 45; in a larger one every ``step``-th start of each line from a random
    offset, so every crop ``step + 3`` pixels wide is caught (11 x 11 in 128 x 128), a 4 x 4
    crop with odds ``1 / step`` per sample of a batch of crops. One key found in the message's
    float32/float64 tensors or lists recognises the sample (a chance match of 4 exact
    non-round values has odds of about ``2 ** -64``). A message is prefiltered on each
    run's largest pixel (one bit a slot, up to 2 MiB).

What it does not recognise is listed in ``docs/flower.md`` ("What the payload guard and
approvals protect"): images transformed otherwise than above (intensity augmentation,
other resampling filters and factors, rotations, crops of transformed images), images
placed in a tensor off a plane's boundary, images whose pixels take very few distinct
values (binary masks), labels re-encoded (offset, permuted, hashed) or in an order other
than the dataset's and the loader's, per-sample features computed from the images, and
anything encoded on purpose (labels XOR a constant, low mantissa bits, values hidden as
small weight deltas): no check of content reaches those, and approval of the code and
differential privacy are the protection.

Cost (``benchmarks/payload_guard.py``, 2-core VM, one thread; ``benchmarks/README.md`` has
the figures before and after the plane signatures and crop probes): building the reference
reads every sample once per process (about 1-3 ms per 128x128 image, reading included) and
keeps about 9 KB per sample (1.5 KB of value and gram probes, the rest plane signatures and
crop probes) plus up to 3 MiB of lookup tables per client; checking a ResNet-18 reply
(11.2 M values) takes about 20 ms in float32 on an idle machine before the crop probes and
about 20 ms more with them (large float32 tensors are read in place, in cache-sized steps),
65 ms in int8, 0.35 s in float16/bfloat16.

Where (issue 50): a message whose tensors are on a GPU is scanned there, with torch
(:mod:`medfl.guard.device`): the label-like and negative values of every tensor counted in
one pass, value probes, crop probes' largest pixels and gram keys looked up through the same
prefilter tables and then exactly (sorted probes, ``torch.searchsorted``), plane signatures
read at their positions only; what comes off the device is what the scans found (a handful
of positions and keys in a model's weights), the per-tensor counts and the tensors that may
hold labels. The reference itself is built on the host, once per client and process (a
round-1 cost), and its tables are copied to the device once. A CPU message is scanned with
NumPy as before. Every check decides on the host with the same rules, so the verdict and the
error are the same on both paths (``tests/engine/test_guard_device_scan.py`` holds every leak
form of the catch tests to it, on the CPU device and on a GPU where there is one);
``MEDFL_GUARD_SCAN`` (``auto``, ``device``, ``host``) chooses the path.

The package, bottom up (each module imports only those listed before it):
:mod:`~medfl.guard.params` the numbers above; :mod:`~medfl.guard.probes` a sample's probes;
:mod:`~medfl.guard.reference` a split's reference (:func:`build_split_reference`);
:mod:`~medfl.guard.index` a client's splits merged, with prefilter tables, and the caches;
:mod:`~medfl.guard.walk` the traversal of a message and its float values;
:mod:`~medfl.guard.device` the scans on the tensors' device; :mod:`~medfl.guard.labels` the
label check; :mod:`~medfl.guard.images` the image checks; and this module, on top:
:class:`ContentGuard`, which runs them, and :func:`loader_orders`. Names with a leading
underscore are the package's own: its modules import them, code outside it should not.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from medfl.guard.device import _DeviceFloats, _scan_device
from medfl.guard.images import _ImageCheck
from medfl.guard.index import (
    _CACHE, _CACHE_MAX, _MERGED, _MERGED_BYTES, _cached_reference, _Index, _lru_get, _lru_put, _merge,
    clear_reference_cache,
)
from medfl.guard.labels import _LabelCheck
from medfl.guard.params import (
    _AXES, CROP, CROP_KEYS, GRAM, GRAM_POSITIONS, IMAGE_FRACTION, LABEL_MIN_BITS, LOADER_EPOCHS, MIN_VALUE_PROBES,
    PLANE_MIN_CORR, PLANE_MIN_SIDE, PLANE_PIXELS, VALUE_PROBES,
)
from medfl.guard.reference import SplitReference, build_split_reference
from medfl.guard.walk import _Floats, _Leaves, _walk

__all__ = ["ContentGuard", "SplitReference", "LABEL_MIN_BITS", "VALUE_PROBES", "GRAM", "GRAM_POSITIONS",
           "IMAGE_FRACTION", "PLANE_PIXELS", "PLANE_MIN_CORR", "PLANE_MIN_SIDE", "CROP", "CROP_KEYS",
           "build_split_reference", "clear_reference_cache", "loader_orders"]


# ---------------------------------------------------------------------- the guard
class ContentGuard(_LabelCheck, _ImageCheck):
    """Recognise a client's own labels and images in an outgoing message.

    Args:
        client_id: the client, for messages.
        datasets: the client's splits: name -> a dataset or a function building it (called
            at the first check; build it without training augmentation).
        loader_orders: per split, the sample orders of the client's training loader (the
            label vector in these orders is looked for too), or a function returning them.

    The reference of each dataset is built at the first check (one pass over its samples)
    and cached for the process, keyed by what the dataset holds.
    """

    def __init__(self, client_id: str, datasets: dict[str, Dataset | Callable[[], Dataset]],
                 loader_orders: dict[str, list[np.ndarray]] | Callable[[], dict[str, list[np.ndarray]]] | None = None
                 ) -> None:
        self.client_id = str(client_id)
        self._datasets = dict(datasets)
        self._orders = loader_orders
        self._index: _Index | None = None
        self._labels: list[tuple[str, np.ndarray]] = []
        self._varied: tuple[list[tuple[str, np.ndarray]], list[tuple[str, np.ndarray]]] | None = None

    @classmethod
    def for_client(cls, ctx: Any) -> "ContentGuard":
        """The guard of a :class:`~medfl.engine.client.ClientContext`: its splits seen
        without augmentation, and the orders of its training loader's first epochs."""
        splits = list(ctx.datasets)

        def plain(split: str) -> Callable[[], Dataset]:
            def build() -> Dataset:
                try:
                    return ctx.dataset(split, augment=False)
                except TypeError:   # a dataset factory without an augment switch
                    return ctx.dataset(split)
            key = getattr(ctx.datasets.get(split), "guard_key", None)
            if key:
                build.guard_key = key  # type: ignore[attr-defined]
            return build

        def orders() -> dict[str, list[np.ndarray]]:
            if "train" not in splits:
                return {}
            epochs = min(int(ctx.train.get("epochs", 1) or 1), LOADER_EPOCHS)
            try:
                return {"train": loader_orders(ctx.loader("train"), epochs)}
            except Exception:  # noqa: BLE001 - no loader to replay: the dataset order only
                return {}

        return cls(ctx.client_id, {s: plain(s) for s in splits}, orders)

    # -------------------------------------------------------------- reference
    def index(self) -> _Index:
        """The merged image reference of the client's splits (built on first use; the
        label vectors to look for are set at the same time)."""
        if self._index is None:
            refs, keys = [], []
            for split, ds in self._datasets.items():
                # a factory that names its samples (``guard_key``: the engine's datasets, the
                # same every round) is not built again once its reference is cached
                hint = getattr(ds, "guard_key", None) if callable(ds) and not isinstance(ds, Dataset) else None
                ref = _lru_get(_CACHE, f"key:{hint}") if hint else None
                if ref is not None:
                    key = f"key:{hint}"
                else:
                    if callable(ds) and not isinstance(ds, Dataset):
                        ds = ds()
                    key, ref = _cached_reference(ds)
                    if hint:
                        _lru_put(_CACHE, f"key:{hint}", ref, _CACHE_MAX)
                        key = f"key:{hint}"
                refs.append((split, ref))
                keys.append(f"{split}:{key}")
            orders = self._orders() if callable(self._orders) else (self._orders or {})
            labels = []
            for split, ref in refs:
                labels.append((f"{split} split", ref.labels))
                for e, order in enumerate(orders.get(split, []), 1):
                    if len(order) == ref.n:
                        labels.append((f"{split} split, in the order of training epoch {e}", ref.labels[order]))
            merged = _lru_get(_MERGED, tuple(keys))
            if merged is None:
                merged = _merge(refs)
                _lru_put(_MERGED, tuple(keys), merged, _MERGED_BYTES, weight=lambda ix: ix.nbytes)
            self._labels, self._index = labels, merged
        return self._index

    def split_labels(self, split: str) -> np.ndarray | None:
        """The label vector of ``split`` in the dataset's order, as the guard reads it (the
        labels a declared per-sample release may send in the clear), or ``None`` for a split
        the client does not have."""
        self.index()
        return next((y for name, y in self._labels if name == f"{split} split"), None)

    def stats(self) -> dict[str, Any]:
        """Samples covered, probes and memory of the reference (reports, benchmarks)."""
        ix = self.index()
        protected = ix.vneed > 0
        if "exact" in ix.gneed:
            protected = protected | (ix.gneed["exact"].reshape(-1, _AXES) > 0).any(axis=1)
        ref_bytes = ix.vbits.nbytes + ix.vsample.nbytes + sum(y.nbytes for _, y in self._labels)
        ref_bytes += sum(k.nbytes + p.nbytes for k, p in ix.grams.values())
        ref_bytes += sum(g.nbytes for g in ix.ggroup.values())
        ref_bytes += sum(sig.nbytes + who.nbytes for sig, who in ix.planes.values()) + ix.ckeys.nbytes + ix.csample.nbytes
        tables = sum(t.nbytes for t in (ix.vtable, ix.ctable, *ix.gtable.values()) if t is not None)
        signed = np.zeros(len(ix.names), dtype=bool)
        for _, who in ix.planes.values():
            signed[who] = True
        return {"samples": len(ix.names), "unprotected_samples": int((~protected).sum()),
                "value_probes": int(ix.vbits.size),
                "gram_probes": {v: int(g[0].size) for v, g in ix.grams.items()},
                "plane_signatures": {f"{view} {'x'.join(map(str, shape))}": int(sig.shape[0])
                                     for (view, shape), (sig, _) in ix.planes.items()},
                "samples_without_plane_signature": int((~signed).sum()), "crop_probes": int(ix.ckeys.size),
                "label_vectors": len(self._labels), "reference_bytes": int(ref_bytes), "table_bytes": int(tables)}

    # -------------------------------------------------------------- the check
    def check(self, value: Any, where: str, exempt: frozenset[str] = frozenset()) -> None:
        """Refuse ``value`` if it holds the client's labels or images.

        Args:
            value: an outgoing message part (a reply's payload or metrics, a model state).
            where: its readable location, e.g. ``"reply of method 'x' from client 3"``.
            exempt: top-level keys not checked (a declared per-sample release's keys, whose
                noise medfl adds before they leave: ``SampleRelease``).

        Raises:
            PayloadError: naming the key path, the client, the split and what was found.
        """
        leaves = _Leaves()
        _walk(value, "", leaves, exempt, True)
        leaves.resolve()
        if not (leaves.tensors or leaves.scalars or leaves.stacks):
            return
        ix = self.index()
        device = _scan_device(leaves)   # a message on a GPU is scanned there (medfl.guard.device)
        tensors, stacks = [t for _, t in leaves.tensors], [t for _, t in leaves.stacks]
        floats = _Floats(tensors, stacks) if device is None else _DeviceFloats(tensors, stacks, device)
        self._check_labels(ix, leaves, where, floats)
        self._check_images(ix, leaves, where, floats)
        self._check_crops(ix, leaves, where, floats)
        self._check_planes(ix, leaves, where)

    def _fail(self, msg: str) -> None:
        from medfl.messages import PayloadError

        raise PayloadError(msg)


def loader_orders(loader: DataLoader, epochs: int) -> list[np.ndarray]:
    """The sample order of each of the first ``epochs`` passes over ``loader`` (a shuffling
    loader with its own generator, as :meth:`ClientContext.loader` builds), replayed on
    sample indices without reading a sample."""
    gen = getattr(loader, "generator", None)
    if gen is None or not isinstance(loader.sampler, torch.utils.data.RandomSampler):
        return []
    n = len(loader.dataset)  # type: ignore[arg-type]
    replay = torch.Generator()
    replay.set_state(gen.get_state())
    # one batch per pass: the order is the sampler's whatever the batch size (without
    # drop_last), and collating 1 batch instead of n / batch_size is what costs here
    idx = DataLoader(range(n), batch_size=max(n, 1), shuffle=True, generator=replay)  # type: ignore[arg-type]
    out = []
    for _ in range(max(0, epochs)):
        order = [b.reshape(-1) for b in idx]
        out.append(torch.cat(order).numpy() if order else np.zeros(0, dtype=np.int64))
    return out
