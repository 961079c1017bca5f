"""communication.csv: what every run sends to and receives from each client, per round.

The sizes are those of medfl's encoding of the messages (``medfl.wire.encoded_size``), the
same in process and deployed; ``tests/flower/test_traffic_flower.py`` checks that both
transports count the same bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from medfl import wire
from medfl.experiment import resume, run_experiment
from medfl.engine.traffic import Traffic
from medfl.messages import Instruction
from medfl.traffic import COLUMNS


def _comm(run_dir: Path) -> pd.DataFrame:
    return pd.read_csv(run_dir / "communication.csv", dtype={"client_id": str})


def _raw_bytes(state: Any) -> int:
    """Bytes of every tensor in a (nested) state, as stored in memory."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_raw_bytes(v) for v in state.values())
    return 0


def test_traffic_sums_exchanges_per_round_client_and_phase() -> None:
    t = Traffic()
    t.begin()
    t.add(1, "0", "train", 100, 80)
    t.add(1, "1", "train", 100)          # never answered: its request only
    t.add(1, "0", "train", 50, 40)       # a second training step in the same round
    assert t.tally("train") == {"0": (150, 120), "1": (100, 0)}
    t.begin()
    t.add(1, "0", "evaluate", 10, 5)
    assert t.tally("train") == {} and t.tally("evaluate") == {"0": (10, 5)}
    df = t.frame()
    assert list(df.columns) == COLUMNS
    assert df.values.tolist() == [[1, "0", "train", 150, 120, 2], [1, "1", "train", 100, 0, 1],
                                  [1, "0", "evaluate", 10, 5, 1]]
    s = t.summary(rounds=2)
    assert (s["bytes_to_clients"], s["bytes_from_clients"], s["messages"]) == (260, 125, 4)
    assert s["per_round"] == {"bytes_to_clients": 130.0, "bytes_from_clients": 62.5}
    assert s["train_per_client_round"] == {"bytes_to_client": 125.0, "bytes_from_client": 60.0}
    assert s["by_phase"]["evaluate"] == {"bytes_to_clients": 10, "bytes_from_clients": 5, "messages": 1}
    back = Traffic()
    back.load(df)
    pd.testing.assert_frame_equal(back.frame(), df)
    with pytest.raises(ValueError, match="unknown traffic phase"):
        t.add(1, "0", "gossip", 1)


def test_encoded_size_is_the_size_of_the_encoding() -> None:
    """encoded_size computes each array's share from its dtype and shape, serialising none:
    always the size of the full encoding."""
    g = torch.Generator().manual_seed(0)
    values = [{"w": torch.randn(64, 32, generator=g), "n": torch.tensor(3)},
              {"w": torch.randn(64, 32, generator=g), "n": torch.tensor(300)},     # same signature
              {"w": torch.randn(200, 1, 3, generator=g).to(torch.bfloat16), "e": torch.zeros(0, 5)},
              [torch.ones(128 * 1024, dtype=torch.uint8)] * 3 + [1, -0.0, None, "x" * 300]]
    for value in values:
        content = wire.Content()
        wire.put(content, "v", value, "test")
        content["m"] = wire.metrics_record({"loss": 0.25, "n": 3}, "test")
        wire.put_json(content, wire.CONTROL, {"client": "0", "spec": {"name": "resnet10"}})
        for _ in range(2):
            assert wire.encoded_size(content) == len(wire.encode(content))


def test_an_instruction_sent_to_several_clients_is_packed_once_and_measured_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    model = {"w": torch.randn(64, 32, generator=g), "n": torch.tensor(3)}
    cache = wire.RecordCache()
    contents = []
    for cid in ("0", "1", "10"):   # a new payload dict per client around the same tensors
        control = {"protocol": wire.PROTOCOL, "client": cid, "round": 1}
        ins = Instruction(payload={"model": model}, config={"lr": 0.1})
        cached = wire.instruction_request(control, ins, cache)
        assert wire.encoded_size(cached) == len(wire.encode(wire.instruction_request(control, ins)))
        contents.append(cached)
        # what the in-process engine records: measured without copying, the same bytes
        for shared in (cache, wire.RecordCache(), None):
            assert wire.instruction_request_size(control, ins, shared) == wire.encoded_size(cached)
    assert contents[0]["ins.payload.arrays"] is contents[2]["ins.payload.arrays"]
    other = wire.instruction_request({"client": "0"}, Instruction(payload={"model": {**model, "n": -0.0}}), cache)
    assert other["ins.payload.arrays"] is not contents[0]["ins.payload.arrays"]
    assert json.loads(other["ins.payload.tree"]["tree"])["d"][0][1]["d"][1][1] == {"s": -0.0}


@pytest.mark.plots
def test_fedavg_and_local_runs_record_their_communication(tiny_fl: dict[str, Any], resolve: Any) -> None:
    tiny_fl.update(model={"name": "small_cnn", "width": 16}, methods=[{"name": "fedavg"}, {"name": "local"}])
    exp = Path(run_experiment(resolve(tiny_fl))["dir"])
    run = exp / "fedavg"
    comm = _comm(run)
    assert list(comm.columns) == COLUMNS
    for phase in ("train", "evaluate"):   # every client, every round, both ways
        part = comm[comm["phase"] == phase]
        assert sorted(zip(part["round"], part["client_id"])) == [(r, c) for r in (1, 2) for c in ("0", "1", "2")]
    assert (comm[["bytes_to_client", "bytes_from_client", "messages"]] > 0).all().all()
    assert set(comm["phase"]) == {"train", "evaluate"}
    # a FedAvg reply is the model's state: its raw tensor bytes plus small headers
    state = torch.load(run / "checkpoints" / "round_0002.pt", weights_only=True)["method"]["global"]
    raw = _raw_bytes(state)
    train = comm[comm["phase"] == "train"]
    for col in ("bytes_from_client", "bytes_to_client"):   # the global model goes out too
        assert ((train[col] > raw) & (train[col] <= 1.2 * raw + 1024)).all(), (col, raw, train[col].tolist())
    # train_metrics.csv: the same train bytes per (round, client)
    tm = pd.read_csv(run / "train_metrics.csv", dtype={"client_id": str})
    both = tm.merge(train, on=["round", "client_id"], suffixes=("", "_comm"))
    assert len(both) == len(tm) == 6
    assert (both["bytes_to_client"] == both["bytes_to_client_comm"]).all()
    assert (both["bytes_from_client"] == both["bytes_from_client_comm"]).all()
    # summary.json's communication block
    block = json.loads((run / "summary.json").read_text())["communication"]
    assert block["bytes_to_clients"] == comm["bytes_to_client"].sum()
    assert block["bytes_from_clients"] == comm["bytes_from_client"].sum()
    assert block["per_round"]["bytes_from_clients"] == comm["bytes_from_client"].sum() / 2
    assert block["train_per_client_round"]["bytes_from_client"] == pytest.approx(train["bytes_from_client"].mean())
    assert set(block["by_phase"]) == {"train", "evaluate"}
    assert block["by_phase"]["train"]["messages"] == 6
    # local training sends no model: small messages both ways
    local = _comm(exp / "local")
    assert (local["bytes_to_client"] < 2000).all() and (local["bytes_from_client"] < 2000).all()
    assert (local.loc[local["phase"] == "train", "bytes_from_client"] < 0.05 * raw).all()
    # the comparison puts each method's cost beside its metrics (1 MB = 1e6 bytes)
    cmp = pd.read_csv(exp / "comparison.csv")
    for col in ("mb_to_clients_per_round", "mb_from_clients_per_round"):
        assert cmp[col].notna().all()
    fedavg = cmp[cmp["method"] == "fedavg"]
    assert fedavg["mb_to_clients_per_round"].tolist() == pytest.approx(
        [block["per_round"]["bytes_to_clients"] / 1e6] * len(fedavg))
    assert (cmp.loc[cmp["method"] == "local", "mb_from_clients_per_round"]
            < fedavg["mb_from_clients_per_round"].iloc[0] / 10).all()
    assert (run / "plots" / "communication.png").is_file()


def test_resumed_run_records_what_an_uninterrupted_run_does(tiny_fl: dict[str, Any], resolve: Any) -> None:
    tiny_fl.update(rounds=3, stop_after_round=1, eval_every=2)
    out = run_experiment(resolve(tiny_fl))
    run = Path(out["dir"]) / "fedavg"
    assert not (run / "summary.json").is_file()
    assert set(_comm(run)["round"]) == {1}
    resume(out["dir"])
    ref = Path(run_experiment(resolve({**tiny_fl, "name": "ref", "stop_after_round": None}))["dir"]) / "fedavg"
    pd.testing.assert_frame_equal(_comm(run), _comm(ref))
    assert set(_comm(run)["round"]) == {1, 2, 3}
    resumed = json.loads((run / "summary.json").read_text())["communication"]
    assert resumed == json.loads((ref / "summary.json").read_text())["communication"]
    cols = ["round", "client_id", "bytes_to_client", "bytes_from_client"]
    pd.testing.assert_frame_equal(pd.read_csv(run / "train_metrics.csv")[cols],
                                  pd.read_csv(ref / "train_metrics.csv")[cols])
