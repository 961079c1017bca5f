"""Feature-exposing ResNets (built from MONAI's blocks, imported when one is built) and a
small CNN (plain torch layers: building one does not import MONAI).

Every model here follows the :class:`FeatureModel` protocol used by medfl's methods:

* ``forward(x)`` returns logits of shape ``(B, num_classes)``;
* ``forward_features(x)`` returns ``(logits, [stage outputs])`` where each stage output has
  shape ``(B, C_i, *spatial_i)``;
* ``embed(x)`` returns the pooled, flattened features fed to the head, shape ``(B, embed_dim)``;
* the classifier is the :class:`torch.nn.Linear` attribute ``head``, so every state-dict key
  of the head starts with ``head_prefix == "head."`` and every other key belongs to the body
  (``body_keys()`` / ``head_keys()`` partition ``state_dict().keys()``).

State-dict keys depend only on the architecture's *depth* (and norm type), never on ``width``:
two models of the same depth but different widths (e.g. 64 / 62 / 60 for heterogeneous
clients) have identical keys and differently shaped tensors.

Example:
    >>> import torch
    >>> m = resnet18(spatial_dims=2, in_channels=1, num_classes=3, width=8).eval()
    >>> logits, feats = m.forward_features(torch.zeros(2, 1, 32, 32))
    >>> tuple(logits.shape), [f.shape[1] for f in feats]
    ((2, 3), [8, 16, 32, 64])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

# MONAI is imported where a ResNet is built, not here: ``import monai`` loads every MONAI
# subpackage (with SciPy, scikit-image and matplotlib: 3 s on a slow CPU), and loading medfl's
# plugins, the ``medfl`` command and every Flower process would pay it for jobs that build
# no ResNet.

__all__ = ["FeatureModel", "FeatureResNet", "SmallCNN", "RESNET_DEPTHS", "resnet10", "resnet18", "resnet34", "resnet50",
           "small_cnn", "split_state_dict"]

#: Supported ResNet depths -> (MONAI block name, blocks per stage): ``"basic"`` is MONAI's
#: ``ResNetBlock``, ``"bottleneck"`` its ``ResNetBottleneck`` (expansion 4).
RESNET_DEPTHS: dict[int, tuple[str, list[int]]] = {
    10: ("basic", [1, 1, 1, 1]),
    18: ("basic", [2, 2, 2, 2]),
    34: ("basic", [3, 4, 6, 3]),
    50: ("bottleneck", [3, 4, 6, 3]),
}

_NORMS = ("batch", "instance")
_SPATIAL_DIMS = (2, 3)

# The torch layers MONAI's factories give for these names and dimensions (``Conv[Conv.CONV,
# d]``, ``Pool[Pool.MAX, d]``, ``Pool[Pool.ADAPTIVEAVG, d]``, ``get_norm_layer(name=norm,
# spatial_dims=d, channels=c)`` -> ``BatchNormNd(c)`` / ``InstanceNormNd(c)``): the small CNNs
# are built from them without importing MONAI, and the ResNets' own norm layers come from them.
_CONV: dict[int, type[nn.Module]] = {2: nn.Conv2d, 3: nn.Conv3d}
_MAX_POOL: dict[int, type[nn.Module]] = {2: nn.MaxPool2d, 3: nn.MaxPool3d}
_ADAPTIVE_AVG_POOL: dict[int, type[nn.Module]] = {2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}
_NORM: dict[str, dict[int, type[nn.Module]]] = {
    "batch": {2: nn.BatchNorm2d, 3: nn.BatchNorm3d},
    "instance": {2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d},
}


@runtime_checkable
class FeatureModel(Protocol):
    """Structural type of the models medfl trains.

    Attributes:
        head: The classifier module (normally :class:`torch.nn.Linear`).
        head_prefix: Prefix of the head's state-dict keys (``"head."``).
    """

    head: nn.Module
    head_prefix: str

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape ``(B, num_classes)``."""
        ...

    def forward_features(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Logits and the intermediate stage outputs ``(B, C_i, *spatial_i)``."""
        ...

    def embed(self, x: Tensor) -> Tensor:
        """Pooled features before the head, shape ``(B, D)``."""
        ...

    def body_keys(self) -> list[str]:
        """State-dict keys not belonging to the head."""
        ...

    def head_keys(self) -> list[str]:
        """State-dict keys of the head (all start with ``head_prefix``)."""
        ...


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------


def _check_int(name: str, value: Any, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> Any:
    if isinstance(value, bool) or value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {valid}, got {value!r}")
    return value


def _check_io(spatial_dims: Any, in_channels: Any, num_classes: Any) -> None:
    """Check the arguments every model here takes (the message names the argument)."""
    _check_choice("spatial_dims", spatial_dims, _SPATIAL_DIMS)
    _check_int("in_channels", in_channels)
    _check_int("num_classes", num_classes)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
    return value


def _key_split(keys: list[str], head_prefix: str) -> tuple[list[str], list[str]]:
    body = [k for k in keys if not k.startswith(head_prefix)]
    head = [k for k in keys if k.startswith(head_prefix)]
    return body, head


def _init_weights(module: nn.Module) -> None:
    """MONAI ResNet's init: Kaiming (fan_out) convs, unit/zero affine norms, zero Linear bias."""
    for m in module.modules():
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)):
            if getattr(m, "weight", None) is not None:
                nn.init.constant_(m.weight, 1.0)
            if getattr(m, "bias", None) is not None:
                nn.init.constant_(m.bias, 0.0)
        elif isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.constant_(m.bias, 0.0)


class _KeysMixin:
    """``head_prefix``, ``body_keys()`` and ``head_keys()`` for an :class:`nn.Module`."""

    head_prefix: str = "head."

    def body_keys(self) -> list[str]:
        """State-dict keys of the body (everything except the head), in state-dict order."""
        keys = list(self.state_dict().keys())  # type: ignore[attr-defined]
        return _key_split(keys, self.head_prefix)[0]

    def head_keys(self) -> list[str]:
        """State-dict keys of the head (all start with :attr:`head_prefix`), in state-dict order."""
        keys = list(self.state_dict().keys())  # type: ignore[attr-defined]
        return _key_split(keys, self.head_prefix)[1]


# --------------------------------------------------------------------------------------------
# ResNet
# --------------------------------------------------------------------------------------------


class FeatureResNet(_KeysMixin, nn.Module):
    """A MONAI ResNet re-assembled so its stage outputs, embedding and head are accessible.

    The module tree is ``conv1, bn1, act, maxpool, layer1..layer4, avgpool, head``. The stem
    and stages are taken from a :class:`monai.networks.nets.ResNet` instance (shortcut type
    ``"B"``, i.e. 1x1 conv + norm projections) and initialised as MONAI does; MONAI's own
    ``forward`` is never called. With ``norm="instance"`` the stem norm is replaced and the
    stages are rebuilt from MONAI's ``ResNetBlock`` / ``ResNetBottleneck`` so every norm layer
    is an instance norm (MONAI 1.x applies ``norm`` only to the stem and fails to initialise
    it). MONAI's instance norm has no affine parameters and no running statistics.

    Args:
        depth: One of 10, 18, 34 (basic blocks) or 50 (bottleneck blocks, expansion 4).
            Blocks per stage: 10 -> [1,1,1,1], 18 -> [2,2,2,2], 34 and 50 -> [3,4,6,3].
        spatial_dims: 2 (inputs ``(B, C, H, W)``) or 3 (inputs ``(B, C, D, H, W)``).
        in_channels: Number of input channels. Default 1.
        num_classes: Number of output logits. Default 2.
        width: First-stage channels ``w``; stage widths are ``[w, 2w, 4w, 8w]`` (times 4 for
            depth 50). Default 64.
        conv1_kernel: Kernel size of the stem convolution (padding ``k // 2``). Default 7.
        conv1_stride: Stride of the stem convolution. Default 2.
        no_max_pool: Skip the stem's 3x3 stride-2 max-pool. Default False.
        norm: ``"batch"`` (default) or ``"instance"``.

    Attributes:
        feature_channels: Channel counts of the four stage outputs.
        embed_dim: Length of the :meth:`embed` vector (``feature_channels[-1]``).
        head: ``nn.Linear(embed_dim, num_classes)``.

    Raises:
        ValueError: If an argument is out of range; the message names the argument.
    """

    head_prefix: str = "head."

    def __init__(
        self,
        depth: int = 18,
        spatial_dims: int = 2,
        in_channels: int = 1,
        num_classes: int = 2,
        width: int = 64,
        conv1_kernel: int = 7,
        conv1_stride: int = 2,
        no_max_pool: bool = False,
        norm: str = "batch",
    ) -> None:
        super().__init__()
        _check_choice("depth", depth, tuple(RESNET_DEPTHS))
        _check_io(spatial_dims, in_channels, num_classes)
        _check_int("width", width)
        _check_int("conv1_kernel", conv1_kernel)
        _check_int("conv1_stride", conv1_stride)
        _check_bool("no_max_pool", no_max_pool)
        _check_choice("norm", norm, _NORMS)

        from monai.networks.nets.resnet import ResNet, ResNetBlock, ResNetBottleneck

        block_name, layers = RESNET_DEPTHS[depth]
        block = ResNetBottleneck if block_name == "bottleneck" else ResNetBlock
        inplanes = [width, 2 * width, 4 * width, 8 * width]
        net = ResNet(
            block=block,
            layers=layers,
            block_inplanes=inplanes,
            spatial_dims=spatial_dims,
            n_input_channels=in_channels,
            conv1_t_size=conv1_kernel,
            conv1_t_stride=conv1_stride,
            no_max_pool=no_max_pool,
            shortcut_type="B",
            num_classes=num_classes,
            feed_forward=False,
            norm="batch",  # MONAI 1.x cannot initialise an affine-less instance norm itself
        )

        self.depth = depth
        self.spatial_dims, self.in_channels, self.num_classes = spatial_dims, in_channels, num_classes
        self.width = width
        self.norm = norm
        self.no_max_pool = no_max_pool

        self.conv1 = net.conv1
        self.bn1 = net.bn1 if norm == "batch" else _NORM[norm][spatial_dims](width)
        self.act = net.act
        self.maxpool = net.maxpool
        if norm == "batch":
            stages = [net.layer1, net.layer2, net.layer3, net.layer4]
        else:
            stages = self._build_stages(block, layers, inplanes, spatial_dims, norm)
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = net.avgpool

        self.feature_channels: list[int] = [c * block.expansion for c in inplanes]
        self.embed_dim: int = self.feature_channels[-1]
        self.head = nn.Linear(self.embed_dim, num_classes)
        _init_weights(self)

    @staticmethod
    def _build_stages(
        block: type[nn.Module],
        layers: list[int],
        inplanes: list[int],
        spatial_dims: int,
        norm: str,
    ) -> list[nn.Sequential]:
        """The four stages of MONAI's ``block`` with ``norm`` everywhere; module layout as
        MONAI's ``_make_layer``."""
        conv_type = _CONV[spatial_dims]
        stages: list[nn.Sequential] = []
        in_planes = inplanes[0]
        for i, (planes, n_blocks) in enumerate(zip(inplanes, layers)):
            stride = 1 if i == 0 else 2
            out_planes = planes * block.expansion
            downsample: nn.Module | None = None
            if stride != 1 or in_planes != out_planes:
                downsample = nn.Sequential(
                    conv_type(in_planes, out_planes, kernel_size=1, stride=stride, bias=True),
                    _NORM[norm][spatial_dims](out_planes),
                )
            blocks: list[nn.Module] = [
                block(
                    in_planes=in_planes,
                    planes=planes,
                    spatial_dims=spatial_dims,
                    stride=stride,
                    downsample=downsample,
                    norm=norm,
                )
            ]
            in_planes = out_planes
            for _ in range(1, n_blocks):
                blocks.append(block(in_planes, planes, spatial_dims=spatial_dims, norm=norm))
            stages.append(nn.Sequential(*blocks))
        return stages

    def _stem(self, x: Tensor) -> Tensor:
        x = self.act(self.bn1(self.conv1(x)))
        if not self.no_max_pool:
            x = self.maxpool(x)
        return x

    def _stages(self, x: Tensor) -> list[Tensor]:
        feats: list[Tensor] = []
        for layer in (self.layer1, self.layer2, self.layer3, self.layer4):
            x = layer(x)
            feats.append(x)
        return feats

    def _pool(self, x: Tensor) -> Tensor:
        return torch.flatten(self.avgpool(x), 1)

    def forward_features(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Logits and the four stage outputs.

        Args:
            x: Input of shape ``(B, in_channels, *spatial)``.

        Returns:
            ``(logits, [f1, f2, f3, f4])`` with logits ``(B, num_classes)`` and
            ``f_i`` of shape ``(B, feature_channels[i], *spatial_i)``.
        """
        feats = self._stages(self._stem(x))
        return self.head(self._pool(feats[-1])), feats

    def embed(self, x: Tensor) -> Tensor:
        """Globally average-pooled last-stage features, shape ``(B, embed_dim)``."""
        return self._pool(self._stages(self._stem(x))[-1])

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape ``(B, num_classes)`` for input ``(B, in_channels, *spatial)``."""
        return self.head(self.embed(x))

    def extra_repr(self) -> str:
        return (
            f"depth={self.depth}, spatial_dims={self.spatial_dims}, width={self.width}, "
            f"norm={self.norm!r}"
        )


# --------------------------------------------------------------------------------------------
# SmallCNN
# --------------------------------------------------------------------------------------------


class _TwoBlocks(_KeysMixin, nn.Module):
    """The forward passes of the two-block CNNs (:class:`SmallCNN`, and
    :class:`~medfl.models.cnn.TwoBlockCNN`): ``layer1``, ``layer2``, then :meth:`_embed_from`
    (the pooled, flattened second-block output) and ``head``."""

    def _embed_from(self, f2: Tensor) -> Tensor:
        return torch.flatten(self.avgpool(f2), 1)

    def forward_features(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Logits ``(B, num_classes)`` and the two block outputs ``[f1, f2]``: each block halves
        every spatial side (floored), so ``f1`` is ``(B, C_1, *spatial/2)`` and ``f2``
        ``(B, C_2, *spatial/4)``."""
        f1 = self.layer1(x)
        f2 = self.layer2(f1)
        return self.head(self._embed_from(f2)), [f1, f2]

    def embed(self, x: Tensor) -> Tensor:
        """The features fed to the head, shape ``(B, embed_dim)``."""
        return self._embed_from(self.layer2(self.layer1(x)))

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape ``(B, num_classes)`` for input ``(B, in_channels, *spatial)``."""
        return self.head(self.embed(x))


class SmallCNN(_TwoBlocks):
    """A cheap two-block CNN following the :class:`FeatureModel` protocol.

    Module tree: ``layer1`` = conv3x3(in, w) -> norm -> ReLU -> maxpool(2),
    ``layer2`` = conv3x3(w, 2w) -> norm -> ReLU -> maxpool(2), ``avgpool`` (global average),
    ``head`` = ``nn.Linear(2w, num_classes)``. Each spatial side must be at least 4.

    Args:
        spatial_dims: 2 or 3. Default 2.
        in_channels: Number of input channels. Default 1.
        num_classes: Number of output logits. Default 2.
        width: Channels of the first block (second block has ``2 * width``). Default 16.
        norm: ``"batch"`` (default) or ``"instance"``.

    Attributes:
        feature_channels: ``[width, 2 * width]``.
        embed_dim: ``2 * width``.

    Raises:
        ValueError: If an argument is out of range; the message names the argument.
    """

    head_prefix: str = "head."

    def __init__(
        self,
        spatial_dims: int = 2,
        in_channels: int = 1,
        num_classes: int = 2,
        width: int = 16,
        norm: str = "batch",
    ) -> None:
        super().__init__()
        _check_io(spatial_dims, in_channels, num_classes)
        _check_int("width", width)
        _check_choice("norm", norm, _NORMS)
        self.spatial_dims, self.in_channels, self.num_classes = spatial_dims, in_channels, num_classes
        self.width = width
        self.norm = norm

        conv_type = _CONV[spatial_dims]
        pool_type = _MAX_POOL[spatial_dims]
        avgp_type = _ADAPTIVE_AVG_POOL[spatial_dims]
        norm_type = _NORM[norm][spatial_dims]

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                conv_type(cin, cout, kernel_size=3, padding=1, bias=False),
                norm_type(cout),
                nn.ReLU(inplace=True),
                pool_type(kernel_size=2, stride=2),
            )

        self.layer1 = block(in_channels, width)
        self.layer2 = block(width, 2 * width)
        self.avgpool = avgp_type(1)
        self.feature_channels: list[int] = [width, 2 * width]
        self.embed_dim: int = 2 * width
        self.head = nn.Linear(self.embed_dim, num_classes)
        _init_weights(self)


# --------------------------------------------------------------------------------------------
# factories and helpers
# --------------------------------------------------------------------------------------------


def _resnet_factory(depth: int, doc: str) -> Callable[..., FeatureResNet]:
    """The model factory ``resnet<depth>``: :class:`FeatureResNet` of that depth, every other
    option of its ``__init__`` as a keyword argument. The factory carries that signature
    (``__signature__``), so a config's model parameters are checked against the options
    themselves (unknown names refused, ``no_max_pool`` read as a boolean) before a run starts."""

    def factory(**kw: Any) -> FeatureResNet:
        return FeatureResNet(depth, **kw)

    init = inspect.signature(FeatureResNet.__init__)
    options = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for n, p in init.parameters.items()
               if n not in ("self", "depth")]
    factory.__signature__ = init.replace(parameters=options, return_annotation="FeatureResNet")  # type: ignore[attr-defined]
    factory.__name__ = factory.__qualname__ = f"resnet{depth}"
    factory.__doc__ = doc
    return factory


resnet10 = _resnet_factory(10, "ResNet-10 (basic blocks [1,1,1,1]); options as :class:`FeatureResNet`'s.")
resnet18 = _resnet_factory(18, "ResNet-18 (basic blocks [2,2,2,2]); options as :class:`FeatureResNet`'s.")
resnet34 = _resnet_factory(34, "ResNet-34 (basic blocks [3,4,6,3]); options as :class:`FeatureResNet`'s.")
resnet50 = _resnet_factory(50, "ResNet-50 (bottleneck blocks [3,4,6,3], stage channels ``4 * [w, 2w, 4w, 8w]``); "
                               "options as :class:`FeatureResNet`'s.")


def small_cnn(
    *, spatial_dims: int = 2, in_channels: int = 1, num_classes: int = 2, width: int = 16,
    norm: str = "batch",
) -> SmallCNN:
    """A :class:`SmallCNN`; ``norm`` is ``"batch"`` (default) or ``"instance"``."""
    return SmallCNN(spatial_dims, in_channels, num_classes, width, norm)


def split_state_dict(
    model_or_state: nn.Module | Mapping[str, Tensor], head_prefix: str = "head."
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Split a state dict into ``(body, head)`` by key prefix.

    Args:
        model_or_state: A module (its ``state_dict()`` is used) or a state-dict mapping.
        head_prefix: Keys starting with this prefix go to the head. Default ``"head."``.

    Returns:
        ``(body, head)``: two new dicts (same tensors, not copies) whose keys partition the
        input's keys, each in the input's order.
    """
    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else model_or_state
    body: dict[str, Tensor] = {}
    head: dict[str, Tensor] = {}
    for k, v in state.items():
        (head if k.startswith(head_prefix) else body)[k] = v
    return body, head
