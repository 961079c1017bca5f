"""A plain Flower app - Flower's own ``FedAvg`` strategy, a ClientApp with a plain PyTorch
training loop - on the data and model of ``flower_overhead.py``'s job: the anchor medfl over
Flower is measured against (issue 20). ``flower_overhead.py`` (unless ``--skip-anchor``) copies this file into
a Flower app directory and runs it with ``flwr run`` on the same loopback deployment as medfl:
a SuperLink and one ``flower-supernode`` per client (node config ``partition-id``).

medfl is used only to draw the same split of the same data and to build the same model; the
training loop, the aggregation (``flwr.serverapp.strategy.FedAvg``) and every message are
Flower's. As in any plain Flower app, each message's ClientApp process imports torch and reads
its data again: that is the cost a Flower user pays, and part of what is compared.

Run config keys: ``fl`` (the JSON ``fl`` config of the job), ``rounds``, ``result-file``
(where the ServerApp writes its round timestamps as JSON).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

__all__ = ["client", "server"]

client = ClientApp()
server = ServerApp()


def _job(context: Context) -> tuple[dict[str, Any], Any, str]:
    """The resolved config, medfl's split and this node's client id."""
    from medfl.config import resolve_config
    from medfl.engine.data import client_order, split_data
    from medfl.engine.runner import build_source

    cfg = resolve_config(json.loads(str(context.run_config["fl"])))
    data = split_data(build_source(cfg["dataset"]), cfg)
    cid = client_order(data.client_ids)[int(context.node_config["partition-id"])]
    return cfg, data, cid


def _model(cfg: dict[str, Any], data: Any) -> Any:
    from medfl.models.registry import build_model

    src = data.source
    return build_model({**cfg["model"], "spatial_dims": src.spatial_dims, "in_channels": src.in_channels,
                        "num_classes": src.num_classes})


@client.train()
def train(msg: Message, context: Context) -> Message:
    """One local epoch of SGD on this client's training rows."""
    import torch

    cfg, data, cid = _job(context)
    model = _model(cfg, data)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    t = cfg["train"]
    rnd = int(msg.content["config"]["server-round"])
    ds = data.source.make_dataset(data.rows(cid, "train"), True)
    loader = torch.utils.data.DataLoader(ds, batch_size=int(t["batch_size"]), shuffle=True,
                                         generator=torch.Generator().manual_seed(1000 * rnd + int(cid)))
    opt = torch.optim.SGD(model.parameters(), lr=float(t["lr"]), momentum=float(t["momentum"]))
    model.train()
    total, n = 0.0, 0
    for x, y in loader:
        if x.shape[0] < 2:
            continue
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        total += float(loss) * len(y)
        n += len(y)
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"num-examples": len(ds), "loss": total / max(n, 1)})}),
                   reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Accuracy of the global model on this client's test rows."""
    import torch

    cfg, data, cid = _job(context)
    model = _model(cfg, data)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    model.eval()
    ds = data.source.make_dataset(data.rows(cid, "test"), False)
    correct = 0
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(ds, batch_size=int(cfg["train"]["eval_batch_size"])):
            correct += int((model(x).argmax(1) == y).sum())
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": len(ds),
                                                        "accuracy": correct / max(len(ds), 1)})}), reply_to=msg)


class _Timed(FedAvg):
    """FedAvg noting when each round's evaluation has been aggregated (a round's end)."""

    ends: list[float] = []

    def aggregate_evaluate(self, server_round: int, replies: Any) -> Any:  # noqa: D102
        out = super().aggregate_evaluate(server_round, replies)
        self.ends.append(time.time())
        return out


@server.main()
def main(grid: Grid, context: Context) -> None:
    """Wait for every node, run the rounds with Flower's FedAvg, write the timestamps."""
    import torch

    rc = context.run_config
    cfg = json.loads(str(rc["fl"]))
    n = int(cfg["num_clients"])
    t0 = time.time()
    while len(list(grid.get_node_ids())) < n:
        time.sleep(0.2)
    from medfl.config import resolve_config
    from medfl.engine.data import split_data
    from medfl.engine.runner import build_source

    resolved = resolve_config(cfg)
    torch.manual_seed(int(resolved["seed"]))
    model = _model(resolved, split_data(build_source(resolved["dataset"]), resolved))
    strategy = _Timed(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=n, min_evaluate_nodes=n,
                      min_available_nodes=n)
    strategy.ends = []
    start = time.time()
    strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=int(rc["rounds"]),
                   train_config=ConfigRecord({}), evaluate_config=ConfigRecord({}))
    Path(str(rc["result-file"])).write_text(json.dumps({"connect_s": start - t0, "start": start,
                                                        "round_end": strategy.ends}))
