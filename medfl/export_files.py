"""The files of a bundle ``medfl export`` writes (:func:`medfl.export.export_run`): the
network as TorchScript (:func:`torchscript`), ``configs/metadata.json`` (:func:`metadata`),
``configs/inference.json`` (:func:`inference_config`, its data part :func:`inference_data`),
``configs/logging.conf``, ``LICENSE`` (:func:`license_text`) and ``docs/README.md``
(:func:`readme`).

An exported bundle runs with MONAI and torch alone: its ``inference.json`` reads the run's
manifest and preprocesses with MONAI transforms only, and its prediction loop is MONAI config
expressions (:data:`_LOOP`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from medfl.arm_report import run_json
from medfl.rundir import RunError

__all__ = ["ATOL", "ExportError", "LOGGING_CONF", "inference_config", "inference_data", "license_text", "metadata",
           "readme", "torchscript"]

#: Largest difference allowed between the run's model and the exported network on a probe.
ATOL = 1e-5


class ExportError(RunError):
    """A run cannot be exported as asked (not a finished run, an out dir in use...)."""


def torchscript(net: nn.Module, path: Path, probe: torch.Tensor, extra: dict[str, str]) -> dict[str, Any]:
    """Write ``net`` as TorchScript the way ``monai.bundle ckpt_export`` does
    (:func:`monai.networks.utils.convert_to_torchscript`, scripting, verified against the
    eager network); where scripting fails, tracing on ``probe``. Returns how (for the
    metadata)."""
    from monai.networks.utils import convert_to_torchscript

    net = net.eval()
    try:
        convert_to_torchscript(net, filename_or_obj=str(path), extra_files=extra, verify=True, inputs=[probe],
                               use_trace=False, rtol=1e-4, atol=ATOL)
        return {"file": "models/model.ts", "method": "torch.jit.script"}
    except Exception as exc:   # noqa: BLE001 - torch.jit raises many kinds; the reason is recorded
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    try:
        convert_to_torchscript(net, filename_or_obj=str(path), extra_files=extra, verify=True, inputs=[probe],
                               use_trace=True, rtol=1e-4, atol=ATOL)
        return {"file": "models/model.ts", "method": "torch.jit.trace", "script_failed": reason,
                "note": "traced on a batch of the input shape: control flow is fixed to that input"}
    except Exception as exc:   # noqa: BLE001
        path.unlink(missing_ok=True)
        return {"file": None, "script_failed": reason, "trace_failed": f"{type(exc).__name__}: {exc}"}


def metadata(run: Any, role: str, config: dict[str, Any], source: Any, probs: bool,
              packages: dict[str, str]) -> dict[str, Any]:
    """An exported bundle's ``configs/metadata.json`` (MONAI's bundle spec: its mandatory keys,
    the network's input and output formats), with ``medfl_export`` saying where it came from."""
    import monai
    import numpy

    shape = [int(s) for s in source.sample_shape]
    names = [n or str(k) for k, n in enumerate(source.class_names)]
    label = run.label
    monai_route = config["_target_"].startswith("monai.")
    return {
        "schema": "https://github.com/Project-MONAI/MONAI-extra-test-data/releases/download/0.8.1/"
                  "meta_schema_20220324.json",
        "version": "0.1.0",
        "changelog": {"0.1.0": f"exported by medfl export from {run.run_dir}"},
        "monai_version": monai.__version__,
        "pytorch_version": torch.__version__.split("+")[0],
        "numpy_version": numpy.__version__,
        # MONAI >= 1.4's name for optional_packages_version; MONAI's bundle CLI imports fire
        "required_packages_version": {"fire": _version("fire"), **packages},
        "name": f"medfl {label}: {role}",
        "task": f"Image classification ({len(names)} classes), trained federated by medfl",
        "description": f"The {role} model of the medfl run {run.run_dir.name!r} (method {label}).",
        "authors": "medfl export",
        "copyright": "as the training data's licence allows",
        "network_data_format": {
            "inputs": {"image": {"type": "image", "format": "magnitude", "modality": "as the training data",
                                 "num_channels": shape[0], "spatial_shape": shape[1:], "dtype": "float32",
                                 "value_range": [], "is_patch_data": False,
                                 "channel_def": {str(i): f"channel_{i}" for i in range(shape[0])}}},
            "outputs": {"pred": {"type": "probabilities" if probs else "logits", "format": "classes",
                                 "modality": "n/a", "num_channels": len(names), "spatial_shape": [1],
                                 "dtype": "float32", "value_range": [0, 1] if probs else [], "is_patch_data": False,
                                 "channel_def": {str(i): n for i, n in enumerate(names)}}},
        },
        "medfl_export": {"run_dir": str(run.run_dir), "method": label, "model": role,
                         "medfl_version": _version("medfl"), "route": "monai" if monai_route else "torchscript",
                         "model_spec": None if monai_route else {k: v for k, v in config.items() if k != "_target_"}},
    }


#: The prediction loop of an exported bundle's ``inference.json`` in MONAI config expressions
#: (MONAI and torch only: no pytorch-ignite, no medfl). A reference (``@id``) that a lambda
#: needs is one of its default arguments, evaluated where it is defined: before Python 3.12 a
#: lambda's (or comprehension's) body does not see the references MONAI passes to ``eval``.
_LOOP: dict[str, Any] = {
    "rows": "$list(filter(lambda r, split=@split: split in (None, '', 'all') or r.get('split') == split, "
            "csv.DictReader(io.StringIO(pathlib.Path(@manifest).read_text(encoding='utf-8')))))",
    "datalist": "$list(map(lambda ir, root=@dataset_dir, column=@image_column: {'image': os.path.join(root, "
                "ir[1][column]), 'label': int(ir[1]['label']), 'sample_id': ir[1].get('sample_id', str(ir[0]))}, "
                "enumerate(@rows)))",
    "dataset": {"_target_": "Dataset", "data": "@datalist", "transform": "@preprocessing"},
    "dataloader": {"_target_": "DataLoader", "dataset": "@dataset", "batch_size": "@batch_size", "shuffle": False,
                   "num_workers": 0},
    "network": "$@network_def.to(@device)",
    "checkpoint": "$@bundle_root + '/models/model.pt'",
    "inferer": {"_target_": "SimpleInferer"},
    "header": "$['sample_id', 'label', 'prediction'] + ['prob_' + n for n in @class_names]",
    "predict": "$torch.no_grad()(lambda batch, net=@network, inferer=@inferer, post=@postprocessing, device=@device: "
               "[[sid, int(y), int(p.argmax()), *p.tolist()] for sid, y, p in zip(batch['sample_id'], batch['label'], "
               "[torch.as_tensor(post(o)).float().cpu() for o in monai.data.decollate_batch(inferer("
               "batch['image'].to(device), net))])])",
    "write_csv": "$lambda path, rows: (os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True), "
                 "(lambda f: (csv.writer(f).writerows(rows), f.close()))(open(path, 'w', newline='')), "
                 "print('predictions: ' + path), path)[-1]",
    "evaluator": "$types.SimpleNamespace(run=lambda loader=@dataloader, predict=@predict, header=@header, "
                 "path=@output_file, write=@write_csv: write(path, [header] + (list(itertools.chain.from_iterable("
                 "map(predict, loader))) or exec(\"raise ValueError('no samples to predict on: check dataset_dir, "
                 "manifest, image_column and split')\"))))",
    "initialize": ["$@network.load_state_dict(torch.load(@checkpoint, map_location=@device, weights_only=True), "
                   "strict=True)", "$@network.eval()"],
    "run": ["$@evaluator.run()"],
}

#: The packages MONAI's ``LoadImage`` reads a file suffix with (metadata's required packages).
_READER_PACKAGES = {".nii": "nibabel", ".gz": "nibabel", ".dcm": "pydicom", "": "pydicom"}


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:   # a checkout that is not installed
        return "unknown"


def inference_data(spec: Mapping[str, Any], source: Any) -> dict[str, Any]:
    """The data part of an exported bundle's ``inference.json``: the dataset's files (its
    manifest, ``dataset_dir``, ``image_column``, ``split``) and its evaluation-time
    preprocessing in MONAI transforms only (``LoadImaged`` with the reader medfl uses, then
    :func:`medfl.data.manifest.eval_chain`), so the bundle preprocesses as ``medfl predict`` does
    without medfl.

    Args:
        spec: the run's dataset spec (``{"name": "manifest" | "synthetic2d", ...}``).
        source: the :class:`~medfl.data.source.FederatedSource` the spec built.

    Returns:
        ``{"config": {...inference.json keys...}, "packages": {name: version},
        "steps": [plain-language preprocessing steps]}``.

    Raises:
        ExportError: a dataset whose samples are not files that MONAI reads (``random_blocks``,
            a plugin's dataset), or a manifest whose files need different readers.
    """
    from medfl.data.images import reader_for
    from medfl.data.manifest import eval_chain

    name = spec.get("name")
    if name == "synthetic2d":
        folder, manifest, column = Path(source.info["directory"]).absolute(), "manifest.csv", "path"
        normalize, size = "none", None
    elif name == "manifest":
        path = Path(spec["path"]).absolute()
        folder = Path(spec["root"]).absolute() if spec.get("root") else path.parent
        manifest = path.name if path.parent == folder else str(path)
        column, normalize, size = source.info["column"], source.info["normalize"], source.info["spatial_size"]
    else:
        raise ExportError(f"dataset {name!r}: its samples are made by its medfl code, not read from files, so an "
                          "exported bundle cannot preprocess them with MONAI transforms alone; export needs a "
                          "'manifest' or 'synthetic2d' dataset (medfl predict runs the models on any dataset)")
    files = [str(f) for f in source.table[column]]
    kinds = {"npy" if f.lower().endswith(".npy") else (reader_for(f) or "auto") for f in files}
    if len(kinds) > 1:
        raise ExportError(f"dataset {name!r}: column {column!r} names files that need different readers "
                          f"({', '.join(sorted(kinds))}); an exported bundle reads every file with one LoadImaged")
    kind = kinds.pop()
    load: dict[str, Any] = {"_target_": "LoadImaged", "keys": "image", "image_only": True,
                            "ensure_channel_first": True}
    if kind == "npy":   # medfl reads .npy as written: channel first
        load.update(reader="NumpyReader", channel_dim=0)
    elif kind != "auto":
        load["reader"] = kind
    chain = eval_chain(len(source.sample_shape) - 1, normalize, size)
    packages = sorted({"pillow" if kind == "PILReader" else _READER_PACKAGES.get(Path(f).suffix.lower(), "pillow")
                       for f in files} if kind != "npy" else set())
    steps = [f"read each file of the manifest's column {column!r} with MONAI's LoadImaged ("
             + ("NumpyReader, channel first as written" if kind == "npy"
                else f"{load.get('reader', 'the reader MONAI picks by suffix')}, channel first") + ")"]
    steps += [f"{t}({', '.join(f'{k}={v!r}' for k, v in kw.items() if k != 'keys')})" for t, kw in chain]
    config = {
        "dataset_dir": str(folder),
        "manifest": f"$@dataset_dir + '/{manifest}'" if "/" not in manifest else manifest,
        "image_column": column,
        "split": "all",
        "preprocessing": {"_target_": "Compose", "transforms": [load, *({"_target_": t, **kw} for t, kw in chain)]},
    }
    return {"config": config, "packages": {p: _version(p) for p in packages}, "steps": steps}


def inference_config(network: dict[str, Any] | str, data: dict[str, Any], class_names: list[str],
                      batch_size: int, probs: bool) -> dict[str, Any]:
    """An exported bundle's ``configs/inference.json``: MONAI's inference workflow on the
    run's manifest (override ``dataset_dir``, ``manifest``, ``split`` or ``datalist``), with
    MONAI, torch and the standard library only (:data:`_LOOP`)."""
    return {
        "imports": ["$import csv", "$import glob", "$import io", "$import itertools", "$import os", "$import pathlib",
                    "$import types", "$import torch", "$import monai"],
        "bundle_root": ".",
        "device": "cpu",
        **{k: v for k, v in data.items() if k != "preprocessing"},
        "output_dir": "$@bundle_root + '/eval'",
        "output_file": "$@output_dir + '/predictions.csv'",
        "batch_size": batch_size,
        "class_names": class_names,
        "network_def": network,
        "preprocessing": data["preprocessing"],
        "postprocessing": ({"_target_": "Identity"} if probs else {"_target_": "Activations", "softmax": True}),
        **_LOOP,
    }


LOGGING_CONF = """\
[loggers]
keys=root

[handlers]
keys=console

[formatters]
keys=plain

[logger_root]
level=INFO
handlers=console

[handler_console]
class=StreamHandler
level=INFO
formatter=plain
args=(sys.stdout,)

[formatter_plain]
format=%(asctime)s %(levelname)s %(name)s: %(message)s
"""


def license_text(license_file: str | Path | None) -> tuple[str, str]:
    """``(LICENSE text, what it is)``: ``license_file``'s text where given (the run owner's
    choice), else medfl's own Apache-2.0 licence."""
    if license_file is not None:
        path = Path(license_file)
        if not path.is_file():
            raise ExportError(f"{path}: --license: no such file (a licence text for the exported models)")
        return path.read_text(encoding="utf-8"), f"the licence in LICENSE (from {path.name})"
    try:
        from importlib.metadata import distribution

        dist = distribution("medfl")
        found = [f for f in dist.files or [] if Path(str(f)).name.upper().startswith("LICENSE")]
        text = dist.locate_file(found[0]).read_text(encoding="utf-8") if found else ""
    except Exception:   # noqa: BLE001 - not installed, or its files not listed: the checkout's own
        text = ""
    if "Apache License" not in text:
        repo = Path(__file__).resolve().parents[1] / "LICENSE"
        text = repo.read_text(encoding="utf-8") if repo.is_file() else (
            "Apache License, Version 2.0 (SPDX: Apache-2.0): https://www.apache.org/licenses/LICENSE-2.0\n")
    return text, "Apache-2.0 (medfl's licence, the default of `medfl export`)"


def _final_metrics(run_dir: Path) -> dict[str, str]:
    """The run's final metrics (``summary.json``'s ``final`` block: per evaluated split, each
    metric's mean over the clients), as ``{split: "accuracy 0.85, auc 0.5, ..."}``."""
    import math

    final = run_json(run_dir, "summary.json").get("final") or {}
    out: dict[str, str] = {}
    for split, metrics in final.items():
        if not isinstance(metrics, dict):
            continue
        means = [(m, v.get("mean")) for m, v in metrics.items() if isinstance(v, dict)]
        shown = [f"{m} {v:.4g}" for m, v in means if isinstance(v, (int, float)) and math.isfinite(v)]
        if shown:
            out[split] = ", ".join(shown)
    return out


def readme(run: Any, role: str, meta: dict[str, Any], data: dict[str, Any], last: int, licence: str) -> str:
    """An exported bundle's ``docs/README.md``: the model, its inputs and outputs, how to run
    it, where it came from."""
    fmt = meta["network_data_format"]
    image, pred = fmt["inputs"]["image"], fmt["outputs"]["pred"]
    route = meta["medfl_export"]["route"]
    network = ("`monai.networks.nets.ResNet` (its complete arguments are `network_def` in configs/inference.json; "
               "weights in models/model.pt)" if route == "monai" else
               f"medfl's `{meta['medfl_export']['model_spec'].get('name')}` as TorchScript (models/model.ts, "
               "loaded with `torch.jit.load`; models/model.pt holds the same weights in medfl's key names)")
    metrics = _final_metrics(run.run_dir)
    lines = [
        f"# {meta['name']}", "",
        f"{meta['description']} {meta['task']}.", "",
        "## Model", "",
        f"- network: {network}",
        f"- classes ({pred['num_channels']}): " + ", ".join(f"{k} = {v}" for k, v in pred["channel_def"].items()),
        "", "## Input", "",
        f"`image`: float32, channel first, {image['num_channels']} channel(s) x "
        f"{' x '.join(map(str, image['spatial_shape']))} after preprocessing. `configs/inference.json`'s "
        "`preprocessing` (MONAI transforms only) does what medfl's dataset did at evaluation time:", "",
        *[f"{i}. {s}" for i, s in enumerate(data["steps"], 1)], "",
        "## Output", "",
        f"`pred`: {pred['type']} per class (" + ("the network's own" if pred["type"] == "probabilities"
                                                 else "logits; `postprocessing` applies the softmax") + "). "
        "The run writes `eval/predictions.csv`: `sample_id`, `label`, `prediction` (the most probable class) "
        "and `prob_<class>`.", "",
        "## Run it", "",
        "Needs MONAI " + meta["monai_version"] + " and PyTorch " + meta["pytorch_version"] + " or later"
        + "".join(f", {k} {v}" for k, v in meta["required_packages_version"].items())
        + " (`python -m monai.bundle` needs fire); not medfl:", "",
        "```bash",
        "pip install " + " ".join(f'"{k}>={v}"' if v != "unknown" else k for k, v in [("monai", meta["monai_version"]),
                                                             ("torch", meta["pytorch_version"]),
                                                             *meta["required_packages_version"].items()]),
        "python -m monai.bundle run --config_file configs/inference.json --meta_file configs/metadata.json \\",
        "    --bundle_root . [--dataset_dir DIR] [--split test] [--device cuda:0]",
        "```", "",
        "`dataset_dir` holds a manifest CSV (`manifest`, default the run's) with a `label` column, the "
        "`image_column` naming each file (relative to `dataset_dir`), and optionally `sample_id` and `split`. "
        "To predict on a folder without a manifest, give the list yourself, e.g. "
        "`--datalist \"\\$[{'image': f, 'label': -1, 'sample_id': f} for f in sorted(glob.glob(@dataset_dir + "
        "'/*.dcm'))]\"`.", "",
        "## Where it came from", "",
        f"- medfl run `{run.run_dir.parent.name}/{run.run_dir.name}` (`{run.run_dir}`), method `{run.label}`, "
        f"the {role} model, round {last}",
        f"- exported by medfl {meta['medfl_export']['medfl_version']}",
        *([f"- the run's final metrics (mean over its clients, round {last}):"]
          + [f"  - {split}: {shown}" for split, shown in metrics.items()] if metrics else []),
        "", "## Licence", "",
        f"The exported model is under {licence}. The data it was trained on has its own licence and terms, "
        "which may restrict how the model (its weights) may be used or shared: check them before you do.", "",
    ]
    return "\n".join(lines)
