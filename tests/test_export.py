"""``medfl export``: a finished run's models as MONAI bundles that MONAI alone loads, that
predict what ``medfl predict`` does, and that ``python -m monai.bundle run`` infers with in a
process that sees only the packages their README names (no medfl)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from medfl.cli import main
from medfl.experiment import run_experiment
from medfl.export import SourceDataset, export_run
from medfl.export_files import ExportError, inference_config, inference_data
from medfl.predict import predict
from medfl.rundir import RunError

DEMO = Path(__file__).resolve().parents[1] / "bundles" / "demo"
ENV = {**os.environ, "MEDFL_NO_PROGRESS": "1"}

# Loads exported bundles with MONAI and torch only (medfl is never imported: the check at
# the end fails otherwise) and writes, per bundle, the probabilities of model.pt and model.ts
# on images.pt (one process for several bundles: MONAI's import takes seconds).
MONAI_ONLY = """
import json, sys, torch
from monai.bundle import ConfigParser
images, out, *bundles = sys.argv[1:]
x = torch.load(images)
result = {}
for bundle in bundles:
    cfg = json.load(open(bundle + "/configs/inference.json"))
    net = ConfigParser({"net": cfg["network_def"]}).get_parsed_content("net")
    net.load_state_dict(torch.load(bundle + "/models/model.pt", weights_only=True), strict=True)
    ts = torch.jit.load(bundle + "/models/model.ts")
    with torch.no_grad():
        p = torch.softmax(net.eval()(x), 1)
        q = torch.softmax(ts.eval()(x), 1)
    result[bundle] = {"pt": p, "ts": q, "type": type(net).__module__ + "." + type(net).__name__}
assert not [m for m in sys.modules if m == "medfl" or m.startswith("medfl.")], "medfl was imported"
torch.save(result, out)
"""


def _exact_environment(packages: list[str], root: Path) -> Path:
    """A folder holding exactly ``packages`` and what they require (their installed files,
    linked), for an interpreter started with ``-S`` and ``PYTHONPATH`` on it: it sees these
    distributions and the standard library, nothing else (no medfl, no site-packages)."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, object] = {}
    todo = list(packages)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        found[name] = dist = distribution(name)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    root.mkdir(parents=True, exist_ok=True)
    for dist in found.values():
        for top in {f.parts[0] for f in dist.files or []}:
            if top not in ("..", "__pycache__") and not top.endswith(".data") and not (root / top).exists():
                (root / top).symlink_to(dist.locate_file(top))
    return root


def _run_readme_command(bundle: Path, *extra: str) -> Path:
    """The exported bundle README's command (``pip install ...`` then ``python -m monai.bundle
    run ...``) as written, in the bundle's folder: the packages of its ``pip install`` line
    are the only ones the interpreter sees (medfl's import fails); returns the predictions CSV."""
    text = (bundle / "docs" / "README.md").read_text(encoding="utf-8")
    block = re.search(r"^```bash\n(.*?)^```", text, re.S | re.M).group(1).replace("\\\n", " ")
    pip, run = [line for line in block.splitlines() if line.strip()]
    packages = [re.split(r"[<>=]", p.strip('"'))[0] for p in shlex.split(pip)[2:]]
    assert {"monai", "torch", "fire"} <= set(packages), pip
    env_dir = _exact_environment(packages, bundle.parent.parent / f"env_{bundle.name}")
    command = re.sub(r"\s*\[[^]]*\]", "", run).replace("python ", f"{shlex.quote(sys.executable)} -S ", 1)
    env = {**ENV, "PYTHONPATH": str(env_dir), "PYTHONNOUSERSITE": "1"}
    probe = subprocess.run([sys.executable, "-S", "-c", "import medfl"], capture_output=True, text=True, env=env,
                           cwd=bundle, timeout=120)
    assert probe.returncode != 0 and "No module named 'medfl'" in probe.stderr
    proc = subprocess.run(f"{command} {shlex.join(extra)}", shell=True, cwd=bundle, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return bundle / "eval" / "predictions.csv"


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory) -> Path:
    """The demo bundle at a tiny size through MONAI's bundle CLI, with FedAvg (a global model)
    and FedBN (a personal model per client, its norm layers)."""
    root = tmp_path_factory.mktemp("demo")
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", str(DEMO / "configs" / "train.json"),
           "--bundle_root", str(root), "--fl#rounds", "1", "--fl#num_clients", "2", "--fl#dataset#num_samples", "96",
           "--fl#partition#min_size", "10", "--fl#progress", "False", "--fl#plots", "False",
           "--fl#methods", json.dumps([{"name": "fedavg"}, {"name": "fedbn"}])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "runs" / "demo"


def _probs(csv: Path, client: str | None = None) -> tuple[list[str], np.ndarray]:
    df = pd.read_csv(csv, dtype={"client_id": str, "sample_id": str})
    if client is not None:
        df = df[df["client_id"] == client]
    return df["sample_id"].tolist(), df[[c for c in df.columns if c.startswith("prob_")]].to_numpy()


def _monai_only(bundles: list[Path], images: torch.Tensor, tmp: Path) -> list[dict]:
    """Each bundle's probabilities from MONAI and torch alone (:data:`MONAI_ONLY`), in order."""
    torch.save(images, tmp / "images.pt")
    proc = subprocess.run([sys.executable, "-c", MONAI_ONLY, str(tmp / "images.pt"), str(tmp / "o.pt"),
                           *map(str, bundles)], capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(tmp / "o.pt")
    return [out[str(b)] for b in bundles]


def _leaves(node: object, key: str = "") -> list[tuple[str, object]]:
    """Every ``(key, value)`` leaf of a parsed JSON config."""
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in _leaves(v, k)]
    if isinstance(node, list):
        return [leaf for v in node for leaf in _leaves(v, key)]
    return [(key, node)]


def _images(run_dir: Path) -> torch.Tensor:
    spec = json.loads((run_dir / "config.json").read_text())["fl"]["dataset"]
    ds = SourceDataset(spec)
    return torch.stack([ds[i]["image"] for i in range(len(ds))])


def test_global_model_loads_into_plain_monai_resnet(demo_runs, tmp_path):
    run_dir = demo_runs / "fedavg"
    summary = export_run(run_dir, tmp_path / "out")
    assert [b["folder"] for b in summary["bundles"]] == ["global"]
    assert summary["bundles"][0]["route"] == "monai" and summary["bundles"][0]["torchscript"] == "torch.jit.script"
    net = json.loads((tmp_path / "out" / "global" / "configs" / "inference.json").read_text())["network_def"]
    assert net["_target_"] == "monai.networks.nets.ResNet" and net["conv1_t_stride"] == 2   # medfl's stem, recorded
    ids, want = _probs(predict(run_dir, output=tmp_path / "p.csv", clients=["0"]))
    (got,) = _monai_only([tmp_path / "out" / "global"], _images(run_dir), tmp_path)
    assert got["type"] == "monai.networks.nets.resnet.ResNet"
    np.testing.assert_allclose(got["pt"].numpy(), want, atol=1e-5)
    np.testing.assert_allclose(got["ts"].numpy(), want, atol=1e-5)
    meta = json.loads((tmp_path / "out" / "global" / "configs" / "metadata.json").read_text())
    assert meta["network_data_format"]["inputs"]["image"]["spatial_shape"] == [32, 32]
    assert meta["medfl_export"]["torchscript"]["method"] == "torch.jit.script"
    # MONAI's bundle spec: its mandatory metadata keys, and the files init_bundle writes
    assert {"version", "monai_version", "pytorch_version", "numpy_version", "required_packages_version", "task",
            "description", "authors", "copyright", "network_data_format"} <= set(meta)
    assert "medfl" not in meta["required_packages_version"]
    bundle = tmp_path / "out" / "global"
    assert "Apache License" in (bundle / "LICENSE").read_text()
    readme = (bundle / "docs" / "README.md").read_text()
    assert "python -m monai.bundle run --config_file configs/inference.json" in readme
    assert f"method `fedavg`" in readme and "local_test: accuracy" in readme and "may restrict" in readme
    import configparser

    conf = configparser.ConfigParser(interpolation=None)
    conf.read(bundle / "configs" / "logging.conf")
    assert conf["logger_root"]["handlers"] == "console"


def test_personal_models_are_exported_per_client(demo_runs, tmp_path):
    run_dir = demo_runs / "fedbn"
    summary = export_run(run_dir, tmp_path / "out")
    assert [b["folder"] for b in summary["bundles"]] == ["client_0", "client_1"]
    assert summary["not_exported"][0]["model"] == "global"   # FedBN's norm layers never leave the clients
    assert json.loads((tmp_path / "out" / "export.json").read_text()) == json.loads(json.dumps(summary))
    images = _images(run_dir)
    csv = predict(run_dir, output=tmp_path / "p.csv")
    outs = dict(zip(("0", "1"), _monai_only([tmp_path / "out" / f"client_{cid}" for cid in ("0", "1")], images,
                                            tmp_path)))
    for cid in ("0", "1"):
        _, want = _probs(csv, cid)
        np.testing.assert_allclose(outs[cid]["pt"].numpy(), want, atol=1e-5)
        np.testing.assert_allclose(outs[cid]["ts"].numpy(), want, atol=1e-5)
    assert not torch.allclose(outs["0"]["pt"], outs["1"]["pt"])   # two different personal models


def test_monai_bundle_run_infers_like_medfl_predict(demo_runs, tmp_path):
    """The exported bundle runs where medfl cannot be imported: MONAI transforms read the run's
    manifest and the MONAI ResNet predicts what medfl predict does."""
    run_dir = demo_runs / "fedavg"
    export_run(run_dir, tmp_path / "out")
    bundle = tmp_path / "out" / "global"
    cfg = json.loads((bundle / "configs" / "inference.json").read_text())
    code = [v for k, v in _leaves(cfg) if k == "_target_" or (isinstance(v, str) and v.startswith("$"))]
    assert len(code) > 20 and not [v for v in code if "medfl" in v]   # no medfl in any target or expression
    ids, got = _probs(_run_readme_command(bundle))
    want_ids, want = _probs(predict(run_dir, output=tmp_path / "p.csv", clients=["1"]))
    assert ids == want_ids
    np.testing.assert_allclose(got, want, atol=1e-5)
    out = pd.read_csv(bundle / "eval" / "predictions.csv")
    assert (out["prediction"] == got.argmax(1)).all() and list(out.columns[:3]) == ["sample_id", "label", "prediction"]
    # the exported bundle is a complete MONAI inference workflow, and MONAI's checks pass on it
    from monai.bundle import ConfigWorkflow

    wf = ConfigWorkflow(config_file=str(bundle / "configs" / "inference.json"),
                        meta_file=str(bundle / "configs" / "metadata.json"), workflow_type="infer",
                        bundle_root=str(bundle))
    wf.initialize()
    assert wf.check_properties() == [] and callable(wf.evaluator.run)
    proc = subprocess.run([sys.executable, "-m", "monai.bundle", "verify_net_in_out", "network_def", "--config_file",
                           str(bundle / "configs" / "inference.json"), "--meta_file",
                           str(bundle / "configs" / "metadata.json")], capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_registered_model_route_for_a_small_cnn(tiny_fl, resolve, tmp_path):
    """small_cnn has no plain MONAI network: the bundle builds the registered model, with the
    Local method's own model per client; a method whose evaluation model is more than the
    registered model is refused, saying why."""
    tiny_fl["methods"] = [{"name": "local"}, {"name": "fedsdc"}]
    tiny_fl["rounds"] = 1
    tiny_fl["plots"] = False
    exp = Path(run_experiment(resolve(tiny_fl))["dir"])
    # FedSDC evaluates each client with a head ensemble, which no registered model spec rebuilds
    with pytest.raises(ExportError, match="no model of the run can be exported: global: method 'fedsdc' keeps no "
                                          "global model; client 0: its model is a HeadEnsemble"):
        export_run(exp / "fedsdc", tmp_path / "sdc")
    assert not (tmp_path / "sdc").exists()
    run_dir = exp / "local"
    summary = export_run(run_dir, tmp_path / "out")
    assert {b["folder"] for b in summary["bundles"]} == {"client_0", "client_1", "client_2"}
    assert {b["route"] for b in summary["bundles"]} == {"torchscript"}
    from monai.bundle import ConfigParser

    images = _images(run_dir)
    csv = predict(run_dir, output=tmp_path / "p.csv")
    for cid in ("0", "2"):
        bundle = tmp_path / "out" / f"client_{cid}"
        cfg = json.loads((bundle / "configs" / "inference.json").read_text())
        assert cfg["network_def"] == "$torch.jit.load(@bundle_root + '/models/model.ts', map_location=@device)"
        parser = ConfigParser({**cfg, "bundle_root": str(bundle)})
        net = parser.get_parsed_content("network_def").eval()
        net.load_state_dict(torch.load(bundle / "models" / "model.pt", weights_only=True), strict=True)
        with torch.no_grad():
            got = torch.softmax(net(images), 1).numpy()
        np.testing.assert_allclose(got, _probs(csv, cid)[1], atol=1e-5)
    # the TorchScript bundle runs without medfl, as medfl predict does
    ids, got = _probs(_run_readme_command(tmp_path / "out" / "client_1"))
    want_ids, want = _probs(csv, "1")
    assert ids == want_ids
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_export_errors_name_the_problem(demo_runs, tmp_path, capsys):
    run_dir = demo_runs / "fedavg"
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not empty; export writes into a new or empty folder"):
        export_run(run_dir, busy)
    assert [p.name for p in busy.iterdir()] == ["mine.txt"] and (busy / "mine.txt").read_text() == "keep me"
    with pytest.raises(ExportError, match="no config.json; not a medfl run directory"):
        export_run(tmp_path, tmp_path / "o1")
    with pytest.raises(RunError, match="an experiment directory; pass one method's run directory"):
        export_run(demo_runs, tmp_path / "o2")
    # a run that did not finish: its status says so
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "config.json").write_text((run_dir / "config.json").read_text())
    (stopped / "status.json").write_text(json.dumps({"status": "stopped", "last_round": 1, "rounds": 3}))
    with pytest.raises(ExportError, match=r"the run is 'stopped' at round 1 of 3, not finished; resume it first"):
        export_run(stopped, tmp_path / "o3")
    assert not any((tmp_path / n).exists() for n in ("o1", "o2", "o3"))
    # the command: one error line, exit code 2
    assert main(["export", str(run_dir), "--out", str(busy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("medfl: error: ") and "not empty" in err[0]
    with pytest.raises(ExportError, match="nowhere.txt: --license: no such file"):
        export_run(run_dir, tmp_path / "o4", license_file=tmp_path / "nowhere.txt")
    assert not (tmp_path / "o4").exists()
    (tmp_path / "terms.txt").write_text("CC BY-NC 4.0, as the data's terms require\n")
    assert main(["export", str(run_dir), "--out", str(tmp_path / "ok"), "--license", str(tmp_path / "terms.txt")]) == 0
    assert "ok/global: global (monai.networks.nets.ResNet; model.ts: torch.jit.script)" in capsys.readouterr().out
    assert (tmp_path / "ok" / "global" / "LICENSE").read_text() == "CC BY-NC 4.0, as the data's terms require\n"
    assert "the licence in LICENSE (from terms.txt)" in (tmp_path / "ok" / "global" / "docs" / "README.md").read_text()


def test_export_help_says_the_layout(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())   # argparse wraps the lines
    assert "OUT/global" in text and "OUT/client_<id>" in text and "--out" in text and "monai.bundle run" in text


# Every kind of file a manifest names (2D grayscale DICOM and PGM, RGB JPEG, 3D NIfTI, medfl's
# cached .npy), each with a normalisation and resize: (kind, suffix, normalize, spatial_size,
# the reader's package in the bundle's metadata).
FILE_KINDS = [
    ("dicom", ".dcm", "minmax", [8, 8], "pydicom"),
    ("pgm", ".pgm", "zscore", None, "pillow"),
    ("jpeg", ".jpg", "minmax", [6, 6], "pillow"),
    ("nifti", ".nii.gz", "zscore", [4, 4, 4], "nibabel"),
    ("npy", ".npy", "zscore", [4, 4], None),
]


def _write_image(kind: str, path: Path, rng: np.random.Generator) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "dicom":
        from medfl.fixtures.cbis_ddsm import write_mg_dicom

        write_mg_dicom(path, rng.integers(0, 4000, (12, 10)), "P1", "1.2.3", "1.2.3.4", "test", "L", "CC")
    elif kind in ("pgm", "jpeg"):
        from PIL import Image

        shape = (12, 10) if kind == "pgm" else (12, 10, 3)
        Image.fromarray(rng.integers(0, 255, shape).astype(np.uint8)).save(path)
    elif kind == "nifti":
        import nibabel as nib

        nib.save(nib.Nifti1Image(rng.normal(size=(6, 7, 5)).astype(np.float32), np.eye(4)), str(path))
    else:
        np.save(path, rng.normal(size=(1, 9, 7)).astype(np.float32))


@pytest.mark.parametrize("kind,suffix,normalize,size,package", FILE_KINDS)
def test_exported_preprocessing_is_medfl_s_in_monai_transforms(kind, suffix, normalize, size, package, tmp_path):
    """The exported inference.json reads a manifest's files with MONAI transforms alone and
    gives the tensors medfl's dataset gives at evaluation time."""
    import monai.transforms
    from monai.bundle import ConfigParser

    from medfl.data.manifest import manifest_source

    rng = np.random.default_rng(0)
    rows = []
    for i in range(3):
        _write_image(kind, tmp_path / "files" / f"img{i}{suffix}", rng)
        rows.append({"sample_id": f"s{i}", "image_path": f"files/img{i}{suffix}", "label": i % 2,
                     "split": "test" if i else "train"})
    pd.DataFrame(rows).to_csv(tmp_path / "manifest.csv", index=False)
    spec = {"name": "manifest", "path": str(tmp_path / "manifest.csv"), "column": "image_path",
            "normalize": normalize, "spatial_size": size}
    source = manifest_source(**{k: v for k, v in spec.items() if k != "name"})
    data = inference_data(spec, source)
    assert list(data["packages"]) == ([package] if package else [])
    cfg = inference_config({"_target_": "Identity"}, data["config"], ["a", "b"], 2, False)
    assert all(hasattr(monai.transforms, t["_target_"]) for t in cfg["preprocessing"]["transforms"])
    got = ConfigParser(cfg).get_parsed_content("dataset")
    want = source.make_dataset(source.table, False)
    assert len(got) == len(want) == 3
    for i in range(3):
        assert tuple(got[i]["image"].shape) == tuple(source.sample_shape)
        torch.testing.assert_close(torch.as_tensor(got[i]["image"]), want[i][0], rtol=0, atol=1e-6)
        assert (got[i]["sample_id"], got[i]["label"]) == (f"s{i}", i % 2)
    test_rows = ConfigParser({**cfg, "split": "test"}).get_parsed_content("datalist")
    assert [d["sample_id"] for d in test_rows] == ["s1", "s2"]


def test_export_refuses_data_monai_transforms_cannot_read(tmp_path):
    from PIL import Image

    from medfl.data.manifest import manifest_source
    from medfl.data.random_blocks import random_blocks

    with pytest.raises(ExportError, match="dataset 'random_blocks': its samples are made by its medfl code, not read "
                                          "from files"):
        inference_data({"name": "random_blocks"}, random_blocks(num_blocks=1, samples_per_block=2))
    np.save(tmp_path / "a.npy", np.zeros((1, 4, 4), np.float32))
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(tmp_path / "b.pgm")
    pd.DataFrame({"path": ["a.npy", "b.pgm"], "label": [0, 1]}).to_csv(tmp_path / "m.csv", index=False)
    with pytest.raises(ExportError, match=r"column 'path' names files that need different readers \(PILReader, npy\)"):
        inference_data({"name": "manifest", "path": str(tmp_path / "m.csv")}, manifest_source(str(tmp_path / "m.csv")))


def test_export_doc_commands_run_as_written(demo_runs, tmp_path):
    """docs/export.md: ``medfl export RUN_DIR --out DIR`` and the block after it
    (``python -m monai.bundle run`` on DIR/global, ``ckpt_export``) as written, with RUN_DIR and
    DIR filled in and the optional ``[...]`` arguments left out."""
    section = (Path(__file__).resolve().parents[1] / "docs" / "export.md").read_text(encoding="utf-8")
    export = re.search(r"`(medfl export RUN_DIR --out DIR)`", section).group(1)
    block = re.search(r"^```bash\n(.*?)^```", section, re.S | re.M).group(1).replace("\\\n", " ")
    out = tmp_path / "exported"
    fill = {"RUN_DIR": str(demo_runs / "fedavg"), "DIR": str(out)}

    def as_written(line: str) -> list[str]:
        line = re.sub(r"\s*#.*$", "", re.sub(r"\s*\[[^]]*\]", "", line))
        return [re.sub(r"\b(RUN_DIR|DIR)\b", lambda m: fill[m.group(1)], a) for a in shlex.split(line)]

    assert main(as_written(export)[1:]) == 0
    commands = [as_written(line) for line in block.splitlines() if line.strip()]
    assert [c[:4] for c in commands] == [["python", "-m", "monai.bundle", "run"],
                                        ["python", "-m", "monai.bundle", "ckpt_export"]], commands
    for argv in commands:
        proc = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=600, env=ENV,
                              cwd=tmp_path)
        assert proc.returncode == 0, (argv, proc.stderr[-3000:])
    assert len(pd.read_csv(out / "global" / "eval" / "predictions.csv")) > 0
    assert torch.jit.load(str(tmp_path / "net.ts")) is not None
