"""Noise the coordinator cannot remove, over Flower (issue 38, items 0 and 8), on the
loop-back transport of test_coordinator.py (the coordinator's and the sites' real code):

* each site draws fresh randomness of its own for every run: two runs with the same seed and
  config at noise multiplier 1 and 2 give independent noise, not one draw at two scales, and
  a coordinator that knows the run seed, the config and even the site's ``noise.key`` cannot
  regenerate a site's noise;
* each site keeps a ledger of what it released: asked again for a round's release with the
  same instruction it sends the very same bytes, with another noise multiplier it refuses,
  naming the rule.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

pytest.importorskip("flwr", reason="Flower is a dependency of medfl")

from medfl import wire  # noqa: E402
from medfl.config import resolve_config  # noqa: E402
from medfl.filters import FilterChain  # noqa: E402
from medfl.engine import protocol as P  # noqa: E402
from medfl.flower.server import run_flower_experiment  # noqa: E402
from medfl.site import REPRODUCIBLE_NOISE_ENV, SiteError, instruction_digest  # noqa: E402
from medfl.site_messages import answer_message  # noqa: E402
from medfl.messages import Instruction  # noqa: E402
from medfl.method import derive_seed  # noqa: E402
from medfl.plugins import lookup  # noqa: E402
from medfl.privacy.releases import payload_digest  # noqa: E402
from medfl.transport import Outgoing  # noqa: E402

from flower_cases import fl_config  # noqa: E402
from test_coordinator import FAST, LoopTransport, _sites  # noqa: E402


#: a clip so small that a release is almost all noise: what the site sent is its noise
CLIP = 1e-3


class RecordingTransport(LoopTransport):
    """The loop-back transport, keeping every training message's content and every site's
    answer to it, each as :func:`medfl.wire.encode` bytes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, tamper=self._keep, **kwargs)
        self.asked: list[tuple[int, bytes]] = []          # (node, the train message's content)
        self.answered: dict[tuple[int, str], bytes] = {}  # (round, client) -> its train answer's content

    def send(self, messages: list[Outgoing]) -> list[str]:
        self.asked += [(m.node, wire.encode(m.content)) for m in messages if m.kind == P.TRAIN]
        return super().send(messages)

    def _keep(self, node: int, kind: str, ctl: dict[str, Any], out: wire.Content) -> wire.Content:
        if kind == P.TRAIN:
            self.answered[(int(ctl["round"]), str(ctl["client"]))] = wire.encode(out)
        return out


def _dp_run(work: Path, name: str, sigma: float) -> tuple[RecordingTransport, Path]:
    """One round of FedAvg under dp_gaussian at noise multiplier ``sigma`` over the grid, the
    sites keeping their state (and their noise.key) in ``work/state``."""
    job = {"rounds": 1, "eval_every": 0, "model": {"name": "small_cnn", "width": 4},
           "train": {"batch_size": 8, "lr": 0.05}, "methods": [{"name": "fedavg"}],
           "filters": [{"name": "dp_gaussian", "noise_multiplier": sigma, "clip": CLIP}]}
    fl = fl_config(work, name, job)
    grid = RecordingTransport(_sites(work, fl))
    out = run_flower_experiment(resolve_config(fl), grid, FAST)
    return grid, Path(out["dir"]) / "fedavg"


def _released(grid: RecordingTransport, cid: str) -> dict[str, torch.Tensor]:
    return wire.take(wire.decode(grid.answered[(1, cid)]), "reply.payload", "test")["model"]


def _flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[k].double().flatten() for k in sorted(state)])


def _regenerated(ctl: dict[str, Any], released: dict[str, torch.Tensor], noise_key: str) -> dict[str, torch.Tensor]:
    """The noise a coordinator would draw for ``ctl``'s release with ``noise_key``: the
    site's own filter chain applied, with the same seeds, to a zero update."""
    cid = str(ctl["client"])
    zeros = {k: torch.zeros_like(v) for k, v in released.items()}
    out = FilterChain.from_specs(ctl["filters"]).apply(
        lookup("method", "fedavg"), {"model": zeros}, {"model": zeros}, client_id=cid, round=int(ctl["round"]),
        step=int(ctl["step"]), seed=derive_seed(int(ctl["seed"]), int(ctl["round"]), cid), model_spec=ctl["model"],
        where="the coordinator's guess", noise_key=noise_key)
    return out["model"]


def test_two_runs_at_two_noise_levels_draw_independent_noise_the_coordinator_cannot_regenerate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REPRODUCIBLE_NOISE_ENV, raising=False)
    one, run_one = _dp_run(tmp_path, "sigma1", 1.0)
    two, _ = _dp_run(tmp_path, "sigma2", 2.0)
    for cid in ("0", "1", "2"):
        a, b = _flat(_released(one, cid)), _flat(_released(two, cid))
        # the algebra: a = u + C z and b = u + 2 C z would give u = 2a - b, of norm <= C
        u = 2 * a - b
        assert float(u.norm()) > 10 * CLIP, f"site {cid}: the coordinator solved the clipped update from two runs"
        corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
        assert abs(corr) < 0.25, f"site {cid}: the two runs' noise is correlated ({corr:.3f})"
    # what the coordinator knows: the run seed, the config (the control record it sent) and,
    # say, site 0's persistent noise.key; with them it still cannot draw site 0's noise
    node, content = one.asked[0]
    ctl = wire.take_json(wire.decode(content), P.CONTROL, "test")
    site = one.sites[node]
    released = _released(one, str(ctl["client"]))
    known_key = (site.settings.state_dir / "noise.key").read_text().strip()
    for key in ("", known_key):
        guess = _regenerated(ctl, released, key)
        left = _flat(released) - _flat(guess)
        assert float(left.norm()) > 10 * CLIP, (
            f"the coordinator regenerated site {ctl['client']}'s noise from the run seed"
            f"{' and its noise.key' if key else ''}")
    # the site itself, with the secret it drew for this run and the digest of the request's
    # instruction, regenerates it exactly (what is left is the clipped update): so the
    # guesses above failed for want of that secret
    run_id = json.loads((run_one / "flower.json").read_text())["run_id"]
    assert ctl["run"] == run_id
    run_secret = site.run_noise_key(ctl)
    assert run_secret and run_secret != known_key
    assert (site.settings.state_dir / run_id / f"site_{site.client_id}" / "noise_run.key").is_file()
    ins = Instruction(payload=wire.take(wire.decode(content), "ins.payload", "t"),
                      config=wire.take(wire.decode(content), "ins.config", "t"))
    secret = site.request_noise_key(ctl, instruction_digest(ctl, ins))
    assert secret not in (run_secret, known_key)
    left = _flat(released) - _flat(_regenerated(ctl, released, run_secret))
    assert float(left.norm()) > 10 * CLIP, "the run's secret alone regenerated noise that names the instruction"
    left = _flat(released) - _flat(_regenerated(ctl, released, secret))
    assert float(left.norm()) <= CLIP * (1 + 1e-6)


def test_a_site_replays_a_release_for_the_same_instruction_and_refuses_another_noise_level(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REPRODUCIBLE_NOISE_ENV, raising=False)
    grid, run_dir = _dp_run(tmp_path, "ledger", 1.0)
    node, content = grid.asked[0]
    site = grid.sites[node]
    ctl = wire.take_json(wire.decode(content), P.CONTROL, "test")
    cid = str(ctl["client"])
    # the same request again (as a resumed coordinator sends it): the very same bytes
    again = wire.encode(answer_message(site, P.TRAIN, wire.decode(content)))
    assert again == grid.answered[(1, cid)]
    # the same round at another noise level: refused before anything is released
    for change in ({"noise_multiplier": 2.0}, {"clip": 2 * CLIP}):
        other = wire.decode(content)
        wire.put_json(other, P.CONTROL, {**ctl, "filters": [{**ctl["filters"][0], **change}]})
        with pytest.raises(SiteError, match=r"refused to release round 1 step 0 of run .* again: it was released "
                                            r"under another instruction \(dp_gaussian at noise multiplier 1, "
                                            r".*Rule: a site releases each \(run, round, client, step\) once"):
            answer_message(site, P.TRAIN, other)
    # its ledger: one record for the release, with what it was and the digest of its bytes
    root = site.settings.state_dir / str(ctl["run"]) / f"site_{cid}"
    records = [json.loads(line) for line in (root / "releases.jsonl").read_text().splitlines()]
    assert len(records) == 1
    rec = records[0]
    assert (rec["run"], rec["round"], rec["client"], rec["step"]) == (ctl["run"], 1, cid, 0)
    assert rec["mechanisms"] == [{"mechanism": "dp_gaussian", "noise_multiplier": 1.0, "clip": CLIP}]
    assert rec["released"] == payload_digest(wire.take(wire.decode(grid.answered[(1, cid)]), "reply.payload", "t"))
    assert json.loads((run_dir / "summary.json").read_text())["privacy"]["private"] is True


def test_a_coordinator_resumed_after_a_release_gets_the_same_bytes_from_every_site(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resume attack over Flower: the coordinator stops after round 2's replies arrived;
    resumed with more rounds (a larger noise multiplier for the same target epsilon), it asks
    round 2 again under the parameters it was released under, every site answers with the
    bytes it sent before (its ledger has one record per round), and privacy.csv accounts
    round 2 at the noise it was released with."""
    from medfl.engine.runner import Run
    from medfl.flower.server import resume_flower
    from medfl.site import Site

    monkeypatch.delenv(REPRODUCIBLE_NOISE_ENV, raising=False)
    job = {"rounds": 2, "eval_every": 0, "model": {"name": "small_cnn", "width": 4},
           "train": {"batch_size": 8, "lr": 0.05}, "methods": [{"name": "fedavg"}],
           "filters": [{"name": "dp_gaussian", "epsilon": 3.0, "delta": 1e-3, "clip": 0.5}]}
    fl = fl_config(tmp_path, "resumed", job)
    grid = RecordingTransport(_sites(tmp_path, fl))
    screen = Run.screen

    def crash(self, r, instructions, replies):  # type: ignore[no-untyped-def]
        if r == 2:
            raise KeyboardInterrupt
        return screen(self, r, instructions, replies)

    with monkeypatch.context() as m:
        m.setattr(Run, "screen", crash)
        with pytest.raises(KeyboardInterrupt):
            run_flower_experiment(resolve_config(fl), grid, FAST)
    first = dict(grid.answered)
    again = RecordingTransport({n + 100: Site(s.settings) for n, s in grid.sites.items()})   # restarted sites
    resume_flower(Path(fl["output_dir"]) / "resumed", again, FAST, rounds=4)
    run_dir = Path(fl["output_dir"]) / "resumed" / "fedavg"
    rounds = [int(wire.take_json(wire.decode(c), P.CONTROL, "t")["round"]) for _, c in again.asked]
    assert rounds[:3] == [2, 2, 2]
    for cid in ("0", "1", "2"):   # round 2's answers: the very same bytes
        assert again.answered[(2, cid)] == first[(2, cid)], f"site {cid} released round 2 again as other bytes"
    df = pd.read_csv(run_dir / "privacy.csv", dtype={"client_id": str})
    sigma = df.groupby("round")["noise_multiplier"].first()
    assert sigma[2] == sigma[1] < sigma[3] == sigma[4]
    assert (df[df["round"] == 2]["steps"] == 1).all()
    for site in again.sites.values():
        root = site.settings.state_dir / json.loads((run_dir / "flower.json").read_text())["run_id"]
        ledger = root / f"site_{site.client_id}" / "releases.jsonl"
        records = [json.loads(x) for x in ledger.read_text().splitlines()]
        assert [r["round"] for r in records] == [1, 2, 3, 4]
        # the replies are kept only while a resume may ask for them (after the oldest kept checkpoint)
        kept = sorted(p.name for p in (root / f"site_{site.client_id}" / "releases").iterdir())
        assert kept == ["round_0003_step_0.pt", "round_0004_step_0.pt"]


def test_a_site_with_reproducible_noise_says_its_noise_is_not_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capfd: pytest.CaptureFixture) -> None:
    """MEDFL_REPRODUCIBLE_NOISE=1 (for tests comparing a deployment with the simulation):
    no secret, not even a per-run one, and the site says so on stderr."""
    monkeypatch.setenv(REPRODUCIBLE_NOISE_ENV, "1")
    sites = _sites(tmp_path, fl_config(tmp_path, "repro", {"rounds": 1, "methods": [{"name": "fedavg"}]}))
    err = capfd.readouterr().err
    assert err.count("MEDFL_REPRODUCIBLE_NOISE=1: privacy noise is drawn from the run seed alone") == 3
    assert "no DP guarantee against whoever knows the seed" in err
    assert all(site.run_noise_key({"run": "r1"}) == "" for site in sites.values())
    assert not list((tmp_path / "state").rglob("noise*.key"))
