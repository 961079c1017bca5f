"""Per-sample releases are performed by medfl, not by the method (issue 38, item 1).

An outside plugin (defined here and registered as tests do) declares a release and returns
its client's raw training images unchanged under the release key. Before, a method's own
``payload_exemptions`` and the ``dp_release`` flag excused those keys from the content guard:
the images left raw, the run ended with rc 0 and the ledger counted a private release. Now
medfl noises them at the client at the declared noise multiplier (measured here: the released
tensor minus the image has the std the plan says, in process and at the sites of a loop-back
Flower grid), a method that noised them itself gets medfl's noise on top, a release without
noise of the raw images is refused by the guard, and a release key in any other reply, a
method's metrics named like medfl's record and the old contract are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pandas as pd
import pytest
import torch

from medfl.experiment import run_experiment
from medfl.messages import Instruction, PayloadError, Reply
from medfl.privacy.accounting import PrivacyConfigError, noise_for_epsilon

from release_probes import CLIP, DELTA, EPSILON, RawRelease, noise_std, probes_registered


@pytest.fixture
def probes() -> Iterator[None]:
    """The probe methods, registered for one test."""
    yield from probes_registered()


def _run(tiny_fl: dict[str, Any], resolve: Any, **entry: Any) -> Path:
    tiny_fl.update(rounds=1, methods=[{"name": entry.pop("name", "raw_release_probe"), **entry}])
    return Path(run_experiment(resolve(tiny_fl))["dir"])


def test_raw_images_under_a_release_key_are_noised_by_medfl_at_the_declared_epsilon(
        probes: Any, tiny_fl: dict[str, Any], resolve: Any) -> None:
    run = _run(tiny_fl, resolve) / "raw_release_probe"
    z = noise_for_epsilon(EPSILON, DELTA, 1.0, 1, "rdp")
    clients = sorted(RawRelease.received)
    assert clients == ["0", "1", "2"]
    assert noise_std(clients) == pytest.approx(z * CLIP, rel=0.03)           # the plan's std, added by medfl
    privacy = pd.read_csv(run / "privacy.csv", dtype={"client_id": str})
    assert privacy["mechanism"].tolist() == ["raw_images"] * 3 and (privacy["epsilon"] <= EPSILON).all()
    trained = pd.read_csv(run / "train_metrics.csv", dtype={"client_id": str})
    release = trained.dropna(subset=["noise_std"])                            # medfl's record of it
    assert release["noise_std"].tolist() == pytest.approx([z * CLIP] * 3)
    assert release["clipped_fraction"].tolist() == [0.0] * 3
    described = json.loads((run / "config.json").read_text())["privacy"]["raw_images"]
    assert described["performed_by"].startswith("medfl at the client") and described["keys"] == ["shared_x"]


def test_noise_a_method_adds_itself_gets_medfls_noise_on_top(probes: Any, tiny_fl: dict[str, Any],
                                                             resolve: Any) -> None:
    """The method's own noise (kept small enough that no sample is clipped) stays, and
    medfl's whole noise is added to what the method returned."""
    z = noise_for_epsilon(EPSILON, DELTA, 1.0, 1, "rdp")
    own = 0.02 * CLIP
    _run(tiny_fl, resolve, own_noise=own)
    clients = sorted(RawRelease.received)
    own_std = float(torch.cat([(RawRelease.sent[c] - RawRelease.raw[c]).flatten() for c in clients]).std())
    assert own_std == pytest.approx(own, rel=0.03)
    assert noise_std(clients, RawRelease.sent) == pytest.approx(z * CLIP, rel=0.03)
    assert noise_std(clients) == pytest.approx((own ** 2 + (z * CLIP) ** 2) ** 0.5, rel=0.03)


def test_an_unnoised_release_of_the_images_is_refused_by_the_guard(probes: Any, tiny_fl: dict[str, Any],
                                                                   resolve: Any) -> None:
    """``epsilon: null``: nothing hides the features, so the guard judges them as returned."""
    with pytest.raises(PayloadError, match=r"reply of method 'raw_release_probe' from client 0\['shared_x'\]: "
                                           r"holds image \d+ of client 0's train split"):
        _run(tiny_fl, resolve, epsilon=None)
    assert not RawRelease.received


def test_an_unnoised_release_of_other_features_says_it_is_not_private(probes: Any, tiny_fl: dict[str, Any],
                                                                      resolve: Any) -> None:
    run = _run(tiny_fl, resolve, epsilon=None, features="projection") / "raw_release_probe"
    assert noise_std(sorted(RawRelease.received)) == 0.0
    summary = json.loads((run / "summary.json").read_text())["privacy"]
    assert summary["private"] is False and summary["non_private_releases"] == ["raw_images"]
    assert "without noise" in summary["unnoised_release"]
    described = json.loads((run / "config.json").read_text())["privacy"]["raw_images"]
    assert described["private"] is False and "as the method returned them" in described["content_guard"]


def test_a_release_key_outside_the_release_is_refused(probes: Any, tiny_fl: dict[str, Any], resolve: Any) -> None:
    """Images with a little noise of the method's own under the release key, in a training
    reply: the guard cannot recognise them, but the key is the release's, and medfl performs
    the release only where it was asked for (and counted)."""
    with pytest.raises(PayloadError, match=r"\['shared_x'\] carries release 'raw_images'.*may not carry it"):
        _run(tiny_fl, resolve, stray=True)


def test_the_old_contract_is_refused_before_training(probes: Any, tiny_fl: dict[str, Any], resolve: Any) -> None:
    """Before issue 38 this run sent every client's images raw, with rc 0 and a private
    ``privacy.csv`` row per client."""
    with pytest.raises(PrivacyConfigError, match=r"method 'old_release_probe' sets payload_exemptions"):
        _run(tiny_fl, resolve, name="old_release_probe")
    assert not RawRelease.received


def test_a_method_may_not_write_medfls_record_of_the_release(probes: Any, tiny_fl: dict[str, Any],
                                                             resolve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    real = RawRelease.client_update

    def claims(self: RawRelease, client: Any, instruction: Instruction) -> Reply:
        reply = real(self, client, instruction)
        if instruction.config.get("dp_release") is True:
            reply.metrics["noise_std"] = 1e6
        return reply

    monkeypatch.setattr(RawRelease, "client_update", claims)
    with pytest.raises(PayloadError, match=r"\['noise_std'\] are medfl's record of release 'raw_images'"):
        _run(tiny_fl, resolve)


def test_only_the_training_labels_may_travel_under_the_labels_key(probes: Any, tiny_fl: dict[str, Any],
                                                                  resolve: Any) -> None:
    with pytest.raises(PayloadError, match=r"\['shared_y'\]: release 'raw_images' sends the labels of the "
                                           r"client's \d+ training samples in the clear"):
        _run(tiny_fl, resolve, features="other labels")
    assert not RawRelease.received
