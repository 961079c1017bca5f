"""Secure aggregation (``fl.secure_aggregation``, Flower's SecAgg+) over Flower.

A Flower grid in this process (flower_grid.py), with every message handed to medfl's real
``ClientApp`` (:data:`medfl.flower.proxy.app`, handling the message in its process: Flower's
``secaggplus_mod`` in front of the site's ``train`` handler) with a Flower ``Context`` per node
that lives as long as the run, as a SuperNode keeps it: the coordinator's, Flower's transport's
and the sites' real code, Flower's real client mod.
Then on Flower's simulation runtime (Ray). Over a real deployment on loopback it is
test_flower.py's (on that module's federation, so that no other one is started for it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("flwr", reason="Flower is a dependency of medfl")

from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from flwr.common import bytes_to_ndarray  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key  # noqa: E402

from medfl.config import ConfigError, resolve_config  # noqa: E402
from medfl.engine.runner import RunError  # noqa: E402
from medfl.experiment import run_experiment  # noqa: E402
from medfl.engine import protocol as P  # noqa: E402
from medfl.flower import secagg  # noqa: E402
from medfl.flower.proxy import app as site_app, content_of  # noqa: E402
from medfl.flower.server import run_flower_experiment  # noqa: E402
from medfl.site import SiteError  # noqa: E402
from medfl.site_messages import answer_message  # noqa: E402
from medfl import wire  # noqa: E402

from flower_cases import FEDAVG, SECURE, fl_config, numeric_equal, write_config  # noqa: E402
from flower_grid import LoopGrid, over_the_wire  # noqa: E402
from test_coordinator import FAST, LoopTransport, _sites  # noqa: E402


class AppLoopGrid(LoopGrid):
    """The Flower grid answering through medfl's site ``ClientApp`` (mods included), one
    Flower ``Context`` per node kept across messages; every answer the coordinator receives
    is kept in :attr:`received` as ``(node, round, stage, content)``."""

    def __init__(self, work: Path, fl: dict[str, Any], **kw: Any) -> None:
        cfg = write_config(work / "site_app.json", fl)
        super().__init__({101 + i: None for i in range(3)}, **kw)   # type: ignore[dict-item]
        self.contexts = {101 + i: Context(run_id=1, node_id=101 + i, state=RecordDict(), run_config={},
                                          node_config={"client-id": str(i), "config": str(cfg),
                                                       "state-dir": str(work / "app_state" / f"site{i}")})
                         for i in range(3)}
        self.received: list[tuple[int, int, str, wire.Content]] = []

    def _answer(self, msg: Message, what: str, ctl: dict[str, Any]) -> Message:
        node, kind = msg.metadata.dst_node_id, msg.metadata.message_type
        if what == "unavailable":
            return Message(Error(code=5, reason="node unavailable"), reply_to=msg)
        inbound = Message(content=over_the_wire(msg.content), metadata=msg.metadata)
        try:
            out = site_app(inbound, self.contexts[node])
        except Exception as exc:  # noqa: BLE001 - as Flower reports a ClientApp exception
            return Message(Error(code=2, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
        if out.has_error():
            return Message(out.error, reply_to=msg)
        # the answer as the coordinator reads it
        content = content_of(over_the_wire(out.content))
        stage = str(ctl.get("secure_aggregation", "")) if kind == P.TRAIN else ""
        self.received.append((node, int(ctl.get("round", 0) or 0), stage, content))
        return Message(over_the_wire(out.content), reply_to=msg)


def _secure_job(**extra: Any) -> dict[str, Any]:
    return {**json.loads(json.dumps(FEDAVG)), "secure_aggregation": dict(SECURE), **extra}


def _capture(monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict[str, Any]], list[secagg.SecureRound]]:
    """Record what each site put under SecAgg+'s mask (its update, the state it was sent, its
    weight) and every round's unmasked result at the coordinator."""
    updates: list[dict[str, Any]] = []
    rounds: list[secagg.SecureRound] = []
    real_update, real_answer, real_run = secagg.secure_update, secagg.secure_train_answer, secagg.SecureAggregation.run

    def update(method: Any, payload: dict[str, Any], reference: dict[str, Any], where: str) -> list[np.ndarray]:
        out = real_update(method, payload, reference, where)
        updates.append({"where": where, "update": [a.copy() for a in out],
                        "reference": {k: v.clone() for k, v in reference["model"].items()}})
        return out

    def answer(client: str, update: list[np.ndarray], metrics: dict[str, Any], num_examples: int) -> wire.Content:
        updates[-1].update(client=client, num_examples=int(num_examples))
        return real_answer(client, update, metrics, num_examples)

    def run(self: secagg.SecureAggregation, *args: Any, **kw: Any) -> secagg.SecureRound:
        done = real_run(self, *args, **kw)
        rounds.append(done)
        return done

    monkeypatch.setattr(secagg, "secure_update", update)
    monkeypatch.setattr(secagg, "secure_train_answer", answer)
    monkeypatch.setattr(secagg.SecureAggregation, "run", run)
    return updates, rounds


def _expected_mean(updates: list[dict[str, Any]], clients: list[str]) -> dict[str, torch.Tensor]:
    """The num_examples-weighted mean of the given clients' models (sent state plus update)."""
    chosen = [u for u in updates if u["client"] in clients]
    w = np.array([u["num_examples"] for u in chosen], dtype=np.float64)
    names = sorted(chosen[0]["reference"])
    return {name: chosen[0]["reference"][name].double()
            + torch.from_numpy(np.asarray(sum(wi * u["update"][i] for wi, u in zip(w / w.sum(), chosen))))
            for i, name in enumerate(names)}


def _mean_error(done: secagg.SecureRound, expected: dict[str, torch.Tensor]) -> float:
    assert done.aggregate is not None, done.halted
    got = done.aggregate["model"]
    assert sorted(got) == sorted(expected)
    return max(float((got[k].double() - expected[k]).abs().max()) for k in got if got[k].is_floating_point())


def test_secure_aggregation_gives_the_plain_metrics_and_hides_every_update(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    updates, rounds = _capture(monkeypatch)
    fl = fl_config(tmp_path, "secagg", _secure_job())
    grid = AppLoopGrid(tmp_path, fl)
    secure_dir = Path(run_flower_experiment(resolve_config(fl), grid, FAST)["dir"]) / "fedavg"
    plain_fl = fl_config(tmp_path, "plain", FEDAVG)
    plain_dir = Path(run_flower_experiment(resolve_config(plain_fl), LoopTransport(_sites(tmp_path, plain_fl, "p")),
                                           FAST)["dir"]) / "fedavg"

    # the same metrics as without it, within the quantization error
    sec, plain = pd.read_csv(secure_dir / "metrics.csv"), pd.read_csv(plain_dir / "metrics.csv")
    numeric_equal(plain, sec, "metrics.csv", atol=1e-3)
    t_sec, t_plain = pd.read_csv(secure_dir / "train_metrics.csv"), pd.read_csv(plain_dir / "train_metrics.csv")
    # round 1 trains from the same initial model: identical training; bytes differ (masked vectors)
    cols = [c for c in t_plain.columns if not c.startswith("bytes_")]
    numeric_equal(t_plain[cols], t_sec[cols], "train_metrics.csv", atol=1e-3)
    first = t_sec["round"] == 1
    numeric_equal(t_plain.loc[first, cols], t_sec.loc[first, cols], "train_metrics.csv round 1", atol=0.0)

    # the coordinator unmasked each round's weighted mean, within n * 2 * clip / levels
    assert len(rounds) == 2 and all(d.included == ["0", "1", "2"] for d in rounds)
    bound = 3 * 2 * 8.0 / 2 ** 22
    for r, done in enumerate(rounds, start=1):
        this = updates[3 * (r - 1): 3 * r]
        assert _mean_error(done, _expected_mean(this, ["0", "1", "2"])) <= bound

    # what the coordinator received from each site: no array at all, an empty model payload and
    # a masked vector uncorrelated with the site's update
    train = [(node, r, stage, c) for node, r, stage, c in grid.received if stage]
    assert sorted({stage for _, _, stage, _ in train}) == ["collect_masked_vectors", "setup", "share_keys", "unmask"]
    for node, r, stage, content in train:
        assert all(len(rec) == 0 for rec in content.values() if isinstance(rec, wire.Arrays)), (node, r, stage)
        if stage != "collect_masked_vectors":
            continue
        assert wire.take(content, "reply.payload", "test") == {}
        masked = [bytes_to_ndarray(b) for b in content[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]]
        own = next(u for u in updates[3 * (r - 1): 3 * r] if u["client"] == str(node - 101))
        x = np.concatenate([a.ravel() for a in own["update"]])
        y = np.concatenate([a.ravel() for a in masked[1:]]).astype(np.float64)
        assert x.size == y.size > 300
        assert abs(np.corrcoef(x, y)[0, 1]) < 0.3       # 6 standard errors (1 / sqrt(392)) for independent vectors
        assert y.min() >= 0 and y.max() < 2 ** 32 and np.unique(y).size > 0.9 * y.size

    summary = json.loads((secure_dir / "summary.json").read_text())["privacy"]
    block = summary["secure_aggregation"]
    assert "honest-but-curious coordinator" in block["against"]
    assert any("differential privacy" in n for n in block["not"]) and summary["private"] is False
    assert json.loads((secure_dir.parent / "config.json").read_text())["fl"]["secure_aggregation"]["num_shares"] == 1.0
    comm = pd.read_csv(secure_dir / "communication.csv")
    assert set(comm["phase"]) >= {"train", "secagg"}


def test_a_site_that_drops_after_sharing_its_keys_is_left_out_of_the_sum(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    updates, rounds = _capture(monkeypatch)

    def rule(node: int, kind: str, ctl: dict[str, Any]) -> str:
        # site 2 answers the key exchange, then drops before sending its masked update in round 2
        if node == 103 and ctl.get("round") == 2 and ctl.get("secure_aggregation") == "collect_masked_vectors":
            return "unavailable"
        return "ok"

    fl = fl_config(tmp_path, "secagg_drop", _secure_job())
    run_flower_experiment(resolve_config(fl), AppLoopGrid(tmp_path, fl, rule=rule), FAST)
    assert rounds[0].included == ["0", "1", "2"] and rounds[1].included == ["0", "1"]
    # its pairwise masks were removed from the others' vectors (its key rebuilt from their
    # shares), and the mean is that of sites 0 and 1 alone
    this = [u for u in updates if u["client"] in ("0", "1")][-2:]
    assert _mean_error(rounds[1], _expected_mean(this, ["0", "1"])) <= 2 * 2 * 8.0 / 2 ** 22


def test_secure_aggregation_is_refused_where_it_cannot_hold(tmp_path: Path) -> None:
    base = fl_config(tmp_path, "refused", _secure_job())
    for method, needs in ((["fedkper"], "needs each client's own reply"),
                          ([{"name": "fedavg", "aggregation": "median"}], "needs each client's own reply"),
                          (["pfedcdp"], "needs each client's own reply")):
        with pytest.raises(ConfigError, match=needs):
            resolve_config({**base, "methods": method})
    with pytest.raises(ConfigError, match="reply filters"):
        resolve_config({**base, "filters": [{"name": "quantize", "bits": 8}]})
    with pytest.raises(ConfigError, match="num_shares: expected an integer >= 3"):
        resolve_config({**base, "secure_aggregation": {"num_shares": 2}})
    with pytest.raises(RunError, match="no one to hide an update from"):
        run_experiment(resolve_config(base))


def test_secure_aggregation_on_flowers_simulation_runtime(tmp_path: Path) -> None:
    """Flower's own runtime (``fl.backend: ray``): Flower keeps each node's ``Context`` between
    the four stages and runs the ClientApp's mods; FedBN (its norm layers stay at the sites)
    gives the in-process plain run's metrics within the quantization error."""
    pytest.importorskip("ray", reason="the simulation runtime needs Ray")
    job = {"rounds": 2, "model": {"name": "small_cnn", "width": 4}, "train": {"batch_size": 8, "lr": 0.05},
           "eval_every": 0, "methods": [{"name": "fedbn"}]}
    ref = run_experiment(resolve_config(fl_config(tmp_path, "ref", job)))
    sim = run_experiment(resolve_config({**fl_config(tmp_path, "sim", job), "secure_aggregation": SECURE,
                                         "backend": {"name": "ray", "client_cpus": 1, "num_cpus": 2}}))
    ref_dir, sim_dir = Path(ref["dir"]) / "fedbn", Path(sim["dir"]) / "fedbn"
    numeric_equal(pd.read_csv(ref_dir / "metrics.csv"), pd.read_csv(sim_dir / "metrics.csv"), "metrics.csv",
                  atol=1e-3)
    events = pd.read_csv(sim_dir / "flower_events.csv", dtype={"client_id": str})
    assert events.loc[events["phase"] == "secagg", "status"].tolist() == ["aggregated 3: 0 1 2"] * 2
    assert set(events.loc[events["phase"].str.startswith("secagg."), "status"]) == {"ok", "3/3"}


def test_a_site_never_sends_its_update_outside_secaggs_collect_stage(tmp_path: Path) -> None:
    """A coordinator that asks for a secure-aggregation training step without SecAgg+'s record
    (so no mod would mask the answer) is refused before the site trains."""
    fl = fl_config(tmp_path, "unmasked", _secure_job())
    site = _sites(tmp_path, fl)[101]
    content = wire.Content()
    wire.put_json(content, wire.CONTROL, {"protocol": wire.PROTOCOL, "client": "0", "secure_aggregation":
                                          "collect_masked_vectors"})
    wire.put(content, "ins.payload", {}, "test")
    wire.put(content, "ins.config", {}, "test")
    with pytest.raises(SiteError, match="refusing to send the update unmasked"):
        answer_message(site, P.TRAIN, content)
