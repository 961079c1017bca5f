"""Issue 38, item 4: the plain mistakes a careless plugin makes with a client's images are
refused, and the built-in methods' real replies still never trigger the guard.

The content guard recognised exact copies only. A plugin that sent its training images
scaled by 0.5, converted to uint8 with a per-image min-max, halved in size (2 x 2 means or
every second pixel), cut into 4 x 4 crops, or with noise of 1e-6 added, passed it (main at
127d2a5: no PayloadError). Plane signatures (normalised pixels matched by correlation, of
the images and of their halved views) and crop probes (runs of exact pixels at every crop
position) catch them, in 2D and in 3D, naming the reply key and what matched.

The false-positive side: seven built-in methods run on three fixtures in the real on-disk
layouts (PathMNIST tiles, MIAS mammograms with their black background, 4-channel ABIDE
volumes); every message the guard saw in those runs (replies, metrics, scores, profiles)
is checked again quantised to int8 and to 2 bits, and none is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from medfl.engine.client import ClientContext, run_client_update
from medfl.guard import ContentGuard, clear_reference_cache
from medfl.messages import Instruction, PayloadError

from test_payload_guard import N, _ctx, _data, _Data, _Leak, _quantise, _x


def _minmax_uint8(x: torch.Tensor) -> torch.Tensor:
    """Each image mapped to 0..255 by its own minimum and maximum, as uint8."""
    flat = x.reshape(x.shape[0], -1)
    shape = (-1,) + (1,) * (x.dim() - 1)
    lo, hi = flat.min(dim=1).values.reshape(shape), flat.max(dim=1).values.reshape(shape)
    return ((x - lo) / (hi - lo) * 255).round().to(torch.uint8)


def _halved(x: torch.Tensor, mode: str) -> torch.Tensor:
    """``x`` (``(n, C, *spatial)``) resized by 1/2 with ``F.interpolate``."""
    return F.interpolate(x, scale_factor=0.5, mode=mode)


def _crops(x: torch.Tensor) -> torch.Tensor:
    """A 4-pixel-a-side crop of every image, each at its own place."""
    g = torch.Generator().manual_seed(9)
    out = []
    for img in x:
        at = [int(torch.randint(0, d - 3, (1,), generator=g)) for d in img.shape[1:]]
        out.append(img[(slice(None), *(slice(a, a + 4) for a in at))])
    return torch.stack(out)


def _noisy(x: torch.Tensor) -> torch.Tensor:
    return x + 1e-6 * torch.randn(x.shape, generator=torch.Generator().manual_seed(4))


#: The issue's plain mistakes, each with what the refusal says matched.
MISTAKES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "scaled x0.5": (lambda x: x * 0.5, r"correlates with its pixels"),
    "uint8 per-image min-max": (_minmax_uint8, r"correlates with its pixels"),
    "2x downsampled (2x2 means)": (lambda x: _halved(x, "area"), r"correlates with its 2 x 2 means"),
    "2x downsampled (nearest)": (lambda x: _halved(x, "nearest"),
                                 r"correlates with every second pixel of it|probe values"),
    "4x4 crops": (_crops, r"runs of 4 pixels \(crop probes"),
    "plus 1e-6 noise": (_noisy, r"correlates with its pixels"),
}


@pytest.fixture(scope="module")
def volumes() -> tuple[_Data, _Data]:
    """ABIDE-like 3D data: z-scored 1 x 16^3 volumes."""
    clear_reference_cache()
    return _data(N, (1, 16, 16, 16), seed=20, normal=True), _data(24, (1, 16, 16, 16), seed=21, normal=True)


@pytest.fixture(scope="module")
def images() -> tuple[_Data, _Data]:
    """2D data: 1 x 16 x 16 images."""
    clear_reference_cache()
    return _data(N, (1, 16, 16), seed=22), _data(24, (1, 16, 16), seed=23)


@pytest.mark.parametrize("dims", ["2d", "3d"])
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_plain_mistake_with_the_images_is_refused(images: tuple[_Data, _Data], volumes: tuple[_Data, _Data],
                                                    dims: str, mistake: str) -> None:
    """Each form, sent beside a model's weights, is refused at the client naming the reply
    key, the client, the sample and what matched. On main each reply passed."""
    make, matched = MISTAKES[mistake]
    data = images if dims == "2d" else volumes
    with pytest.raises(PayloadError, match=rf"client 3\b.*\['leak'\].*holds image \d+ of client 3's train split"
                                           rf".*({matched})"):
        run_client_update(_Leak(lambda c: make(_x(c))), _ctx(*data), Instruction())


def test_a_mistake_inside_a_list_or_channel_last_is_refused(images: tuple[_Data, _Data]) -> None:
    """The same images as a list of scaled images, and as channel-last uint8 arrays (what a
    plugin converting to PIL/NumPy layout sends)."""
    for make in (lambda c: list(_x(c) * 0.5), lambda c: _minmax_uint8(_x(c)).movedim(1, -1).contiguous()):
        with pytest.raises(PayloadError, match=r"\['leak'\].*holds image \d+ of client 3's train split"):
            run_client_update(_Leak(make), _ctx(*images), Instruction())


def test_every_crop_wide_enough_is_refused_in_an_image_with_more_starts_than_kept() -> None:
    """A 64 x 64 image has 16 lines of 61 crop starts, more than CROP_KEYS (512): every
    second start of each line is kept, so any crop of 5 x 5 pixels is refused on its own,
    wherever it lies (each image's crop alone in a message)."""
    from medfl.guard import CROP, CROP_KEYS

    data = _data(16, (1, 64, 64), seed=31)
    assert 16 * (64 - CROP + 1) > CROP_KEYS
    guard = ContentGuard("3", {"train": data})
    g = torch.Generator().manual_seed(32)
    for i, img in enumerate(data.tensors[0]):
        y, x = (int(v) for v in torch.randint(0, 64 - 4, (2,), generator=g))
        with pytest.raises(PayloadError, match=rf"\['crop'\]: holds image {i} of client 3's train split.*crop probes"):
            guard.check({"crop": img[:, y:y + 5, x:x + 5].clone()}, "reply")


def test_weights_shaped_like_the_images_pass(images: tuple[_Data, _Data]) -> None:
    """Tensors of the images' and the halved images' shapes that are not the client's
    images (random weights, prototypes, a constant map, another client's images) pass."""
    other = _data(N, (1, 16, 16), seed=99).tensors[0]
    make = lambda c: {"like_images": torch.randn(N, 1, 16, 16), "halved": torch.randn(N, 1, 8, 8),  # noqa: E731
                      "flat": torch.randn(4, 256), "ones": torch.ones(N, 1, 16, 16),
                      "other_clients": other * 0.5, "other_uint8": _minmax_uint8(other)}
    run_client_update(_Leak(make), _ctx(*images), Instruction())


# ------------------------------------------------------- the built-in methods on fixtures
#: Seven built-in methods of four families, in tiny settings.
METHODS = [{"name": "fedavg"}, {"name": "fedprox"}, {"name": "fedbn"}, {"name": "fedkper"}, {"name": "fedsdc"},
           {"name": "fedskd"}, {"name": "pfedcdp", "server_classifier": "init", "refine": False}]


def _prepare(name: str, root: Path) -> dict[str, Any]:
    """Write fixture ``name`` in its raw layout, prepare it, and return the run's dataset block."""
    from medfl.fixtures import generate

    raw, out = root / "raw", root / "data"
    if name == "pathmnist":
        from medfl.prep.medmnist import main as prep

        generate("medmnist", raw, cases=150, seed=0, flag="pathmnist")
        assert prep(["--raw", str(raw), "--out", str(out), "--flag", "pathmnist"]) == 0
        return {"name": "manifest", "path": str(out / "manifest.csv"), "num_classes": 9, "normalize": "minmax"}
    if name == "mias":
        from medfl.prep.mias import main as prep

        generate("mias", raw, cases=40, seed=0, reference=False)
        assert prep(["--raw", str(raw), "--out", str(out), "--size", "32"]) == 0
        return {"name": "manifest", "path": str(out / "manifest.csv"), "num_classes": 3, "normalize": "minmax"}
    from medfl.prep.abide import main as prep

    info = generate("abide", raw, cases=16, seed=0, reference=False)
    assert prep(["--raw", str(raw), "--out", str(out), "--size", "16", "--test-fold", "none",
                 "--atlas", "file", "--atlas-file", str(info["signal_atlas"])]) == 0
    return {"name": "manifest", "path": str(out / "manifest.csv"), "num_classes": 2, "normalize": "zscore",
            "spatial_size": [16, 16, 16]}


FIXTURES = ["pathmnist", "mias", "abide"]


@pytest.fixture(scope="module", params=FIXTURES)
def fixture_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A fixture's config and every message the guard checked while the seven methods ran
    on it for one round."""
    from medfl.config import resolve_config
    from medfl.experiment import run_experiment

    root = tmp_path_factory.mktemp(request.param)
    dataset = _prepare(request.param, root)
    fl = {"name": request.param, "output_dir": str(root / "runs"), "seed": 0, "rounds": 1, "num_clients": 3,
          "progress": False, "dataset": dataset, "partition": {"name": "iid"},
          "model": {"name": "small_cnn", "width": 4}, "train": {"batch_size": 8, "lr": 0.05},
          "eval_splits": ["test"], "methods": METHODS}
    seen: list[tuple[ContentGuard, Any, str, frozenset[str]]] = []
    real = ContentGuard.check

    def spy(self: ContentGuard, value: Any, where: str, exempt: frozenset[str] = frozenset()) -> None:
        real(self, value, where, exempt)
        seen.append((self, value, where, exempt))

    clear_reference_cache()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ContentGuard, "check", spy)
        cfg = resolve_config(fl)
        run_experiment(cfg)
    return {"name": request.param, "cfg": cfg, "seen": seen}


def _quantised(value: Any, how: str) -> Any:
    """``value`` with every floating-point tensor quantised (:func:`_quantise`)."""
    if isinstance(value, torch.Tensor):
        return _quantise({"t": value}, how)["t"] if value.numel() > 1 else value
    if isinstance(value, dict):
        return {k: _quantised(v, how) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_quantised(v, how) for v in value]
    return value


def test_built_in_methods_real_replies_are_never_refused(fixture_run: dict[str, Any]) -> None:
    """Every reply (as returned and after the filters), metrics dict, score and profile the
    seven methods sent passed the guard as sent (the runs finished), and passes again
    quantised to int8 and to 2 bits, with the new probes in use for the fixture's images."""
    seen = fixture_run["seen"]
    for method in METHODS:
        replies = [w for _, _, w, _ in seen if f"method '{method['name']}'" in w and "(metrics)" not in w]
        assert len(replies) >= 3, (method["name"], len(replies))      # 3 clients at least
    assert any("(after filters)" in w for _, _, w, _ in seen)        # pfedcdp's own dp_gaussian + quantize
    guards = {id(g): g for g, _, _, _ in seen}.values()
    assert all(g.index().planes and g.index().ckeys.size for g in guards), fixture_run["name"]
    checked = 0
    for guard, value, where, exempt in seen:
        for how in ("int8", "int2"):
            guard.check(_quantised(value, how), f"{where} ({how})", exempt)
            checked += 1
    assert checked == 2 * len(seen)


def test_plain_mistakes_with_a_fixtures_images_are_refused(fixture_run: dict[str, Any]) -> None:
    """The same mistakes with a fixture client's own training images (as the engine builds
    them) are refused by that client's guard."""
    from medfl.engine.data import split_data
    from medfl.engine.runner import build_source

    cfg = fixture_run["cfg"]
    data = split_data(build_source(cfg["dataset"]), cfg)
    ctx = ClientContext(client_id="0", round=1, seed=0, datasets=data.dataset_factories("0", ["train", "test"]),
                        model_spec={}, train={"batch_size": 8, "epochs": 1})
    train = ctx.dataset("train", augment=False)
    x = torch.stack([torch.as_tensor(train[i][0]) for i in range(len(train))])
    guard = ContentGuard.for_client(ctx)
    for mistake, (make, _) in MISTAKES.items():   # 256-level images: some forms also hit probe values
        with pytest.raises(PayloadError, match=r"\['leak'\]: holds image \d+ of client 0's train split"):
            guard.check({"leak": make(x)}, f"{fixture_run['name']}: {mistake}")
