"""The ClientApp of a deployed site forwards the run config to the site worker, which refuses
MONAI syntax in it before anything else (the ClientApp process imports Flower only: medfl's
check would import torch in every message's process, issue 65)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from flwr.app import Context, Message, RecordDict  # noqa: E402

from medfl import wire  # noqa: E402
from medfl.engine import protocol as P  # noqa: E402
from medfl.flower.proxy import WorkerError, app, to_records  # noqa: E402
from medfl.site import SiteSettings  # noqa: E402
from medfl.flower.worker import SiteWorker, socket_for  # noqa: E402

from test_coordinator_text import FL, expression  # noqa: E402


def test_the_worker_refuses_a_run_config_with_an_expression_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"fl": FL}))
    sock = socket_for()
    worker = SiteWorker(SiteSettings(client_id="0", config=config, state_dir=tmp_path / "state"), sock)
    serving = threading.Thread(target=worker.serve_forever, daemon=True)
    serving.start()
    content = wire.Content()
    wire.put_json(content, P.CONTROL, {"protocol": P.PROTOCOL})
    node = {"client-id": "0", "worker": sock}
    try:
        for rc, key in (({"overrides": json.dumps({"fl#progress": expression(marker)})}, "overrides#fl#progress"),
                        ({"workdir": expression(marker)}, "workdir")):
            with pytest.raises(WorkerError, match=rf"medfl site 0: the Flower run config: key '{key}' holds .*refused"):
                app(Message(content=to_records(content), dst_node_id=1, message_type=P.HELLO),
                    Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config=rc))
    finally:
        worker.stop()
        serving.join(timeout=60)
    assert not marker.exists() and worker.site is None   # refused before the site read its config


def test_the_clientapp_module_imports_no_medfl(tmp_path: Path) -> None:
    """What Flower's per-message process loads from medfl's Flower app: the proxy and the
    codec's copy beside it, Flower, not medfl (torch); and the copy converts as medfl does."""
    from medfl.flower.deploy import write_app

    app_dir = write_app(tmp_path / "app")
    code = ("import sys\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "import numpy as np, medfl_flower_proxy as p, medfl_wire_format as c\n"
            "content = c.Content({'a': c.Arrays({'w': np.arange(3.0)}), 'm': c.Metrics({'n': 2})})\n"
            "back = p.content_of(p.records_of(content, pack=False))\n"
            "assert c.encode(back) == c.encode(content) == p.packed_bytes(p.records_of(content, pack=True))\n"
            "sys.stdout.buffer.write(c.encode(content))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('medfl', 'torch', 'monai')), file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code, str(app_dir)], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stderr.decode().strip().splitlines()[-1] == "[]"
    assert wire.decode(done.stdout)["a"]["w"].tolist() == [0.0, 1.0, 2.0]   # medfl reads the copy's bytes
