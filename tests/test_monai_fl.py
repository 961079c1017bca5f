"""MONAI FL drives a medfl bundle: ``monai.fl.client.MonaiAlgo`` initializes every training
bundle (its ``train#trainer`` and ``validate#evaluator``, medfl.monai_fl), and on the demo
bundle two sites train, exchange weights through a FedAvg mean written here, evaluate, and
start a second round from the mean."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("ignite", reason="MONAI FL's engines need pytorch-ignite: pip install -e '.[monaifl]'")

from monai.bundle import ConfigWorkflow  # noqa: E402
from monai.engines import SupervisedEvaluator, SupervisedTrainer  # noqa: E402
from monai.fl.client import MonaiAlgo  # noqa: E402
from monai.fl.utils.constants import ExtraItems, WeightType  # noqa: E402
from monai.fl.utils.exchange_object import ExchangeObject  # noqa: E402

from medfl.monai_fl import Site, SiteDataset, SiteLoader  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUNDLES = sorted(p.parent.parent for p in (ROOT / "bundles").glob("*/configs/train.json"))
#: the demo bundle's fixture-sized overlay (240 generated images; what its README's try runs)
TRY = ["configs/train.json", "configs/try.json"]
#: train.json's keys of MONAI's single-site workflow (beside medfl's ``fl`` and ``run``)
MONAI_KEYS = ("client_id", "site", "network", "loss", "optimizer", "train", "validate")

pytestmark = pytest.mark.filterwarnings("ignore:executing the bundle config")


def _algo(bundle_root: Path, client_id: int, files: list[str], **overrides) -> MonaiAlgo:
    """A MonaiAlgo of ``bundle_root`` (its config ``files``) serving ``client_id``,
    initialized as an FL client is."""
    kwargs = {"client_id": client_id, **overrides}
    algo = MonaiAlgo(bundle_root=str(bundle_root), local_epochs=1, config_train_filename=files,
                     config_evaluate_filename=[*files, "configs/evaluate.json"],
                     train_kwargs=dict(kwargs), eval_kwargs=dict(kwargs))
    algo.initialize({ExtraItems.CLIENT_NAME: f"site-{client_id}"})
    return algo


@pytest.mark.parametrize("bundle", BUNDLES, ids=[b.name for b in BUNDLES])
def test_monai_algo_initializes_every_bundle(bundle: Path):
    """Parse only (no data is read; the networks narrowed to width 4): MonaiAlgo's trainer,
    evaluator and network are MONAI's, the train workflow has every property MONAI requires,
    and network_def, parsed without metadata.json as MonaiAlgo parses it, maps the metadata's
    input to its number of classes."""
    train = json.loads((bundle / "configs" / "train.json").read_text())
    narrow = {"fl#model#width": 4} if "width" in train["fl"]["model"] else {}
    algo = _algo(bundle, 1, ["configs/train.json"], **narrow)
    assert isinstance(algo.trainer, SupervisedTrainer) and isinstance(algo.evaluator, SupervisedEvaluator)
    assert algo.trainer.state.max_epochs == 1
    assert isinstance(algo.trainer.optimizer, torch.optim.Optimizer)
    assert isinstance(algo.trainer.loss_function, torch.nn.CrossEntropyLoss)
    net = algo.trainer.network
    assert type(net) is type(algo.train_workflow.network_def) is type(algo.evaluator.network)
    assert algo.train_workflow.check_properties() == []
    assert algo.evaluator.state.key_metric_name == "val_accuracy"
    loader = algo.trainer.data_loader
    assert isinstance(loader, SiteLoader) and isinstance(loader.dataset, SiteDataset)
    assert loader.dataset._ds is None and loader.dataset.site._data is None   # nothing read
    has_val = float(train["fl"].get("client_split", {"val": 0.15}).get("val", 0)) > 0   # medfl's default has one
    assert loader.dataset.site.client_id == 1 and loader.dataset.split == "train"
    assert algo.evaluator.data_loader.dataset.split == ("val" if has_val else "test")

    # the MONAI workflow is the same in every bundle (docs/bundles.md, "Run with MONAI FL")
    demo = json.loads((ROOT / "bundles" / "demo" / "configs" / "train.json").read_text())
    assert {k: train[k] for k in MONAI_KEYS} == {k: demo[k] for k in MONAI_KEYS}

    meta = json.loads((bundle / "configs" / "metadata.json").read_text())["network_data_format"]
    image, pred = meta["inputs"]["image"], meta["outputs"]["pred"]
    side = [32] * len(image["spatial_shape"]) if "width" in train["fl"]["model"] else image["spatial_shape"]
    with torch.no_grad():
        out = net.eval()(torch.zeros(1, image["num_channels"], *side))
    assert out.shape == (1, pred["num_channels"])


def _state(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _fedavg(global_weights: dict[str, torch.Tensor], replies: list[ExchangeObject]) -> dict[str, torch.Tensor]:
    """FedAvg (unweighted) of weight differences: global + the mean of the sites' updates."""
    out = {}
    for k, g in global_weights.items():
        mean = sum(r.weights[k].float() for r in replies) / len(replies)
        out[k] = (g.float() + mean).to(g.dtype)
    return out


def test_monai_algo_trains_two_sites_of_the_demo(tmp_path):
    bundle = tmp_path / "demo"
    shutil.copytree(ROOT / "bundles" / "demo", bundle, ignore=shutil.ignore_patterns("runs", "data", "__pycache__"))
    torch.manual_seed(0)
    algos = [_algo(bundle, k, TRY) for k in (0, 1)]
    starts: list[dict[str, torch.Tensor]] = []
    from ignite.engine import Events

    # what the network holds when each round's local epoch starts
    algos[0].trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: starts.append(_state(e.network)))
    global_weights = _state(algos[0].trainer.network)
    for a in algos:
        a.train(ExchangeObject(weights=global_weights, weight_type=WeightType.WEIGHTS))
    replies = [a.get_weights() for a in algos]
    for r in replies:
        assert r.weight_type == WeightType.WEIGHT_DIFF and r.statistics["num_executed_iterations"] >= 1
        assert any(bool(d.abs().max() > 0) for k, d in r.weights.items() if d.is_floating_point())  # weights changed
    # each site trained on its own split: different updates
    assert any(not torch.equal(replies[0].weights[k], replies[1].weights[k]) for k in replies[0].weights)
    aggregated = _fedavg(global_weights, replies)
    accuracies = []
    for a in algos:
        metrics = a.evaluate(ExchangeObject(weights=aggregated, weight_type=WeightType.WEIGHTS)).metrics
        accuracies.append(metrics["val_accuracy"])
        assert math.isfinite(metrics["val_accuracy"]) and 0.0 <= metrics["val_accuracy"] <= 1.0
    torch.testing.assert_close(_state(algos[1].evaluator.network), aggregated)

    # round 2 starts from the aggregate
    algos[0].train(ExchangeObject(weights=aggregated, weight_type=WeightType.WEIGHTS))
    assert len(starts) == 2 and algos[0].trainer.state.epoch == 2
    torch.testing.assert_close(starts[1], aggregated)
    assert not all(torch.equal(starts[0][k], starts[1][k]) for k in aggregated)
    second = algos[0].get_weights()
    torch.testing.assert_close(_state(algos[0].trainer.network),
                               {k: (aggregated[k].float() + second.weights[k]).to(aggregated[k].dtype)
                                for k in aggregated})
    for a in algos:
        a.finalize()

    # configs/evaluate.json from MONAI's bundle runner: models/model.pt on site 1's split gives
    # the accuracy MonaiAlgo reported for the same weights
    torch.save(aggregated, bundle / "models" / "model.pt")
    configs = bundle / "configs"
    wf = ConfigWorkflow(config_file=[str(configs / f) for f in ("train.json", "try.json", "evaluate.json")],
                        logging_file=False, workflow_type="train", bundle_root=str(bundle), client_id=1)
    wf.initialize()
    wf.run()
    assert wf.evaluator.state.metrics["val_accuracy"] == pytest.approx(accuracies[1])


def test_site_names_a_client_that_is_not_in_the_partition(tmp_path):
    from medfl.config import ConfigError

    fl = {"name": "t", "output_dir": str(tmp_path), "num_clients": 2, "seed": 0,
          "dataset": {"name": "synthetic2d", "root": str(tmp_path / "data"), "num_samples": 120,
                      "num_classes": 3, "image_size": 16},
          "partition": {"name": "dirichlet", "alpha": 5.0, "min_size": 10}}
    with pytest.raises(ConfigError, match=r"client_id: 5 is not a client .* 0 \(client_0\), 1 \(client_1\)"):
        Site(fl, 5).data()
    assert Site(fl, "client_1").data()[1] == "1"    # a client's name works as well
    assert len(Site(fl, 1).dataset("train")) > 0 and Site(fl, 0).eval_split == "val"
    with pytest.raises(ConfigError, match="split 'tset' is not one of train, val, test"):
        Site(fl, 0).dataset("tset")


def test_network_def_takes_its_shape_without_metadata():
    from medfl.export import network_def

    net = network_def({"name": "resnet10", "width": 4}, spatial_dims=2, in_channels=1, num_classes=3)
    assert net(torch.zeros(2, 1, 16, 16)).shape == (2, 3)
    meta = json.loads((ROOT / "bundles" / "demo" / "configs" / "metadata.json").read_text())
    with pytest.raises(ValueError, match="num_classes is 4 but metadata.json's"):
        network_def({"name": "resnet10", "width": 4}, meta, num_classes=4)
    with pytest.raises(ValueError, match="unknown argument.* classes; expected spatial_dims, in_channels, num_classes"):
        network_def({"name": "resnet10", "width": 4}, spatial_dims=2, in_channels=1, classes=3)


def test_the_docs_block_gives_the_first_global_weights(tmp_path, monkeypatch):
    """docs/bundles.md's MONAI FL block as written, from a folder laid out as the repository
    root: train.json's network_def gives weights the site's network takes, and the site has
    none to send before it trains (MONAI's behaviour, which the docs name)."""
    import re

    text = (ROOT / "docs" / "bundles.md").read_text(encoding="utf-8")
    section = text.split("## Run with MONAI FL", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```python\n(.*?)^```", section, re.S | re.M).group(1)
    shutil.copytree(ROOT / "bundles" / "demo", tmp_path / "bundles" / "demo",
                    ignore=shutil.ignore_patterns("runs", "data", "__pycache__"))
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, "docs/bundles.md", "exec"), scope)
    algo, weights = scope["algo"], scope["global_weights"]
    net = algo.trainer.network
    assert set(weights) == set(net.state_dict())
    net.load_state_dict(weights, strict=True)
    with pytest.raises(ValueError, match="global_weights` is None"):
        algo.get_weights()
    assert "get_weights()` before the first `train()` raises" in " ".join(section.split())
