"""Per-sample releases over Flower (the loop-back transport of test_coordinator.py: the
coordinator's and the sites' real code): medfl performs the release at the site, so raw
images a plugin returns under a release key reach the coordinator noised at the declared
noise multiplier; a release key in a training reply is refused at every site, which stops
the run with the sites' reasons; the old contract is refused before anything is sent
(issue 38, item 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pandas as pd
import pytest

pytest.importorskip("flwr", reason="Flower is a dependency of medfl")

from medfl.config import resolve_config  # noqa: E402
from medfl.engine.remote import SiteFailure  # noqa: E402
from medfl.flower.server import run_flower_experiment  # noqa: E402
from medfl.privacy.accounting import PrivacyConfigError, noise_for_epsilon  # noqa: E402

from flower_cases import fl_config  # noqa: E402
from release_probes import CLIP, DELTA, EPSILON, RawRelease, noise_std, probes_registered  # noqa: E402
from test_coordinator import FAST, LoopTransport, _sites  # noqa: E402


JOB: dict[str, Any] = {"rounds": 1, "model": {"name": "small_cnn", "width": 4},
                       "train": {"batch_size": 8, "lr": 0.05}, "methods": [{"name": "raw_release_probe"}]}


@pytest.fixture
def probes() -> Iterator[None]:
    """The probe methods, registered for one test (the loop-back sites run in this process)."""
    yield from probes_registered()


def _run(tmp_path: Path, name: str, **entry: Any) -> tuple[Path, LoopTransport]:
    job = {**JOB, "methods": [{"name": entry.pop("name", "raw_release_probe"), **entry}]}
    fl = fl_config(tmp_path, name, job)
    grid = LoopTransport(_sites(tmp_path, fl))
    out = run_flower_experiment(resolve_config(fl), grid, FAST)
    return Path(out["dir"]) / job["methods"][0]["name"], grid


def test_raw_images_leave_a_site_noised_at_the_declared_epsilon(tmp_path: Path, probes: Any) -> None:
    run, _ = _run(tmp_path, "raw")
    z = noise_for_epsilon(EPSILON, DELTA, 1.0, 1, "rdp")
    assert sorted(RawRelease.received) == ["0", "1", "2"]              # decoded from the sites' messages
    assert noise_std(sorted(RawRelease.received)) == pytest.approx(z * CLIP, rel=0.03)
    privacy = pd.read_csv(run / "privacy.csv", dtype={"client_id": str})
    assert privacy["client_id"].tolist() == ["0", "1", "2"] and (privacy["epsilon"] <= EPSILON).all()


def test_a_release_key_in_a_training_reply_is_refused_at_the_site(tmp_path: Path, probes: Any) -> None:
    with pytest.raises(SiteFailure, match=r"site 0 failed in train of round 1.*\['shared_x'\] carries release "
                                          r"'raw_images'.*may not carry it"):
        _run(tmp_path, "stray", stray=True)


def test_the_old_contract_is_refused_before_anything_is_sent(tmp_path: Path, probes: Any) -> None:
    fl = fl_config(tmp_path, "old", {**JOB, "methods": [{"name": "old_release_probe"}]})
    grid = LoopTransport(_sites(tmp_path, fl))
    with pytest.raises(PrivacyConfigError, match="sets payload_exemptions"):
        run_flower_experiment(resolve_config(fl), grid, FAST)
    assert not RawRelease.received and not RawRelease.sent
