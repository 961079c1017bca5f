"""python -m medfl.fixtures: every dataset, generator options through --set, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from medfl.fixtures import GENERATORS, generate


def test_cli_passes_options_and_rejects_unknown_ones(tmp_path):
    cmd = [sys.executable, "-m", "medfl.fixtures", "cbis_ddsm", "--out", str(tmp_path / "c"), "--cases", "4",
           "--set", "layout=classic", "--set", "size=[32,20]", "--synthetic-rows"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert info["layout"] == "classic" and info["size"] == [32, 20] and info["rows_from"] == "synthetic"
    assert (tmp_path / "c" / "CBIS-DDSM").is_dir() and not (tmp_path / "c" / "metadata.csv").exists()
    bad = subprocess.run([sys.executable, "-m", "medfl.fixtures", "mias", "--out", str(tmp_path / "m"),
                          "--set", "layuot=x"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "takes no option(s) layuot; valid:" in bad.stderr
    with pytest.raises(ValueError, match="unknown fixture dataset 'isic'"):
        generate("isic", tmp_path / "i")
    assert sorted(GENERATORS) == ["abide", "cbis_ddsm", "derm7pt", "ham10000", "medmnist", "mias"]
