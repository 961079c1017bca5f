"""The payload guard compares what leaves a client with the client's own labels and images.

Every leak form the old shape rules let through is caught at ``run_client_update`` with an
error naming the client and the reply key; model weights of every registered model in
every dtype (float32/16, bfloat16, int8/uint8 quantised) never trigger it, including the
BatchNorm vector whose length equals a split size; an end-to-end probe plugin writing
labels into its metrics makes the run fail.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from medfl.engine.client import ClientContext, run_client_update
from medfl.guard import ContentGuard, clear_reference_cache
from medfl.messages import Instruction, PayloadError, Reply, SampleGuard, validate_payload
from medfl.method import Method
from medfl.privacy.feature_release import SampleRelease

from contract_methods import methods_registered

N, K = 64, 3


class _Data(TensorDataset):
    """``(image, label)`` items with the ``labels`` array medfl's datasets expose."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        super().__init__(x, y)
        self.labels = y.numpy()


def _data(n: int, shape: tuple[int, ...], seed: int, classes: int = K, normal: bool = False) -> _Data:
    """``n`` random images (uniform on [-0.5, 1.5], or standard normal like z-scored images)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *shape), generator=g) if normal else torch.rand((n, *shape), generator=g) * 2 - 0.5
    return _Data(x, torch.randint(0, classes, (n,), generator=g))


def _ctx(train: _Data, test: _Data | None = None, client: str = "3") -> ClientContext:
    datasets: dict[str, Any] = {"train": train}
    if test is not None:
        datasets["test"] = test
    return ClientContext(client_id=client, round=1, seed=11, datasets=datasets, model_spec={},
                         train={"batch_size": 8, "epochs": 2})


class _Leak(Method):
    """Replies with whatever ``make(ctx)`` builds, in the payload or in the metrics."""

    name = "leak_probe"

    def __init__(self, make: Callable[[ClientContext], Any] = lambda c: None, into: str = "payload",
                 key: str = "leak") -> None:
        self.make, self.into, self.key = make, into, key

    def reply_keys(self, instruction: Instruction) -> frozenset[str]:
        """Every key the probe's reply carries (``Method.reply_keys``): the guard judges the rest."""
        return frozenset({"w", "b"} | ({self.key} if self.into == "payload" else set()))

    def client_update(self, client: ClientContext, instruction: Instruction) -> Reply:
        value = self.make(client)
        weights = {"w": torch.randn(32, 16), "b": torch.zeros(32)}
        if self.into == "metrics":
            metrics = value if isinstance(value, dict) else {self.key: value}
            return Reply(payload=weights, metrics={"loss": 0.3, **metrics}, num_examples=client.num_examples("train"))
        return Reply(payload={**weights, self.key: value}, metrics={"loss": 0.3}, num_examples=client.num_examples("train"))


def _x(c: ClientContext) -> torch.Tensor:
    return c.dataset("train").tensors[0]


def _y(c: ClientContext) -> torch.Tensor:
    return c.dataset("train").tensors[1]


LABEL_LEAKS: dict[str, Callable[[ClientContext], Any]] = {
    "int64": _y,
    "float": lambda c: _y(c).float(),
    "(N,1)": lambda c: _y(c)[:, None].float(),
    "(1,N)": lambda c: _y(c)[None].double(),
    "padded by one": lambda c: torch.cat([_y(c).float(), torch.tensor([7.0])]),
    "padded in front": lambda c: torch.cat([torch.tensor([2, 0]), _y(c)]).to(torch.int8),
    "one-hot": lambda c: torch.nn.functional.one_hot(_y(c), K).float(),
    "one-hot transposed": lambda c: torch.nn.functional.one_hot(_y(c), K).T.contiguous(),
    "probabilities": lambda c: torch.softmax(5 * torch.nn.functional.one_hot(_y(c), K).float(), 1),
    "one-hot flattened": lambda c: torch.nn.functional.one_hot(_y(c), K).flatten(),
    "label column of a table": lambda c: torch.cat([torch.randn(N, 4), _y(c)[:, None].float()], 1),
    "Python list": lambda c: _y(c).tolist(),
    "list of one-hot rows": lambda c: list(torch.nn.functional.one_hot(_y(c), K).float()),
    "list of 0-d tensors": lambda c: list(_y(c)),
    "loader order": lambda c: torch.cat([b[1] for b in c.loader("train")]),
    "test split": lambda c: c.dataset("test").tensors[1].float(),
}

IMAGE_LEAKS: dict[str, Callable[[ClientContext], Any]] = {
    "batch": _x,
    "one image": lambda c: _x(c)[5],
    "flattened": lambda c: _x(c).flatten(),
    "(N, HW)": lambda c: _x(c).reshape(N, -1),
    "channel-squeezed": lambda c: _x(c)[:, 0],
    "transposed": lambda c: _x(c)[:, 0].transpose(1, 2).contiguous(),
    "shuffled pixels": lambda c: _x(c)[7].flatten()[torch.randperm(_x(c)[7].numel())],
    "list of tensors": lambda c: list(_x(c)),
    "list of rows": lambda c: list(_x(c)[0, 0]),
    "dict of tensors": lambda c: {f"s{i}": _x(c)[i] for i in range(N)},
    "float64": lambda c: _x(c).double(),
    "float16": lambda c: _x(c).half(),
    "bfloat16 transposed": lambda c: _x(c)[:, 0].transpose(1, 2).contiguous().bfloat16(),
    "Python list of floats": lambda c: _x(c)[2].flatten().tolist(),
}


@pytest.fixture(scope="module")
def ctx_data() -> tuple[_Data, _Data]:
    clear_reference_cache()
    return _data(N, (1, 16, 16), seed=0), _data(24, (1, 16, 16), seed=1)


@pytest.mark.parametrize("form", list(LABEL_LEAKS))
def test_labels_in_a_reply_are_refused_in_any_form(ctx_data: tuple[_Data, _Data], form: str) -> None:
    ctx = _ctx(*ctx_data)
    with pytest.raises(PayloadError, match=r"client 3\b.*\['leak'\].*labels of client 3's (train|test) split"):
        run_client_update(_Leak(LABEL_LEAKS[form]), ctx, Instruction())


@pytest.mark.parametrize("form", list(IMAGE_LEAKS))
def test_images_in_a_reply_are_refused_in_any_form(ctx_data: tuple[_Data, _Data], form: str) -> None:
    ctx = _ctx(*ctx_data)
    with pytest.raises(PayloadError, match=r"client 3\b.*\['leak'\].*holds image \d+ of client 3's train split"):
        run_client_update(_Leak(IMAGE_LEAKS[form]), ctx, Instruction())


@pytest.mark.parametrize("form", ["list", "per-sample keys", "one-hot rows"])
def test_labels_in_the_metrics_are_refused(ctx_data: tuple[_Data, _Data], form: str) -> None:
    make = {"list": lambda c: _y(c).tolist(),
            "per-sample keys": lambda c: {f"y{i}": float(v) for i, v in enumerate(_y(c).tolist())},
            "one-hot rows": lambda c: torch.nn.functional.one_hot(_y(c), K).tolist()}[form]
    with pytest.raises(PayloadError, match=r"client 3 \(metrics\).*labels of client 3's train split"):
        run_client_update(_Leak(make, into="metrics"), _ctx(*ctx_data), Instruction())


def test_scalars_and_histograms_pass(ctx_data: tuple[_Data, _Data]) -> None:
    """What methods legitimately send: scalars, label histograms, prototypes, logits on
    other data, a constant vector as long as a split."""
    def make(c: ClientContext) -> Any:
        return {"hist": torch.bincount(_y(c), minlength=K), "proto": torch.randn(K, 16), "acc": 0.75,
                "ones": torch.ones(N), "counts": [int(v) for v in torch.bincount(_y(c), minlength=K)]}
    reply = run_client_update(_Leak(make), _ctx(*ctx_data), Instruction())
    assert "leak" in reply.payload


class _Released(_Leak):
    """Declares ``leak`` as a per-sample release (noise multiplier 1, clip 100), which medfl performs."""

    def release_plan(self) -> SampleRelease:
        return SampleRelease("leak_release", 1.0, 100.0, 1.0, 1e-5, "rdp", keys=("leak",))


def test_a_release_key_is_noised_by_medfl_then_checked_never_excused_from_the_type_check(
        ctx_data: tuple[_Data, _Data]) -> None:
    """Issue 38, item 1: a key no longer skips the content check because the method says
    so; medfl noises the release's images before they leave and the guard checks the result."""
    release = Instruction(config={"dp_release": True})
    reply = run_client_update(_Released(_x), _ctx(*ctx_data), release)
    sent = reply.payload["leak"] - _x(_ctx(*ctx_data))
    assert float(sent.std()) == pytest.approx(100.0, rel=0.05) and reply.metrics["noise_std"] == 100.0
    with pytest.raises(PayloadError, match="only tensors and scalars"):
        run_client_update(_Released(lambda c: object()), _ctx(*ctx_data), release)


def test_a_release_key_is_refused_outside_the_declared_release(ctx_data: tuple[_Data, _Data]) -> None:
    """A release key in a reply to any instruction that does not ask for the release
    (``dp_release`` missing, false, or a string) is refused, whatever it holds."""
    for config in ({}, {"dp_release": False}, {"dp_release": "yes"}):
        with pytest.raises(PayloadError, match=r"\['leak'\] carries release 'leak_release'"):
            run_client_update(_Released(lambda c: torch.randn(N, 4)), _ctx(*ctx_data), Instruction(config=config))


def test_few_labels_are_not_distinguishable_from_chance() -> None:
    """Eight binary labels (at most 8 bits) could be any 0/1 vector: not refused; the
    same vector in a 64-sample split is."""
    small = _data(8, (1, 8, 8), seed=2, classes=2)
    guard = ContentGuard("0", {"train": small})
    guard.check({"mask": torch.as_tensor(small.labels)}, "reply")
    big = _data(64, (1, 8, 8), seed=3, classes=2)
    with pytest.raises(PayloadError, match="labels"):
        ContentGuard("0", {"train": big}).check({"mask": torch.as_tensor(big.labels) > 0}, "reply")   # as bools


# ---------------------------------------------------------------------- no false positives
def test_random_binary_vectors_and_probability_blocks_are_not_taken_for_labels() -> None:
    """The worst case for chance matches: many 0/1 vectors (1-bit quantised weights) and
    class-probability blocks as long as the client's small splits. The threshold grows
    with the number of tests in the message, so none is refused."""
    rng = np.random.default_rng(0)
    for trial in range(25):
        g = torch.Generator().manual_seed(trial)
        guard = ContentGuard("0", {f"s{n}": _data(n, (1, 4, 4), seed=100 * trial + n, classes=2)
                                   for n in (12, 16, 24, 32, 64)})
        msg: dict[str, Any] = {f"bits{i}": torch.randint(0, 2, (int(rng.choice([12, 16, 32, 64, 128])),),
                                                         generator=g).to(torch.uint8) for i in range(100)}
        msg.update({f"p{i}": torch.softmax(torch.randn(int(rng.choice([12, 16, 24, 32, 64])), 2, generator=g), 1)
                    for i in range(50)})
        guard.check(msg, f"trial {trial}")


def _quantise(state: dict[str, torch.Tensor], how: str) -> dict[str, torch.Tensor]:
    out = {}
    for k, w in state.items():
        if not w.is_floating_point():
            out[k] = w
        elif how == "int8":
            scale = w.abs().max().clamp_min(1e-12) / 127
            out[k] = (w / scale).round().clamp(-127, 127).to(torch.int8)
        elif how == "uint8":
            lo, hi = w.min(), w.max()
            out[k] = ((w - lo) / (hi - lo).clamp_min(1e-12) * 255).round().to(torch.uint8)
        elif how == "int2":
            scale = w.abs().max().clamp_min(1e-12)
            out[k] = (w / scale * 1.5).round().clamp(-1, 1).to(torch.int8) + 1     # {0, 1, 2}
        else:
            out[k] = w.to(getattr(torch, how))
    return out


def _trained(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = {}
    for k, v in model.state_dict().items():
        if "running_var" in k:
            out[k] = torch.rand(v.shape, generator=g) * 3
        elif "running_mean" in k:
            out[k] = torch.randn(v.shape, generator=g)
        elif "num_batches_tracked" in k:
            out[k] = torch.tensor(48)
        elif v.is_floating_point():
            out[k] = v + 0.02 * torch.randn(v.shape, generator=g) * v.std().nan_to_num(0.02)
        else:
            out[k] = v
    return out


MODELS = [("small_cnn", 2, {}), ("resnet10", 2, {}), ("resnet18", 2, {}),
          ("small_cnn", 3, {}), ("resnet10", 3, {"width": 16}), ("resnet18", 3, {"width": 16})]


@pytest.mark.parametrize("name, dims, kw", MODELS, ids=[f"{m}-{d}d" for m, d, _ in MODELS])
def test_model_weights_of_any_dtype_never_trigger_the_guard(name: str, dims: int, kw: dict[str, Any]) -> None:
    """Initial and trained-like weights, float32/float16/bfloat16 and int8/uint8/2-bit
    quantised, against a client whose split sizes equal the models' BatchNorm lengths and
    whose images hold values of the weights' range (uniform in 2D, z-scored in 3D)."""
    from medfl.models.registry import build_model

    shape = (1, 16, 16) if dims == 2 else (1, 12, 12, 12)
    guard = ContentGuard("0", {f"split{n}": _data(n, shape, seed=n, classes=2, normal=dims == 3)
                               for n in (8, 16, 32, 64, 128)})
    model = build_model({"name": name, "spatial_dims": dims, "in_channels": 1, "num_classes": 2, **kw})
    for weights in (model.state_dict(), _trained(model)):
        for how in ("float32", "float16", "bfloat16", "int8", "uint8", "int2"):
            guard.check(_quantise(weights, how), f"{name} {dims}D {how}")


def test_a_quantised_batchnorm_vector_as_long_as_a_split_passes() -> None:
    """The reported false positive: per-tensor 8-bit quantisation of a BatchNorm vector of
    length 8 with a split of 8 samples (the old rule refused any integer vector that long)."""
    split = _data(8, (1, 8, 8), seed=4, classes=2)
    bn = torch.nn.BatchNorm2d(8)
    bn.weight.data = 1 + 0.1 * torch.randn(8)
    state = _quantise(bn.state_dict(), "int8")
    assert state["weight"].shape == (8,) and state["weight"].dtype == torch.int8
    ContentGuard("0", {"train": split}).check(state, "reply")
    SampleGuard((1, 8, 8)).check(state, "reply")      # the coordinator's check too


def _saturated_codes(seed: int) -> np.ndarray:
    """8-bit codes of an update like PFedCDP's no-DP extractor update in round 1 (the reported
    false positive): 14,418 codes spread over 2..255 and a block of 18,350 codes at the
    tensor's minimum (entries that Adam moved by its full step the same way), 0 with a 1 here
    and there (7 %), so 0s and 1s are rare in the tensor but dense in the block."""
    rng = np.random.default_rng(seed)
    spread = np.clip(rng.normal(128, 40, 14418), 2, 255).astype(np.uint8)
    block = (rng.random(18350) < 0.071).astype(np.uint8)
    return np.concatenate([spread[:7000], block, spread[7000:]])


def test_sparse_labels_in_a_block_of_saturated_codes_are_chance() -> None:
    """A split of 38 zeros and a one (Dirichlet partitions make such clients) lies by chance
    in a block of saturated 0/1 codes: the surprise counts the label values' frequency among
    the label-like codes (93 % zeros), not over the whole tensor (52 %), so it passes; the
    client's balanced split written into the same tensor is still refused."""
    codes = _saturated_codes(0)
    y = np.zeros(39, dtype=np.int64)
    y[23] = 1
    codes[7000 + 5000: 7000 + 5039] = y                           # the pattern is there, by chance
    sparse = _Data(torch.zeros(39, 1, 4, 4), torch.as_tensor(y))
    ContentGuard("3", {"train": sparse}).check({"extractor": {"w": {"codes": torch.as_tensor(codes)}}}, "reply")
    balanced = _data(64, (1, 4, 4), seed=7, classes=2)
    leak = codes.copy()
    leak[100:164] = balanced.labels
    with pytest.raises(PayloadError, match="holds the labels of client 3's train split"):
        ContentGuard("3", {"train": balanced}).check({"w": torch.as_tensor(leak)}, "reply")


def test_the_coordinator_still_refuses_image_shaped_batches() -> None:
    guard = SampleGuard((1, 8, 8))
    validate_payload({"sd": torch.nn.Conv2d(1, 4, 3).state_dict(), "y": torch.arange(10)}, guard=guard)
    with pytest.raises(PayloadError, match="looks like a batch"):
        validate_payload({"x": torch.zeros(10, 1, 8, 8)}, guard=guard)
    validate_payload({"x": torch.zeros(10, 1, 8, 8)}, guard=guard, exempt=frozenset({"x"}))


def test_images_with_few_distinct_values_are_reported_unprotected(caplog: pytest.LogCaptureFixture) -> None:
    """Binary images: value probes and runs would match any 0/1 tensor, so none are kept,
    and the guard says so (documented in docs/flower.md)."""
    binary = _Data((torch.rand(12, 1, 16, 16) > 0.5).float(), torch.randint(0, 2, (12,)))
    guard = ContentGuard("0", {"train": binary})
    with caplog.at_level("WARNING", logger="medfl.guard"):
        assert guard.stats()["unprotected_samples"] == 12
    assert "too few distinct pixel values" in caplog.text
    raw = _Data(torch.randint(0, 256, (12, 1, 16, 16)).float(), torch.randint(0, 2, (12,)))   # integer-valued
    with pytest.raises(PayloadError, match="runs of 8 pixels"):
        ContentGuard("0", {"train": raw}).check({"x": raw.tensors[0].to(torch.uint8)}, "reply")


# ---------------------------------------------------------------------- end to end
class _Probe(Method):
    """The issue's probe: trains nothing, writes every training label into its metrics."""

    name = "label_probe"

    def setup(self, federation: Any) -> None:
        self.federation = federation

    def configure_round(self, round: int) -> dict[str, Instruction]:
        return {cid: Instruction() for cid in self.federation.sample(round)}

    def client_update(self, client: ClientContext, instruction: Instruction) -> Reply:
        labels = np.asarray(client.dataset("train").labels)
        return Reply(metrics={f"label_{i}": float(v) for i, v in enumerate(labels)}, num_examples=len(labels))

    def server_update(self, replies: dict[str, Reply]) -> None:
        pass

    def client_eval_model(self, client: ClientContext, instruction: Instruction) -> torch.nn.Module:
        return client.build_model()


def test_a_probe_writing_labels_into_metrics_fails_the_run(tiny_fl: dict[str, Any], resolve: Any) -> None:
    from medfl.experiment import run_experiment

    with methods_registered(_Probe, name="label-probe-test"):
        tiny_fl["dataset"]["num_samples"] = 240
        tiny_fl.update(rounds=1, methods=[{"name": "label_probe"}])
        with pytest.raises(PayloadError, match=r"reply of method 'label_probe' from client 0 \(metrics\)"
                                               r"\['label_0'\]\.\.\['label_\d+'\]: holds the labels of client 0"):
            run_experiment(resolve(tiny_fl))


# ---------------------------------------------------------------- reply filters (quantize)
@pytest.mark.parametrize("name, dims, kw", MODELS[:4], ids=[f"{m}-{d}d" for m, d, _ in MODELS[:4]])
def test_the_quantize_filters_packed_codes_never_trigger_the_guard(name: str, dims: int, kw: dict[str, Any]) -> None:
    """What ``quantize`` sends (bit-packed uint8 codes plus ranges) at 1, 4, 8 and 16 bits,
    of initial and trained-like weights, passes the content guard and the coordinator's check."""
    from medfl.filters import FilterChain
    from medfl.models.registry import build_model
    from medfl_plugins.baselines import Centralized

    shape = (1, 16, 16) if dims == 2 else (1, 12, 12, 12)
    guard = ContentGuard("0", {f"split{n}": _data(n, shape, seed=n, classes=2, normal=dims == 3)
                               for n in (8, 16, 32, 64, 128)})
    model = build_model({"name": name, "spatial_dims": dims, "in_channels": 1, "num_classes": 2, **kw})
    for weights in (model.state_dict(), _trained(model)):
        for bits in (1, 4, 8, 16):
            chain = FilterChain.from_specs([{"name": "quantize", "bits": bits}])
            sent = chain.apply(Centralized, {"model": weights}, {}, client_id="0", round=1, step=0, seed=3,
                               model_spec={}, where="reply")
            guard.check(sent, f"{name} {dims}D {bits} bits")
            SampleGuard(shape).check(sent, "reply")


class _QuantizedLeak(_Leak):
    """A method whose reply's model state goes through the run's filters."""

    name = "quantized_leak_probe"
    reply_state = {"model": None}

    def reply_keys(self, instruction: Instruction) -> frozenset[str]:
        return frozenset({"model"} | ({self.key} if self.into == "payload" else set()))

    def client_update(self, client: ClientContext, instruction: Instruction) -> Reply:
        reply = super().client_update(client, instruction)
        model = {k: v for k, v in reply.payload.items() if k in ("w", "b")}
        rest = {k: v for k, v in reply.payload.items() if k not in ("w", "b")}
        if self.into == "model":   # the leak hidden inside the filtered model state
            model[self.key] = self.make(client)
            rest.pop(self.key, None)
        return Reply(payload={"model": model, **rest}, metrics=reply.metrics, num_examples=reply.num_examples)


@pytest.mark.parametrize("into", ["payload", "model"])
def test_labels_are_still_refused_when_the_reply_is_quantized(ctx_data: tuple[_Data, _Data], into: str) -> None:
    from medfl.filters import FilterChain

    chain = FilterChain.from_specs([{"name": "quantize", "bits": 8}])
    ok = _QuantizedLeak(make=lambda c: torch.tensor(1.5))
    run_client_update(ok, _ctx(*ctx_data), Instruction(), filters=chain)     # a clean reply passes
    leak = _QuantizedLeak(make=lambda c: _y(c).float(), into=into)
    with pytest.raises(PayloadError, match="client 3"):
        run_client_update(leak, _ctx(*ctx_data), Instruction(), filters=chain)


def test_the_guard_reads_a_clients_splits_once_per_run(tiny_fl) -> None:
    """Issue 20: the guard built every split of a client again every round only to find its
    cached reference. The engine's dataset factories name their samples (``guard_key``), so a
    later round's guard reuses the reference without building anything, and another split of
    the data (a new FederatedData) is read afresh."""
    from medfl.config import resolve_config
    from medfl.engine.data import split_data
    from medfl.engine.runner import build_source

    cfg = resolve_config(tiny_fl)
    clear_reference_cache()
    built: list[tuple[str, str]] = []

    def counted(data):  # type: ignore[no-untyped-def]
        real = data._build
        data._build = lambda cid, role, augment=None: built.append((cid, role)) or real(cid, role, augment)
        return data

    data = counted(split_data(build_source(cfg["dataset"]), cfg))
    roles = ["train", "test", "global_test"]
    for rnd in (1, 2, 3):
        ctx = ClientContext(client_id="0", round=rnd, seed=0, datasets=data.dataset_factories("0", roles),
                            model_spec={}, train={"batch_size": 8, "epochs": 1})
        ContentGuard.for_client(ctx).index()
        if rnd == 1:
            first = list(built)
    # round 1: each split without augmentation, and the training loader (whose sample order
    # the guard replays; the round's training uses that same dataset); later rounds: only that
    assert sorted(first) == sorted([("0", r) for r in roles] + [("0", "train")])
    assert built[len(first):] == [("0", "train")] * 2
    # the reused reference still recognises the client's images in a later round
    images = ctx.dataset("train", augment=False)
    with pytest.raises(PayloadError, match="image"):
        validate_payload({"x": torch.stack([images[i][0] for i in range(len(images))])}, "reply",
                         guard=ContentGuard.for_client(ctx))
    again = counted(split_data(build_source(cfg["dataset"]), cfg))
    ContentGuard.for_client(ClientContext(client_id="0", round=1, seed=0, datasets=again.dataset_factories("0", roles),
                                          model_spec={}, train={"batch_size": 8, "epochs": 1})).index()
    assert len(built) == 2 * len(first) + 2 + 1   # + the labels check's train dataset above


def test_the_merged_index_of_every_client_stays_cached_across_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 20: the merged index (a client's splits with their prefilter tables) was kept for
    4 clients only, so with more clients every round merged every client's index again. The
    tables are sized to the probes now and the cache is bounded in bytes: 12 clients are
    merged once, their indices are reused, and they still recognise their images."""
    import medfl.guard as guard_module

    clear_reference_cache()
    merges: list[int] = []
    real_merge = guard_module._merge
    monkeypatch.setattr(guard_module, "_merge", lambda refs: merges.append(1) or real_merge(refs))
    clients = {str(c): _data(40, (1, 16, 16), seed=300 + c) for c in range(12)}
    for _round in range(3):
        for cid, data in clients.items():
            ContentGuard(cid, {"train": data}).index()
    assert len(merges) == 12
    sizes = [ix.nbytes for ix in guard_module._MERGED.values()]
    assert len(sizes) == 12 and max(sizes) < 2 << 20, sizes   # not 4 MiB of fixed tables each
    cid, data = "7", clients["7"]
    with pytest.raises(PayloadError, match="image"):
        ContentGuard(cid, {"train": data}).check({"x": data.tensors[0][:8].clone()}, "reply")


@pytest.mark.parametrize("n, batch", [(1, 8), (13, 4), (64, 8), (65, 64)])
def test_the_replayed_training_order_is_the_loaders(n: int, batch: int) -> None:
    """The guard replays a shuffling loader's sample order (one batch per pass) without
    reading a sample; it must be the order the loader itself yields, epoch after epoch."""
    from torch.utils.data import DataLoader

    from medfl.guard import loader_orders

    data = _data(n, (1, 2, 2), seed=n)
    loader = DataLoader(data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(5))
    replayed = loader_orders(loader, 3)
    position = {float(x.sum()): i for i, (x, _) in enumerate(data)}
    for epoch in range(3):
        seen = [position[float(x.sum())] for xb, _ in loader for x in xb]
        assert replayed[epoch].tolist() == seen


@pytest.mark.parametrize("form", ["float", "(N,1)", "one-hot", "probabilities", "one-hot flattened",
                                  "label column of a table", "padded by one", "bfloat16", "float64 among NaN"])
def test_labels_hidden_among_a_models_weights_are_refused(ctx_data: tuple[_Data, _Data], form: str) -> None:
    """The label scan first counts, over all of a reply's floating tensors in one pass, the
    whole numbers in the labels' range and the negative values, and skips the readings a
    tensor cannot match: a leak put among a real model's weights (dozens of tensors) is
    still found, whatever its form."""
    from medfl.models.registry import build_model

    leaks = {**LABEL_LEAKS, "bfloat16": lambda c: _y(c).bfloat16(),
             "float64 among NaN": lambda c: torch.cat([torch.full((3,), float("nan")), _y(c).double()])}
    state = build_model({"name": "resnet10", "width": 16, "spatial_dims": 2, "in_channels": 1,
                         "num_classes": K}).state_dict()

    def make(c: ClientContext) -> dict[str, Any]:
        return {**{k: v.clone() for k, v in state.items()}, "zz.leak": leaks[form](c)}

    class _InState(_Leak):
        def client_update(self, client: ClientContext, instruction: Instruction) -> Reply:
            return Reply(payload=make(client), metrics={"loss": 0.3}, num_examples=client.num_examples("train"))

    if form == "float64 among NaN":   # NaN is refused as non-finite before the guard runs: check directly
        with pytest.raises(PayloadError, match=r"\['zz.leak'\].*labels of client 3's train split"):
            ContentGuard("3", {"train": ctx_data[0]}).check(make(_ctx(*ctx_data)), "reply")
        return
    with pytest.raises(PayloadError, match=r"\['zz.leak'\].*labels of client 3's (train|test) split"):
        run_client_update(_InState(), _ctx(*ctx_data), Instruction())


def test_the_non_finite_check_of_a_model_state_names_the_tensor() -> None:
    """``first_non_finite`` sums a model state's floating tensors in one pass: a NaN or an
    infinity in any of them is named; finite values whose sum overflows are not refused."""
    from medfl.engine.client import first_non_finite
    from medfl.models.registry import build_model

    state = {k: v.clone() for k, v in build_model({"name": "resnet10", "width": 16, "spatial_dims": 2,
                                                    "in_channels": 1, "num_classes": 2}).state_dict().items()}
    assert first_non_finite(state) == ""
    key = sorted(k for k, v in state.items() if v.is_floating_point())[7]
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = {**state, key: state[key].clone()}
        broken[key].view(-1)[-1] = bad
        assert first_non_finite(broken) == f"[{key!r}]"
    huge = {**state, "big": torch.full((4,), 3e38), "wide": torch.tensor([1e300], dtype=torch.float64)}
    assert first_non_finite(huge) == ""
    assert first_non_finite({**huge, "half": torch.tensor([float("inf")], dtype=torch.float16)}) == "['half']"


@pytest.mark.parametrize("shape", [(1, 0, 9), (), (5,), (2, 3, 16)])
def test_references_of_odd_sample_shapes(shape: tuple[int, ...]) -> None:
    """Samples without a value, scalars, short vectors and thin volumes get the probes their
    axes allow (none where no axis holds a gram), and the reference still covers every sample."""
    from medfl.guard import GRAM, build_split_reference

    ds = TensorDataset(torch.randn(6, *shape, generator=torch.Generator().manual_seed(0)), torch.arange(6) % 2)
    ref = build_split_reference(ds)
    assert ref.n == 6 and ref.vcount.shape == (6,)
    long_axes = [a for a, n in enumerate(shape) if n >= GRAM]
    if not long_axes or 0 in shape:
        assert all(ref.grams[v][0].size == 0 for v in ref.grams)
    else:
        assert set(np.unique(ref.gaxis["f16"])) == set(long_axes) and set(ref.gsample["f16"]) == set(range(6))


@pytest.mark.parametrize("form", ["one image", "split over two tensors", "float64", "flattened"])
def test_images_hidden_among_a_models_weights_are_refused_naming_the_tensor(ctx_data: tuple[_Data, _Data],
                                                                             form: str) -> None:
    """The image scan looks up the values of all of a reply's float tensors in one pass,
    then tells the tensors apart: an image put among a real model's weights is found and the
    error names the tensor holding it (the first of two when it is split over two)."""
    from medfl.models.registry import build_model

    state = {k: v.clone() for k, v in build_model({"name": "resnet10", "width": 16, "spatial_dims": 2,
                                                   "in_channels": 1, "num_classes": K}).state_dict().items()}
    img = ctx_data[0].tensors[0][9]
    keys = list(state)
    at = keys[len(keys) // 2]   # a tensor in the middle of the state
    if form == "split over two tensors":
        flat = img.flatten()
        half = flat.numel() * 3 // 4
        leak = {at: flat[:half].clone(), keys[-3]: flat[half:].clone()}
    else:
        leak = {at: {"one image": img, "float64": img.double(), "flattened": img.flatten()}[form].clone()}
    with pytest.raises(PayloadError, match=rf"\[{at!r}\]: holds image 9 of client 3's train split"):
        ContentGuard("3", {"train": ctx_data[0]}).check({**state, **leak}, "reply")


def test_the_one_pass_label_count_equals_a_count_per_tensor() -> None:
    """``_may_hold_runs`` over the shared float32 view of a message's tensors gives, tensor
    by tensor, what counting each one alone gives: float32 (large ones read in place),
    float64/float16/bfloat16 values, whole numbers in and out of the labels' range, NaN,
    infinities, negative zero, and tensors it does not hold (integers: always searched);
    ``_nonnegative`` likewise."""
    from medfl.guard.labels import _may_hold_runs, _nonnegative
    from medfl.guard.walk import _Floats

    g = torch.Generator().manual_seed(3)
    whole = torch.randint(-3, 12, (40,), generator=g).float()
    big = torch.randn(_Floats.VIEW_MIN + 8, generator=g)
    big[::1000] = torch.randint(0, 9, big[::1000].shape, generator=g).float()   # 33 whole numbers in range
    tensors = [torch.randn(300, generator=g), whole, big, whole.double(), whole.half(), big.abs(), whole.bfloat16(),
               torch.tensor([float("nan")] * 5 + [float("inf"), -0.0, 2.0, 3.0]), torch.rand(7, 3, generator=g),
               torch.randint(0, 5, (30,), generator=g), torch.zeros(50), torch.full((20,), 4.5),
               torch.cat([torch.arange(10.0), torch.tensor([-1e-9])]), big.reshape(-1, 8)[:, 1:]]
    lo, hi = 0, 9
    for shortest in (10, 33, 34):
        for floats in (None, _Floats(tensors[:5], tensors[5:]), _Floats(tensors)):
            runs = _may_hold_runs(tensors, lo, hi, shortest, floats)
            for t, r in zip(tensors, runs):
                if not t.is_floating_point():
                    assert r is True
                    continue
                v = t.double()
                like = ((v >= lo) & (v <= hi) & (v == v.floor())).sum().item()
                assert r == (like >= shortest), (t.dtype, t.shape, like, shortest)
                if floats is not None:
                    assert _nonnegative(t, floats) == bool((v >= 0).all()), t
