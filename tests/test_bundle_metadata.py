"""Every bundle in bundles/ is a well-formed MONAI bundle: metadata with the fields MONAI's
metadata schema requires (checked here because verify_metadata downloads the schema, and
tests never touch the network), parseable configs, and a docs/README.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BUNDLES = sorted(p for p in (Path(__file__).resolve().parents[1] / "bundles").iterdir()
                 if (p / "configs").is_dir())
REQUIRED = {"schema", "version", "changelog", "monai_version", "pytorch_version", "numpy_version",
            "task", "description", "authors", "copyright", "network_data_format"}
TENSOR = {"type", "format", "num_channels", "spatial_shape", "dtype", "value_range"}


@pytest.mark.parametrize("bundle", BUNDLES, ids=[b.name for b in BUNDLES])
def test_bundle_is_well_formed(bundle: Path):
    from monai.bundle import ConfigParser

    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    assert REQUIRED <= set(meta), f"{bundle.name}: missing {sorted(REQUIRED - set(meta))}"
    assert meta["version"] in meta["changelog"]
    fmt = meta["network_data_format"]
    for side in ("inputs", "outputs"):
        assert fmt[side], f"{bundle.name}: no {side}"
        for name, spec in fmt[side].items():
            assert TENSOR <= set(spec), f"{bundle.name}: {side}.{name} lacks {sorted(TENSOR - set(spec))}"
    train = ConfigParser.load_config_file(str(bundle / "configs" / "train.json"))
    assert "fl" in train and "run" in train
    assert (bundle / "docs" / "README.md").is_file()
    ConfigParser.load_config_file(str(bundle / "configs" / "inference.json"))


@pytest.mark.parametrize("bundle", BUNDLES, ids=[b.name for b in BUNDLES])
def test_bundle_metadata_uses_no_deprecated_key(bundle: Path):
    """MONAI renames deprecated metadata keys with a warning at every run
    (``optional_packages_version`` -> ``required_packages_version``): follow the current schema."""
    from monai.bundle.utils import DEPRECATED_ID_MAPPING

    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    old = sorted(set(meta) & set(DEPRECATED_ID_MAPPING))
    assert not old, f"{bundle.name}: deprecated {old}; use {[DEPRECATED_ID_MAPPING[k] for k in old]}"
