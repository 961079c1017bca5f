"""The content guard's numbers: how many probes a sample gets, how long they are, and from
which strength a label vector or an image found in a message counts (what each one means:
the package's docstring, :mod:`medfl.guard`).

Every module of :mod:`medfl.guard` reads them from here; ``medfl.guard`` re-exports them.
"""

from __future__ import annotations

__all__ = ["LABEL_MIN_BITS", "VALUE_PROBES", "MIN_VALUE_PROBES", "GRAM", "GRAM_POSITIONS", "IMAGE_FRACTION",
           "LOADER_EPOCHS", "PLANE_PIXELS", "PLANE_MIN_CORR", "PLANE_MIN_SIDE", "CROP", "CROP_KEYS"]

#: A label vector found in a message counts when a chance match anywhere in the message
#: would have probability below ``2 ** -LABEL_MIN_BITS`` (see :mod:`medfl.guard`).
LABEL_MIN_BITS = 16.0
#: Probe values kept per sample.
VALUE_PROBES = 16
#: A sample with fewer distinct non-round values gets exact gram probes instead.
MIN_VALUE_PROBES = 8
#: Length of a gram probe (consecutive pixels along one axis).
GRAM = 8
#: Gram probes per axis, per sample and precision.
GRAM_POSITIONS = 8
#: Fraction of a sample's probes that must occur in a message for it to be recognised.
IMAGE_FRACTION = 0.5
#: Training-loader epochs whose sample order is also a reference label order.
LOADER_EPOCHS = 3
#: Pixels of a plane signature (fixed positions per view shape, fewer in views this small).
PLANE_PIXELS = 128
#: Correlation (over a signature's pixels) from which a plane of a message is a sample's view.
PLANE_MIN_CORR = 0.95
#: Smallest side of a view that gets plane signatures.
PLANE_MIN_SIDE = 8
#: Side of the smallest crop recognised by crop probes (runs of this many pixels).
CROP = 4
#: Crop probes kept per sample (every crop position of images up to about 45 x 45).
CROP_KEYS = 512

_VARIANTS = ("f16", "bf16", "exact")
_AXES = 8                          # gram groups: sample * _AXES + axis
