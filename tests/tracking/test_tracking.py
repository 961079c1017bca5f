"""Experiment tracking (``fl.tracking``, ``--tracking``): MLflow against a real server and its
embedded SQLite store, TensorBoard event files, a resume that continues both, MONAI's own
``--tracking mlflow``, a tracker registered at runtime, a failing tracker, bad entries."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import pytest

from medfl import hookimpl
from medfl.config import ConfigError
from medfl.experiment import resume, run_experiment
from medfl.plugins import get_plugin_manager
from medfl.tracking import WAIT_ENV, Tracker, TrackerWarning

mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed: pip install \"medfl[tracking]\"")
pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install \"medfl[tracking]\"")

from mlflow.tracking import MlflowClient  # noqa: E402

BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "demo" / "configs" / "train.json"
TINY_BUNDLE = ("--fl#rounds", "2", "--fl#dataset#num_samples", "240", "--fl#partition#min_size", "10",
               "--fl#progress", "False", "--fl#model#width", "4", "--fl#dataset#image_size", "16")


@pytest.fixture(autouse=True)
def _patient_trackers(monkeypatch):
    """The tests here check what a tracker that works records. On a loaded machine one call to
    a one-worker ``mlflow server`` can take longer than the 10-s default bound, after which medfl
    rightly abandons the tracker (tests/tracking/test_tracker_bounds.py tests that): the bound is
    raised here, for these runs and the bundle subprocesses they start."""
    monkeypatch.setenv(WAIT_ENV, "600")


def _tracker_failures(root: Path) -> dict[str, Any]:
    """Each run's failed trackers (``summary.json``'s ``trackers`` block) under ``root``: what an
    assertion on a tracker's runs says when one is missing."""
    found = {}
    for path in root.rglob("summary.json"):
        try:
            trackers = json.loads(path.read_text()).get("trackers", {})
        except ValueError:
            continue
        failed = {k: v for k, v in trackers.items() if v.get("status") != "ok"}
        if failed:
            found[str(path.relative_to(root))] = failed
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def mlflow_server(tmp_path: Path):
    """A real ``mlflow server`` on loopback: SQLite backend and artifacts in ``tmp_path``."""
    port = _free_port()
    log = open(tmp_path / "mlflow_server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "server_artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240   # generous: the machine may be loaded
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start: {(tmp_path / 'mlflow_server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield uri
    finally:
        # the test has read what it needs: no graceful shutdown (uvicorn waits ~15 s for the
        # client's keep-alive connections to close)
        os.killpg(proc.pid, 9)
        proc.wait(timeout=120)
        log.close()


def _runs(client: MlflowClient, experiment: str) -> tuple[Any, dict[str, Any]]:
    """The parent run and the nested runs by name of the MLflow experiment ``experiment``."""
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r}"
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1, [r.info.run_name for r in runs]
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    return parents[0], children


def _steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return [m.step for m in client.get_metric_history(run_id, key)]


def _artifacts(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    return {f.path for f in client.list_artifacts(run_id, path)}


@pytest.mark.plots
def test_demo_bundle_against_a_real_mlflow_server(tmp_path, run_bundle, mlflow_server):
    """(a) The demo bundle (tiny) tracked by a real server: one parent run, a nested run per
    method, the resolved config as params, per-round metric histories (one step a round),
    plots, summary.json, comparison.csv and the final model read back through the client."""
    entry = json.dumps([{"name": "mlflow", "uri": mlflow_server, "experiment": "served", "per_client": True}])
    run_bundle(BUNDLE, "--bundle_root", tmp_path, *TINY_BUNDLE, "--fl#tracking", entry, timeout=600)
    client = MlflowClient(tracking_uri=mlflow_server)
    parent, children = _runs(client, "served")
    assert set(children) == {"fedavg", "local"} and parent.info.status == "FINISHED", _tracker_failures(tmp_path)
    assert parent.data.params["rounds"] == "2" and parent.data.params["methods.0.name"] == "fedavg"
    assert {"comparison.csv", "comparison.png"} <= _artifacts(client, parent.info.run_id)
    for label, run in children.items():
        assert run.info.status == "FINISHED"
        assert run.data.params["method.name"] == label and run.data.params["train.lr"] == "0.01"
        for key in ("eval/local_test/accuracy/mean", "eval/local_test/accuracy/0", "train/loss/mean",
                    "traffic/train/bytes_to_client/mean"):
            assert _steps(client, run.info.run_id, key) == [1, 2], key
        assert {"summary.json", "plots"} <= _artifacts(client, run.info.run_id)
        assert any(p.endswith(".png") for p in _artifacts(client, run.info.run_id, "plots"))
        models = client.search_logged_models([parent.info.experiment_id],
                                             filter_string=f"source_run_id = '{run.info.run_id}'")
        assert models, f"no logged model for {label}"
    # fedavg's clients share the global model (one "model"); local's are personalised
    names = {m.name for m in client.search_logged_models([parent.info.experiment_id])}
    assert "model" in names and {"model_0", "model_1", "model_2", "model_3"} <= names
    fedavg = [m for m in client.search_logged_models([parent.info.experiment_id]) if m.name == "model"][0]
    import torch

    local = mlflow.artifacts.download_artifacts(artifact_uri=fedavg.artifact_location, tracking_uri=mlflow_server,
                                                dst_path=str(tmp_path / "downloaded"))
    loaded = mlflow.pytorch.load_model(local)
    assert loaded(torch.zeros(1, 1, 16, 16)).shape == (1, 3)


def test_embedded_store_tensorboard_and_resume(tiny_fl, resolve, tmp_path):
    """(b) MLflow's embedded SQLite store (no server), (c) TensorBoard's event files read
    back with EventAccumulator, (d) a run stopped after round 1, resumed to round 2 with
    ``medfl resume --tracking tensorboard`` (which gets round 1 too), then to round 3: the same
    MLflow runs, metric histories with steps 1..3 and no duplicate, TensorBoard steps 1..3 once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from medfl.cli import main

    cfg = {**tiny_fl, "rounds": 3, "tracking": [{"name": "mlflow", "per_client": True}], "stop_after_round": 1}
    exp = Path(run_experiment(resolve(cfg))["dir"])
    first = json.loads((exp / "tracking.json").read_text())
    assert (exp / "mlflow.db").is_file() and not (exp / "tensorboard").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{exp / 'mlflow.db'}")
    parent, children = _runs(client, "t")
    assert parent.info.status == "KILLED" and children["fedavg"].info.status == "KILLED"
    assert _steps(client, children["fedavg"].info.run_id, "eval/local_test/accuracy/mean") == [1]
    assert main(["resume", str(exp), "--rounds", "2", "--tracking", "tensorboard"]) == 0
    resume(exp, rounds=3)
    again = json.loads((exp / "tracking.json").read_text())
    assert [t["name"] for t in again["trackers"]] == ["mlflow", "tensorboard"]
    assert again["runs"]["mlflow"]["fedavg"]["run"]["run_id"] == first["runs"]["mlflow"]["fedavg"]["run"]["run_id"]
    parent2, children2 = _runs(client, "t")
    assert parent2.info.run_id == parent.info.run_id and parent2.info.status == "FINISHED"
    run_id = children2["fedavg"].info.run_id
    assert children2["fedavg"].info.status == "FINISHED"
    for key in ("eval/local_test/accuracy/mean", "eval/global_test/auc/1", "train/loss/2", "train/num_examples/mean"):
        assert _steps(client, run_id, key) == [1, 2, 3], key
    assert "summary.json" in _artifacts(client, run_id)
    acc = EventAccumulator(str(exp / "tensorboard" / "fedavg"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/local_test/accuracy/mean")] == [1, 2, 3]
    assert [e.step for e in acc.Scalars("train/loss/mean")] == [1, 2, 3]
    assert not [t for t in acc.Tags()["scalars"] if t.endswith("/0")]   # tensorboard: per_client false
    metrics = __import__("pandas").read_csv(exp / "fedavg" / "metrics.csv")
    want = metrics[(metrics["split"] == "local_test") & (metrics["round"] == 3)]["accuracy"].mean()
    assert acc.Scalars("eval/local_test/accuracy/mean")[-1].value == pytest.approx(want, rel=1e-5)


def test_monai_bundle_tracking_switch_logs_to_mlflow(tmp_path, run_bundle, monkeypatch):
    """MONAI's own ``--tracking mlflow`` on the demo bundle: medfl logs to the store MONAI's
    settings name (``<output_dir>/mlruns.db``, experiment ``monai_experiment``)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)   # it would win over MONAI's settings
    run_bundle(BUNDLE, "--bundle_root", tmp_path, *TINY_BUNDLE, "--fl#rounds", "1",
               "--fl#methods", "[{'name': 'fedavg'}]", "--tracking", "mlflow", timeout=600)
    db = tmp_path / "runs" / "mlruns.db"
    assert db.is_file()
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    parent, children = _runs(client, "monai_experiment")
    assert set(children) == {"fedavg"}
    assert _steps(client, children["fedavg"].info.run_id, "eval/local_test/accuracy/mean") == [1]


class Recorder(Tracker):
    """A minimal tracker (the one docs/plugins.md shows): keeps what it is given."""

    name = "recorder"
    options = {"label": "x"}
    calls: list[tuple[Any, ...]] = []

    def start_run(self, key, name, params, parent, saved, last_step):
        self.calls.append(("start", key, parent, self.settings["label"]))
        return {"id": key or "experiment"}

    def log_metrics(self, key, metrics, step):
        self.calls.append(("metrics", key, step, dict(metrics)))

    def end_run(self, key, status):
        self.calls.append(("end", key, status))


class Broken(Tracker):
    """Fails at its first round, as a tracking server going down mid-run."""

    name = "broken"

    def start_run(self, key, name, params, parent, saved, last_step):
        return {}

    def log_metrics(self, key, metrics, step):
        raise ConnectionError("tracking server down")


class TrackerPlugin:
    @hookimpl
    def register_trackers(self, register):
        register(Recorder)
        register(Broken)


def test_runtime_tracker_and_a_failing_one_never_stop_the_run(tiny_fl, resolve):
    """A third-party tracker registered at runtime gets every round; a tracker that fails is
    said once in the run's log.txt (no stderr warning of its own), named in its summary.json,
    and the run finishes."""
    pm = get_plugin_manager()
    pm.register(TrackerPlugin(), name="test-trackers")
    Recorder.calls.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = run_experiment(resolve({**tiny_fl, "tracking": [{"name": "recorder", "label": "y"}, "broken"]}))
        assert out["summaries"]["fedavg"]["rounds"] == 2
        assert not [w for w in caught if issubclass(w.category, TrackerWarning)]
        run = Path(out["dir"]) / "fedavg"
        said = [line for line in (run / "log.txt").read_text().splitlines() if "tracker 'broken' failed" in line]
        assert len(said) == 1 and "WARNING medfl.tracking" in said[0], said
        assert "log_metrics" in said[0] and "ConnectionError: tracking server down" in said[0]
        trackers = json.loads((run / "summary.json").read_text())["trackers"]
        assert trackers["recorder"] == {"status": "ok"}
        assert trackers["broken"]["status"] == "failed" and trackers["broken"]["step"] == "log_metrics"
        assert trackers["broken"]["error"] == "ConnectionError: tracking server down"
        starts = [c for c in Recorder.calls if c[0] == "start"]
        assert starts[0] == ("start", "", None, "y") and starts[1] == ("start", "fedavg", {"id": "experiment"}, "y")
        steps = [c[2] for c in Recorder.calls if c[0] == "metrics"]
        assert steps == [1, 2]
        assert Recorder.calls[-1] == ("end", "", "finished")
        assert ("end", "fedavg", "finished") in Recorder.calls
    finally:
        pm.unregister(name="test-trackers")


@pytest.mark.parametrize("entry, message", [
    ([{"name": "mlfow"}], "fl.tracking[0]: unknown tracker 'mlfow'; registered trackers: mlflow, tensorboard"),
    (["tensorboard", {"name": "mlflow", "url": "x"}], "fl.tracking[1] (mlflow): unknown key(s) 'url'; valid keys: "
                                                      "name, artifact_location, experiment, per_client, run_name, uri"),
    ([{"name": "tensorboard", "per_client": "always"}], "fl.tracking[0] (tensorboard).per_client: expected true or "
                                                        "false (or yes/no, 1/0), got 'always'"),
    ("tensorboard", None),
    (3, "fl.tracking: expected a list"),
    (["mlflow", "mlflow"], "fl.tracking[1]: tracker 'mlflow' is named twice"),
])
def test_bad_tracking_entries_are_refused_by_name(tiny_fl, resolve, entry, message):
    """(f) Unknown trackers and keys are refused by name, with what is valid."""
    if message is None:
        assert resolve({**tiny_fl, "tracking": entry})["tracking"] == [{"name": "tensorboard"}]
        return
    with pytest.raises(ConfigError) as err:
        resolve({**tiny_fl, "tracking": entry})
    assert message in str(err.value)


def test_flower_run_tracking_option_reaches_the_coordinator(tiny_fl, tmp_path, monkeypatch, capsys):
    """``medfl flower run --tracking NAME`` adds the tracker to the config's own ``fl.tracking``
    in the overrides the coordinator gets (only it tracks), checked before anything starts."""
    import medfl.flower.deploy as deploy
    from medfl.cli import main

    class Launched(Exception):
        pass

    seen: dict[str, Any] = {}

    def launch(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise Launched

    monkeypatch.setattr(deploy, "make_run_config", launch)
    cfg = tmp_path / "train.json"
    cfg.write_text(json.dumps({"fl": {**tiny_fl, "tracking": [{"name": "tensorboard", "log_dir": None}]}}))
    with pytest.raises(Launched):
        main(["flower", "run", str(cfg), "--insecure", "--tracking", "mlflow", "--tracking", "tensorboard"])
    assert seen["overrides"]["fl#tracking"] == [{"name": "tensorboard", "log_dir": None}, {"name": "mlflow"}]
    seen.clear()
    assert main(["flower", "run", str(cfg), "--insecure", "--tracking", "mlfow"]) == 2
    assert "unknown tracker 'mlfow'" in capsys.readouterr().err and seen == {}
    with pytest.raises(SystemExit, match="a resumed run continues with the trackers it started with"):
        main(["flower", "run", "--resume", str(tmp_path), "--insecure", "--tracking", "mlflow"])


def test_an_untracked_run_imports_no_tracker(tiny_fl, tmp_path):
    """Without fl.tracking nothing imports mlflow or tensorboard (``make demo`` stays quick)."""
    code = ("import json, sys; from medfl.config import resolve_config; from medfl.experiment import run_experiment; "
            f"run_experiment(resolve_config(json.loads({json.dumps(json.dumps({**tiny_fl, 'rounds': 1}))}))); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('mlflow', 'tensorboard')]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


# Run first in a child process: medfl, its plugins and MONAI cannot be imported there, as on a
# machine where only torch and MLflow are installed (medfl is an editable install here).
_WITHOUT_MEDFL = """
import importlib.abc, json, sys

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("medfl", "medfl_plugins", "monai"):
            raise ImportError(f"No module named {name!r} (not installed here)")
        return None

sys.meta_path.insert(0, NotInstalled())
try:
    import medfl
except ImportError:
    pass
else:
    sys.exit("medfl could be imported")
import mlflow.models, mlflow.pytorch, torch
shape = mlflow.models.get_model_info(sys.argv[1]).signature.inputs.inputs[0].shape
model = mlflow.pytorch.load_model(sys.argv[1])
torch.manual_seed(0)
out = model(torch.rand(1, *shape[1:]))
print(json.dumps({"type": type(model).__name__, "shape": list(out.shape),
                  "medfl": [m for m in sys.modules if m.partition(".")[0] in ("medfl", "medfl_plugins", "monai")]}))
"""


def test_mlflow_as_its_users_expect(tiny_fl, resolve, tmp_path, monkeypatch):
    """MLflow's environment variables choose the store and the experiment (an entry's own
    ``uri``/``experiment`` win); every run has MLflow's standard tags (user, source, the git
    commit of the checkout it was started in) and medfl's version; the experiment's run holds
    each arm's headline figures (summary.json's ``final`` means); the method runs have the
    across-client means only (``per_client`` off), the evaluation's names sorting before the
    traffic's; the logged model loads where medfl cannot be imported."""
    from medfl_plugins.trackers import MLflow

    checkout = tmp_path / "checkout"
    checkout.mkdir()
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@example.org"]
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "start"]):
        subprocess.run(git + args, check=True, capture_output=True, timeout=60)
    commit = subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    monkeypatch.chdir(checkout)
    uri = f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from_env")
    assert MLflow(tmp_path).uri == uri and MLflow(tmp_path).experiment_name("t") == "from_env"
    assert MLflow(tmp_path, experiment="entry", uri="sqlite:///x.db").experiment_name("t") == "entry"
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_URI: expected a tracking URI"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "plain_folder"))
        MLflow(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)

    cfg = {**tiny_fl, "rounds": 1, "methods": [{"name": "fedavg"}, {"name": "fedavgm"}], "tracking": ["mlflow"]}
    exp = Path(run_experiment(resolve(cfg))["dir"])
    assert not (exp / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=uri)
    parent, children = _runs(client, "from_env")
    assert set(children) == {"fedavg", "fedavgm"}, _tracker_failures(exp)
    version = __import__("importlib.metadata").metadata.version("medfl")
    for run in (parent, *children.values()):
        tags = run.data.tags
        assert tags["mlflow.source.git.commit"] == commit and tags["medfl.version"] == version
        assert tags["mlflow.user"] and tags["mlflow.source.name"] and tags["mlflow.source.type"] == "LOCAL"
    for label, run in children.items():
        final = json.loads((exp / label / "summary.json").read_text())["final"]
        for split in ("local_test", "global_test"):
            assert parent.data.metrics[f"{label}/{split}/accuracy"] == pytest.approx(final[split]["accuracy"]["mean"])
        assert parent.data.metrics[f"{label}/mb_to_clients_per_round"] > 0
        keys = sorted(run.data.metrics)
        assert "eval/local_test/accuracy/mean" in keys and "traffic/train/bytes_to_client/mean" in keys
        assert not [k for k in keys if k.startswith("communication/") or k.split("/")[-1].isdigit()], keys
        assert keys[0].startswith("eval/") and max(i for i, k in enumerate(keys) if k.startswith("eval/")) < \
            min(i for i, k in enumerate(keys) if k.startswith("traffic/")), keys

    model = client.search_logged_models([parent.info.experiment_id], filter_string=
                                        f"source_run_id = '{children['fedavg'].info.run_id}'")[0]
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_MEDFL, f"models:/{model.model_id}"], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == {"type": "RecursiveScriptModule", "shape": [1, 2], "medfl": []}, loaded


def test_per_client_is_read_as_the_bundle_command_line_passes_it(tiny_fl, resolve):
    """MONAI's bundle command line hands ``--fl#tracking '[{"name": "mlflow", "per_client": true}]'``
    over with the word ``true``: read as the boolean, as every other boolean setting is."""
    entry = [{"name": "mlflow", "per_client": "true"}, {"name": "tensorboard", "per_client": False}]
    assert resolve({**tiny_fl, "tracking": entry})["tracking"] == [{"name": "mlflow", "per_client": True},
                                                                   {"name": "tensorboard", "per_client": False}]
