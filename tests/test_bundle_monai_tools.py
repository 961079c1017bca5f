"""MONAI's own bundle tools accept every medfl bundle: the inference workflow's required
properties (``ConfigWorkflow.check_properties``), a ``network_def`` that is the network the
``fl`` section trains, and ``verify_net_in_out`` / ``ckpt_export`` on the demo bundle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BUNDLES = sorted(p for p in (Path(__file__).resolve().parents[1] / "bundles").iterdir()
                 if (p / "configs").is_dir())
#: every training config of every bundle (train.json, and ham10000's fedtpf.json beside it;
#: try.json is an overlay of train.json, tests/test_bundle_readmes.py runs it; evaluate.json
#: one of train.json's MONAI workflow, tests/test_monai_fl.py runs it)
TRAIN_CONFIGS = sorted(c for b in BUNDLES for c in (b / "configs").glob("*.json")
                       if c.name not in ("inference.json", "metadata.json", "try.json", "evaluate.json"))
DEMO = Path(__file__).resolve().parents[1] / "bundles" / "demo"
ENV = {**os.environ, "MEDFL_NO_PROGRESS": "1"}


@pytest.mark.parametrize("bundle", BUNDLES, ids=[b.name for b in BUNDLES])
def test_infer_workflow_has_every_required_property(bundle: Path):
    from monai.bundle import ConfigWorkflow

    from medfl.export import RunPredictor, SourceDataset

    configs = bundle / "configs"
    wf = ConfigWorkflow(config_file=str(configs / "inference.json"), meta_file=str(configs / "metadata.json"),
                        workflow_type="infer")
    wf.initialize()
    assert wf.check_properties() == []
    assert isinstance(wf.network_def, torch.nn.Module)
    assert isinstance(wf.dataset, SourceDataset) and isinstance(wf.evaluator, RunPredictor)
    # the inference config's model is the one train.json's fl section trains
    train = json.loads((configs / "train.json").read_text())
    assert json.loads((configs / "inference.json").read_text())["model"] == train["fl"]["model"]


@pytest.mark.parametrize("config", TRAIN_CONFIGS, ids=[f"{c.parent.parent.name}/{c.name}" for c in TRAIN_CONFIGS])
def test_network_def_is_the_trained_network(config: Path):
    """Every training config's network_def takes the state dict of the model medfl builds
    from the same spec (ResNets: MONAI's own ResNet with ``fc.`` for ``head.``) and gives its
    outputs."""
    from monai.bundle import ConfigParser

    from medfl.export import complete_spec, monai_state, network_config
    from medfl.models.registry import build_model

    configs = config.parent
    parser = ConfigParser()
    parser.read_config(str(config))
    parser.read_meta(str(configs / "metadata.json"))
    net = parser.get_parsed_content("network_def").eval()
    spec = complete_spec(parser.get_parsed_content("fl#model"), parser.get("_meta_"))
    medfl_model = build_model({**spec, **({"width": 4} if "width" in spec else {})}).eval()
    small = network_config({**spec, **({"width": 4} if "width" in spec else {})})
    assert type(net).__name__ == ("ResNet" if small["_target_"].startswith("monai.") else type(medfl_model).__name__)
    # at full width the shapes must match; outputs are compared on a narrow copy (fast)
    net.load_state_dict(monai_state(network_config(spec), build_model(spec).state_dict()), strict=True)
    from medfl.export import instantiate

    narrow = instantiate(small).eval()
    narrow.load_state_dict(monai_state(small, medfl_model.state_dict()), strict=True)
    side = 32 if spec["spatial_dims"] == 2 else 16
    x = torch.rand((1, spec["in_channels"], *[side] * spec["spatial_dims"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(narrow(x), medfl_model(x), atol=1e-5, rtol=1e-5)


def test_verify_net_in_out_and_ckpt_export_on_the_demo(tmp_path):
    configs = DEMO / "configs"
    common = ["--config_file", str(configs / "train.json"), "--meta_file", str(configs / "metadata.json")]
    proc = subprocess.run([sys.executable, "-m", "monai.bundle", "verify_net_in_out", "network_def", *common],
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data shape of network is verified with no error" in proc.stdout + proc.stderr
    # a checkpoint in network_def's key names: what `medfl export` writes as models/model.pt
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(configs / "train.json"))
    parser.read_meta(str(configs / "metadata.json"))
    net = parser.get_parsed_content("network_def")
    torch.save(net.state_dict(), tmp_path / "model.pt")
    proc = subprocess.run([sys.executable, "-m", "monai.bundle", "ckpt_export", "network_def",
                           "--filepath", str(tmp_path / "model.ts"), "--ckpt_file", str(tmp_path / "model.pt"), *common],
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ts = torch.jit.load(str(tmp_path / "model.ts")).eval()
    x = torch.rand(2, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ts(x), net.eval()(x))
