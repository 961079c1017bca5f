"""benchmarks/compare.py (issue 50, item 3): a revision unpacked beside the working tree
imports its own medfl, engine_overhead's reports read into the figures a note quotes, and the
summary's medians and ratios. The timed runs themselves are a benchmark, not a test."""

from __future__ import annotations

import importlib.util
import math
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("compare_bench", ROOT / "benchmarks" / "compare.py")
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)


def _timing(own_s: float, per_round: float, wall: float) -> dict:
    return {"timing": {"besides_training": {"medfl_own_s": own_s, "per_round_equal_training": per_round},
                       "targets": {"medfl_vs_plain": {"ratio": wall, "target": 1.05, "pass": False}}}}


def test_reports_read_into_figures_and_medians() -> None:
    assert compare.figures(_timing(0.029, 1.041, 1.4)) == {"own_ms": 29.0, "per_round_equal": 1.041, "wall_ratio": 1.4}
    with pytest.raises(ValueError, match="not an engine_overhead timing report"):
        compare.figures({"timing": {}})
    assert compare.step_figures({"steps_ms_per_client_update": {"type walks + payload guard (client)": 1.89}}) == \
        {"type walks + payload guard (client)": 1.89}
    with pytest.raises(ValueError, match="--steps report"):
        compare.step_figures(_timing(0.1, 1.0, 1.0))
    base = [compare.figures(_timing(s, 1.0, 1.2)) for s in (0.030, 0.020, 0.025)]
    head = [compare.figures(_timing(s, 1.1, 1.2)) for s in (0.050, 0.040, 0.060)]
    rows = {k: (b, h, r) for k, b, h, r in compare.summarize(base, head)}
    assert rows["own_ms"] == pytest.approx((25.0, 50.0, 2.0))
    assert rows["per_round_equal"] == pytest.approx((1.0, 1.1, 1.1))
    zero = compare.summarize([{"x": 0.0}], [{"x": 1.0}])
    assert zero[0][:3] == ("x", 0.0, 1.0) and math.isnan(zero[0][3])


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout with git")
def test_a_revision_runs_from_its_own_folder(tmp_path: Path) -> None:
    tree, label = compare.prepare("HEAD", tmp_path)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert tree == tmp_path / commit[:12] and label == f"HEAD ({commit[:10]})"
    assert (tree / "benchmarks" / "engine_overhead.py").is_file()
    assert (tree / ".shim" / "medfl_plugins").resolve() == (tree / "plugins").resolve()
    compare.check_imports(tree, compare.side_env(tree, tmp_path))        # its own medfl and plugins
    with pytest.raises(SystemExit, match="imports medfl from elsewhere"):
        compare.check_imports(tree, compare.side_env(ROOT, tmp_path))   # the working tree's: refused
    (tree / "COMMIT").write_text(f"HEAD {commit}\n")                   # as gpu_session.sh base leaves it
    assert compare.prepare(str(tree), tmp_path / "elsewhere") == (tree.resolve(), f"HEAD ({commit[:10]})")
    with pytest.raises(SystemExit, match="compare.py: git rev-parse"):
        compare.prepare("no-such-revision-xyz", tmp_path)
