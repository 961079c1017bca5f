"""medfl reads a plain JSON config without MONAI, to the same content MONAI's ConfigParser
gives; anything MONAI's syntax could act on still goes through MONAI's parser."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from medfl.config_file import _plain_json_fl, load_bundle_config

REPO = Path(__file__).resolve().parents[1]

PLAIN = {
    "fl": {"name": "plain", "method": {"name": "fedavg", "lr": 0.01}, "rounds": 3,
           "dataset": {"name": "synthetic", "root": "/data/a b", "splits": [0.8, 0.2], "none": None},
           "model": {"name": "small_cnn", "width": 8}, "flags": [True, False, 1.5e-3, -2, "a:b c::d"]},
    "other": {"anything": [1, 2, 3]},
}


def _monai(path: Path, overrides: dict[str, Any]) -> Any:
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(path))
    for k, v in overrides.items():
        parser[k] = v
    return parser.get_parsed_content("fl")


@pytest.mark.parametrize("overrides", [
    {},
    {"fl#rounds": 7},
    {"fl::rounds": 7, "fl#method#lr": 0.5},
    {"fl#dataset#splits#1": 0.3},
    {"fl#dataset#splits#-1": 0.4},
    {"fl#model": {"name": "pfedcdp_a"}},
    {"fl#new_key": [1, {"a": 2}]},
    {"other#anything#0": "z"},
])
def test_plain_json_reads_as_monai_reads_it(tmp_path: Path, overrides: dict[str, Any]) -> None:
    path = tmp_path / "train.json"
    path.write_text(json.dumps(PLAIN))
    plain = _plain_json_fl(path, overrides)
    assert plain is not None
    assert plain == _monai(path, overrides)
    assert load_bundle_config(path, overrides) == plain


@pytest.mark.parametrize("change", [
    {"fl#rounds": "@other#anything#0"},        # a reference
    {"fl#rounds": "$1 + 2"},                     # an expression
    {"fl#name": "%other#anything"},              # a macro
    {"fl#name": "a@##b"},                        # a relative id anywhere in a string
    {"fl#name": "x#y"},                          # MONAI reads it as "x::y"
    {"fl#model": {"_target_": "torch.nn.Identity"}},
    {"fl#model": {"_requires_": "@other"}},
    {"fl#model": {"a#b": 1}},
    {"fl#missing#deeper": 1},                    # no such parent: MONAI's error
    {"fl#flags#9": 1},                           # no such list index
    {"": {"fl": {}}},
])
def test_anything_monai_could_act_on_goes_through_monai(tmp_path: Path, change: dict[str, Any]) -> None:
    path = tmp_path / "train.json"
    path.write_text(json.dumps(PLAIN))
    assert _plain_json_fl(path, change) is None


def test_duplicate_keys_yaml_and_a_missing_fl_go_through_monai(tmp_path: Path) -> None:
    dup = tmp_path / "dup.json"
    dup.write_text('{"fl": {"rounds": 1, "rounds": 2}}')
    assert _plain_json_fl(dup, {}) is None
    yml = tmp_path / "train.yaml"
    yml.write_text("fl:\n  rounds: 1\n")
    assert _plain_json_fl(yml, {}) is None
    assert load_bundle_config(yml) == {"rounds": 1}
    nofl = tmp_path / "nofl.json"
    nofl.write_text('{"other": 1}')
    with pytest.raises(KeyError, match="no 'fl' section"):
        load_bundle_config(nofl)
    bad = tmp_path / "bad.json"
    bad.write_text('{"fl": ')
    with pytest.raises(json.JSONDecodeError):
        load_bundle_config(bad)


def test_bundle_configs_with_references_are_parsed_by_monai() -> None:
    """The shipped bundles use references and expressions: MONAI resolves them as before."""
    train = REPO / "bundles" / "demo" / "configs" / "train.json"
    assert _plain_json_fl(train, {}) is None
    fl = load_bundle_config(train, {"fl#rounds": 2})
    assert fl == _monai(train, {"fl#rounds": 2}) and fl["rounds"] == 2


def test_reading_a_plain_config_does_not_import_monai(tmp_path: Path) -> None:
    path = tmp_path / "train.json"
    path.write_text(json.dumps(PLAIN))
    code = ("import sys\nfrom medfl.bundle import load_bundle_config\n"
            f"fl = load_bundle_config({str(path)!r}, {{'fl#rounds': 9}})\n"
            "assert fl['rounds'] == 9 and 'monai' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_last_line_says_a_release_without_noise_is_not_private() -> None:
    """Issue 38, item 10: a FedTPF run with ``epsilon: null`` (its release noise off) has a
    mechanism whose epsilon is None; the bundle's last line formatted it with ``:.3g`` and
    failed with ``NoneType.__format__`` after the run had written all its files."""
    from medfl.report import _privacy_line

    block = {"worst_client": "0", "unit": "sample", "delta": 1e-5, "accountant": "rdp"}
    line = _privacy_line({"privacy": {"mechanisms": {"feature_gaussian": {**block, "epsilon": None}}}})
    assert "feature_gaussian epsilon none (not private" in line
    line = _privacy_line({"privacy": {"mechanisms": {"feature_gaussian": {**block, "epsilon": float("inf")}}}})
    assert "epsilon none (not private" in line
    assert "dp_gaussian epsilon 3.99 (worst client 0" in _privacy_line(
        {"privacy": {"mechanisms": {"dp_gaussian": {**block, "epsilon": 3.9917}}}})
