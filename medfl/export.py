"""A finished run's models as MONAI bundles (:func:`export_run`, ``medfl export``), and the
pieces medfl's training bundles use for MONAI's inference workflow (:func:`network_def`,
:class:`SourceDataset`, :class:`RunPredictor`).

Two routes from a medfl model spec to a network MONAI's tools build from a config
(:func:`network_config`):

* **MONAI route**: ``resnet10/18/34/50`` with batch norm (the default) and no ``dp_compatible``
  are :class:`monai.networks.nets.ResNet` itself: the config holds the complete spec (block,
  layers, block_inplanes, ``conv1_t_size``, ``conv1_t_stride`` (medfl's default is 2, MONAI's
  1), ``no_max_pool``, shortcut type ``"B"``...), and the state dict's ``head.`` keys become
  MONAI's ``fc.`` keys. Loading needs MONAI and torch only.
* **medfl route**: every other model (``small_cnn``, the PFedCDP CNNs, instance-norm or
  DP-compatible ResNets, ensembles, a plugin's model) is built by
  :func:`registered_model`, i.e. the registered model factory through the plugin registry,
  without medfl's engine; the state dict keeps medfl's keys. An exported bundle holds such a
  model as TorchScript (``models/model.ts``, ``network_def`` is ``torch.jit.load`` of it), so
  it too runs without medfl.

An exported bundle's ``inference.json`` reads the run's manifest and preprocesses with MONAI
transforms only (:func:`inference_data`); :func:`export_run` checks every exported network
against the run's own model on a probe batch before it writes anything, so an exported model
predicts what ``medfl predict`` does.
"""

from __future__ import annotations

import inspect
import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from medfl.rundir import RunError, resume_command

__all__ = [
    "ExportError",
    "RunPredictor",
    "same_state",
    "SourceDataset",
    "complete_spec",
    "export_run",
    "inference_data",
    "instantiate",
    "monai_state",
    "network_config",
    "network_def",
    "registered_model",
]

#: medfl's ResNet factories -> depth (:data:`medfl.models.resnet.RESNET_DEPTHS`).
_RESNETS = {"resnet10": 10, "resnet18": 18, "resnet34": 34, "resnet50": 50}
#: The keys a spec must hold for a complete network: the dataset gives them at run time.
_FILLED = ("spatial_dims", "in_channels", "num_classes")
#: Largest difference allowed between the run's model and the exported network on a probe.
_ATOL = 1e-5


class ExportError(RunError):
    """A run cannot be exported as asked (not a finished run, an out dir in use...)."""


# --------------------------------------------------------------------------------------------
# network specs
# --------------------------------------------------------------------------------------------


def _resnet_defaults() -> dict[str, Any]:
    from medfl.models.resnet import FeatureResNet

    return {n: p.default for n, p in inspect.signature(FeatureResNet.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _monai_route(spec: Mapping[str, Any]) -> bool:
    """Whether the model of ``spec`` is a plain :class:`monai.networks.nets.ResNet`."""
    return (spec.get("name") in _RESNETS and spec.get("norm", "batch") == "batch"
            and not spec.get("dp_compatible", False))


def network_config(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The MONAI config (``{"_target_": ..., ...}``) of the network a complete model spec
    builds (see the module docstring for the two routes).

    Args:
        spec: a model spec ``{"name": ..., **kwargs}`` holding ``spatial_dims``,
            ``in_channels`` and ``num_classes`` (:func:`complete_spec` fills them).

    Returns:
        For a batch-norm ResNet, ``monai.networks.nets.ResNet``'s every argument; else
        ``{"_target_": "medfl.export.registered_model", **spec}``.

    Raises:
        ValueError: the spec has no ``name`` or lacks one of the three keys above.
    """
    if not isinstance(spec.get("name"), str):
        raise ValueError(f"model spec {dict(spec)!r}: no 'name'")
    missing = [k for k in _FILLED if k not in spec]
    if missing:
        raise ValueError(f"model spec {dict(spec)!r} lacks {', '.join(missing)} (the dataset gives them: "
                         "pass the bundle's metadata or a run's model spec)")
    if not _monai_route(spec):
        return {"_target_": "medfl.export.registered_model", **dict(spec)}
    from medfl.models.resnet import RESNET_DEPTHS

    opts = {**_resnet_defaults(), **{k: v for k, v in spec.items() if k != "name"}}
    unknown = sorted(set(opts) - set(_resnet_defaults()))
    if unknown:
        raise ValueError(f"model {spec['name']!r} takes no argument(s) {', '.join(unknown)}")
    block, layers = RESNET_DEPTHS[_RESNETS[spec["name"]]]
    w = int(opts["width"])
    return {
        "_target_": "monai.networks.nets.ResNet",
        "block": block, "layers": list(layers), "block_inplanes": [w, 2 * w, 4 * w, 8 * w],
        "spatial_dims": int(opts["spatial_dims"]), "n_input_channels": int(opts["in_channels"]),
        "num_classes": int(opts["num_classes"]), "conv1_t_size": int(opts["conv1_kernel"]),
        "conv1_t_stride": int(opts["conv1_stride"]), "no_max_pool": bool(opts["no_max_pool"]),
        "shortcut_type": "B", "widen_factor": 1.0, "feed_forward": True, "bias_downsample": True,
        "act": ["relu", {"inplace": True}], "norm": "batch",
    }


def monai_state(config: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A medfl model's state dict in the key names of the network ``config`` builds: for
    MONAI's ResNet, medfl's classifier ``head.`` becomes ``fc.``; otherwise unchanged."""
    if config.get("_target_") != "monai.networks.nets.ResNet":
        return dict(state)
    return {("fc." + k[len("head."):] if k.startswith("head.") else k): v for k, v in state.items()}


def registered_model(name: str, **kwargs: Any) -> nn.Module:
    """The registered medfl model ``name`` built with ``kwargs`` (the plugin registry, not the
    engine): the ``_target_`` of the medfl route's network configs."""
    from medfl.models.registry import build_model

    return build_model({"name": name, **kwargs})


def instantiate(config: Mapping[str, Any]) -> nn.Module:
    """The network of a ``{"_target_": ...}`` config, built by MONAI's :class:`ConfigParser`."""
    from monai.bundle import ConfigParser

    return ConfigParser({"network": dict(config)}).get_parsed_content("network")


def complete_spec(model: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A bundle's model spec with ``spatial_dims``, ``in_channels`` and ``num_classes`` from
    its metadata's ``network_data_format`` (``inputs.image``: ``num_channels`` and the length
    of ``spatial_shape``; ``outputs.pred``: ``num_channels``) where the spec has none.

    Raises:
        ValueError: a value is neither in the spec nor in the metadata, or the two differ
            (the message names the metadata field).
    """
    spec = dict(model)
    fmt = (meta or {}).get("network_data_format") or {}
    image = (fmt.get("inputs") or {}).get("image") or {}
    pred = (fmt.get("outputs") or {}).get("pred") or {}
    found = {"spatial_dims": (len(image["spatial_shape"]) if isinstance(image.get("spatial_shape"), list)
                              else None, "network_data_format.inputs.image.spatial_shape"),
             "in_channels": (image.get("num_channels"), "network_data_format.inputs.image.num_channels"),
             "num_classes": (pred.get("num_channels"), "network_data_format.outputs.pred.num_channels")}
    for key, (value, field) in found.items():
        if value is None:
            if key not in spec:
                raise ValueError(f"model {spec.get('name')!r}: no {key}; metadata.json's {field} gives it")
        elif key in spec and spec[key] != value:
            raise ValueError(f"model {spec.get('name')!r}: {key} is {spec[key]!r} but metadata.json's {field} "
                             f"says {value!r}")
        else:
            spec.setdefault(key, int(value))
    return spec


def network_def(model: Mapping[str, Any], meta: Mapping[str, Any] | None = None, **shape: int) -> nn.Module:
    """A bundle's ``network_def``: the network of its ``fl`` section's model spec, completed
    with ``shape`` (``spatial_dims``, ``in_channels``, ``num_classes``) and from the metadata
    ``meta`` (:func:`complete_spec`, which refuses the two when they differ), built from
    :func:`network_config` (randomly initialised, as MONAI's ``network_def`` is before a
    checkpoint is loaded).

    Use in a training bundle's config, self-contained (MONAI FL's ``MonaiAlgo`` and NVFlare
    parse it without the metadata): ``"network_def": "$medfl.export.network_def(@fl#model,
    spatial_dims=2, in_channels=1, num_classes=3)"``; or ``network_def(@model, @_meta_)``.

    Raises:
        ValueError: a key of ``shape`` is not one of the three above, or a value is missing
            or disagrees with ``meta``.
    """
    unknown = sorted(set(shape) - set(_FILLED))
    if unknown:
        raise ValueError(f"network_def: unknown argument(s) {', '.join(unknown)}; expected {', '.join(_FILLED)}")
    return instantiate(network_config(complete_spec({**model, **shape}, meta)))


# --------------------------------------------------------------------------------------------
# inference workflow pieces
# --------------------------------------------------------------------------------------------


class SourceDataset(Dataset):
    """A medfl dataset spec's samples as a torch dataset of ``{"image", "label", "sample_id"}``
    dicts, with the dataset's evaluation-time preprocessing (its ``make_dataset(rows,
    train=False)``: the transforms training saw, without augmentation).

    Nothing is read until the first use (``len``, an item, :attr:`class_names`), so a bundle
    config holding one parses, and MONAI's ``check_properties`` passes, without the data.

    Args:
        spec: a dataset spec ``{"name": ..., ...}`` (a registered dataset).
        split: keep rows whose ``split`` column equals this; ``"all"`` (default): every row.
    """

    def __init__(self, spec: Mapping[str, Any], split: str | None = "all") -> None:
        self.spec = dict(spec)
        self.split = split
        self._built: tuple[Any, Any, Dataset] | None = None

    def _build(self) -> tuple[Any, Any, Dataset]:
        if self._built is None:
            from medfl.plugins import lookup
            from medfl.predict import split_rows

            rest = dict(self.spec)
            source = lookup("dataset", rest.pop("name"))(**rest)
            rows = split_rows(source.table, self.split)
            self._built = (source, rows, source.make_dataset(rows, False))
        return self._built

    @property
    def class_names(self) -> list[str]:
        """The dataset's class names (``str(k)`` for an unnamed class ``k``)."""
        return [n or str(k) for k, n in enumerate(self._build()[0].class_names)]

    def __len__(self) -> int:
        return len(self._build()[2])

    def __getitem__(self, i: int) -> dict[str, Any]:
        _, rows, ds = self._build()
        x, y = ds[i]
        sid = str(rows["sample_id"].iloc[i]) if "sample_id" in rows.columns else str(i)
        return {"image": x, "label": int(y), "sample_id": sid}


class RunPredictor:
    """The evaluator of a training bundle's ``inference.json``: each client's model of the
    finished run in ``run_dir`` predicts on ``dataset`` (:func:`medfl.predict.predict`: the
    model the run evaluated that client with, personal layers included).

    Args:
        run_dir: a method run directory.
        dataset: a :class:`SourceDataset` (its spec and split are used).
        output_file: the CSV to write.
        clients: client ids (default every client of the run).
    """

    def __init__(self, run_dir: str | Path, dataset: SourceDataset, output_file: str | Path,
                 clients: list[str] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.dataset = dataset
        self.output_file = Path(output_file)
        self.clients = clients

    def run(self) -> Path:
        """Predict and write the CSV (one row per client and sample); returns its path."""
        from medfl.predict import predict

        return predict(self.run_dir, self.dataset.spec, self.output_file, self.clients, self.dataset.split)


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------


def same_state(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Whether two state dicts hold the same keys and equal tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def _outputs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(x).float()


def _rebuild(spec: dict[str, Any], model: nn.Module, probe: torch.Tensor
             ) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | str:
    """``(network config, state in its key names)`` of ``model`` if the network the config
    builds gives ``model``'s outputs on ``probe`` (within 1e-5); else why not."""
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    try:
        config = network_config(spec)
        net = instantiate(config)
        net.load_state_dict(monai_state(config, state), strict=True)
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        return (f"its model is a {type(model).__name__} that the model spec {spec.get('name')!r} does not "
                f"rebuild ({str(exc).splitlines()[0]})")
    want, got = _outputs(model.cpu(), probe), _outputs(net, probe)
    if not torch.allclose(want, got, atol=_ATOL):
        return (f"the network rebuilt from the model spec gives other outputs than the run's {type(model).__name__} "
                f"(largest difference {float((want - got).abs().max()):.3g}): the method evaluates with more than "
                "the registered model")
    return config, monai_state(config, state)


def _torchscript(net: nn.Module, path: Path, probe: torch.Tensor, extra: dict[str, str]) -> dict[str, Any]:
    """Write ``net`` as TorchScript the way ``monai.bundle ckpt_export`` does
    (:func:`monai.networks.utils.convert_to_torchscript`, scripting, verified against the
    eager network); where scripting fails, tracing on ``probe``. Returns how (for the
    metadata)."""
    from monai.networks.utils import convert_to_torchscript

    net = net.eval()
    try:
        convert_to_torchscript(net, filename_or_obj=str(path), extra_files=extra, verify=True, inputs=[probe],
                               use_trace=False, rtol=1e-4, atol=_ATOL)
        return {"file": "models/model.ts", "method": "torch.jit.script"}
    except Exception as exc:   # noqa: BLE001 - torch.jit raises many kinds; the reason is recorded
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    try:
        convert_to_torchscript(net, filename_or_obj=str(path), extra_files=extra, verify=True, inputs=[probe],
                               use_trace=True, rtol=1e-4, atol=_ATOL)
        return {"file": "models/model.ts", "method": "torch.jit.trace", "script_failed": reason,
                "note": "traced on a batch of the input shape: control flow is fixed to that input"}
    except Exception as exc:   # noqa: BLE001
        path.unlink(missing_ok=True)
        return {"file": None, "script_failed": reason, "trace_failed": f"{type(exc).__name__}: {exc}"}


def _metadata(run: Any, role: str, config: dict[str, Any], source: Any, probs: bool,
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


def _inference_config(network: dict[str, Any] | str, data: dict[str, Any], class_names: list[str],
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


_LOGGING_CONF = """\
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


def _license_text(license_file: str | Path | None) -> tuple[str, str]:
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

    try:
        final = json.loads((run_dir / "summary.json").read_text(encoding="utf-8")).get("final") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    out: dict[str, str] = {}
    for split, metrics in final.items():
        if not isinstance(metrics, dict):
            continue
        means = [(m, v.get("mean")) for m, v in metrics.items() if isinstance(v, dict)]
        shown = [f"{m} {v:.4g}" for m, v in means if isinstance(v, (int, float)) and math.isfinite(v)]
        if shown:
            out[split] = ", ".join(shown)
    return out


def _readme(run: Any, role: str, meta: dict[str, Any], data: dict[str, Any], last: int, licence: str) -> str:
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


def _write_bundle(folder: Path, run: Any, role: str, config: dict[str, Any], state: dict[str, torch.Tensor],
                  source: Any, probe: torch.Tensor, probs: bool, data: dict[str, Any], last: int,
                  licence: tuple[str, str]) -> dict[str, Any] | str:
    """One exported bundle in ``folder``; returns its entry of ``export.json``, or why it is
    not exported (a medfl model that is no TorchScript)."""
    names = [n or str(k) for k, n in enumerate(source.class_names)]
    meta = _metadata(run, role, config, source, probs, data["packages"])
    monai_route = meta["medfl_export"]["route"] == "monai"
    network = config if monai_route else "$torch.jit.load(@bundle_root + '/models/model.ts', map_location=@device)"
    inference = _inference_config(network, data["config"], names, int(run.config["train"].get("eval_batch_size", 64)),
                                  probs)
    net = instantiate(config)
    net.load_state_dict(state, strict=True)
    (folder / "models").mkdir(parents=True)
    ts = _torchscript(net, folder / "models" / "model.ts", probe,
                      {"metadata.json": json.dumps(meta), "inference.json": json.dumps(inference)})
    if not monai_route and ts.get("file") is None:
        shutil.rmtree(folder)
        return (f"its model {meta['medfl_export']['model_spec'].get('name')!r} is not a MONAI network and neither "
                f"scripts nor traces to TorchScript ({ts['script_failed']}; {ts['trace_failed']}), so no bundle "
                "could run it without medfl")
    meta["medfl_export"]["torchscript"] = ts
    torch.save(state, folder / "models" / "model.pt")
    (folder / "configs").mkdir()
    (folder / "docs").mkdir()
    (folder / "configs" / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    (folder / "configs" / "inference.json").write_text(json.dumps(inference, indent=2) + "\n")
    (folder / "configs" / "logging.conf").write_text(_LOGGING_CONF)
    (folder / "LICENSE").write_text(licence[0], encoding="utf-8")
    (folder / "docs" / "README.md").write_text(_readme(run, role, meta, data, last, licence[1]), encoding="utf-8")
    return {"folder": folder.name, "model": role, "route": meta["medfl_export"]["route"],
            "network": config["_target_"] if monai_route else "torch.jit.load(models/model.ts)",
            "torchscript": ts.get("method")}

def _check_out(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        what = "a file" if not out_dir.is_dir() else "not empty"
        raise ExportError(f"{out_dir}: {what}; export writes into a new or empty folder and overwrites nothing "
                          "(choose another --out)")


def _finished(run_dir: Path) -> None:
    status_file = run_dir / "status.json"
    from medfl.runs import missing_folder

    if missing_folder(run_dir):
        raise ExportError(missing_folder(run_dir))
    if not (run_dir / "config.json").is_file():
        raise ExportError(f"{run_dir}: no config.json; not a medfl run directory")
    if not status_file.is_file():
        if json.loads((run_dir / "config.json").read_text()).get("method") is None:
            return   # an experiment directory: open_run says so, naming its runs
        raise ExportError(f"{run_dir}: no status.json; the run never started a round (nothing to export)")
    status = json.loads(status_file.read_text())
    if status.get("status") != "finished":
        raise ExportError(f"{run_dir}: the run is {status.get('status')!r} at round {status.get('last_round')} of "
                          f"{status.get('rounds')}, not finished; resume it first ({resume_command(run_dir)})")


def export_run(run_dir: str | Path, out_dir: str | Path, license_file: str | Path | None = None) -> dict[str, Any]:
    """Write a finished run's models as MONAI bundles.

    Layout of ``out_dir`` (created; it must be absent or empty):

    * ``global/``: the final global model, where the method has a complete one (the
      coordinator's ``global_state`` loads into the run's model: FedAvg and its kin;
      not FedBN, whose norm layers stay at the clients, nor Local);
    * ``final_<name>/``: the method's extra final models (:meth:`Method.final_models`,
      e.g. PFedCDP's student);
    * ``client_<id>/``: each client's evaluation model where it differs from the global
      one (personal layers or a model of its own: FedBN, Local, FedKPer...);
    * ``export.json``: what was written, and every model left out with the reason.

    Each bundle runs with MONAI and torch alone (no medfl): ``models/model.pt`` (a plain
    state dict in the key names of its ``network_def``), ``models/model.ts`` (TorchScript as
    ``monai.bundle ckpt_export`` writes it; scripted, else traced, as ``metadata.json``'s
    ``medfl_export.torchscript`` says), ``configs/inference.json`` (``network_def`` a MONAI
    network, or ``torch.jit.load`` of ``model.ts`` for a model MONAI has not; the dataset's
    preprocessing in MONAI transforms, :func:`inference_data`), ``configs/metadata.json``,
    ``configs/logging.conf``, ``LICENSE`` and ``docs/README.md``. With early stopping the
    models are those of the best round, as ``medfl predict`` uses.

    Args:
        run_dir: a finished method run directory.
        out_dir: where to write.
        license_file: the licence text to write as each bundle's ``LICENSE`` (the run owner's
            choice); default medfl's own (Apache-2.0).

    Returns:
        The content of ``export.json``.

    Raises:
        ExportError: ``out_dir`` is not empty, ``run_dir`` is no finished run, its dataset's
            preprocessing has no MONAI-only form (:func:`inference_data`), ``license_file`` is
            missing, or no model of the run can be exported.
        RunError: an experiment directory (the message lists its runs), no checkpoint.
    """
    from medfl.models.registry import build_model
    from medfl.predict import eval_models, open_run

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    _check_out(out_dir)
    _finished(run_dir)
    run, last = open_run(run_dir, "export")
    source = run.data.source
    data = inference_data(run.config["dataset"], source)
    licence = _license_text(license_file)
    gen = torch.Generator().manual_seed(0)
    probe = torch.rand((2, *[int(s) for s in source.sample_shape]), generator=gen)
    # (folder, role, network config, state): rebuilt at once, since a method may hand every
    # client the same module object (a cached model) with that client's weights loaded
    wanted: list[tuple[str, str, dict[str, Any], dict[str, torch.Tensor]]] = []
    skipped: list[dict[str, str]] = []

    def add(folder: str, role: str, spec: dict[str, Any], model: nn.Module) -> None:
        rebuilt = _rebuild(spec, model, probe)
        if isinstance(rebuilt, str):
            skipped.append({"model": role, "reason": rebuilt})
        else:
            wanted.append((folder, role, *rebuilt))

    coordinator = run.coordinator
    global_spec = run.federation.model_spec()
    global_state = getattr(coordinator, "global_state", None)
    global_model: nn.Module | None = None
    if isinstance(global_state, dict) and global_state:
        candidate = build_model(global_spec)
        try:
            candidate.load_state_dict(global_state, strict=True)
            global_model = candidate
            add("global", "global", global_spec, candidate)
        except RuntimeError:
            skipped.append({"model": "global", "reason": "the coordinator's global state is not a complete model "
                            "(the method keeps some layers at the clients); see the client models"})
    else:
        skipped.append({"model": "global", "reason": f"method {run.label!r} keeps no global model"})
    for name, (spec, state) in coordinator.final_models().items():
        model = build_model(spec)
        model.load_state_dict(state, strict=True)
        add(f"final_{name}", f"final model {name!r}", dict(spec), model)
    global_sd = {k: v.clone() for k, v in global_model.state_dict().items()} if global_model is not None else None
    for cid, ctx, model in eval_models(run, last):
        if global_sd is not None and same_state(model.state_dict(), global_sd):
            continue   # the client evaluates the global model itself: nothing personal
        add(f"client_{cid}", f"client {cid}", dict(ctx.model_spec), model)
    written: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix=".medfl-export-", dir=out_dir.parent if out_dir.parent.is_dir() else None))
    try:
        for folder, role, config, state in wanted:
            probs = bool(getattr(instantiate(config), "returns_probabilities", False))
            entry = _write_bundle(work / folder, run, role, config, state, source, probe, probs, data, last, licence)
            if isinstance(entry, str):
                skipped.append({"model": role, "reason": entry})
            else:
                written.append(entry)
        if not written:
            raise ExportError(f"{run_dir}: no model of the run can be exported: "
                              + "; ".join(f"{s['model']}: {s['reason']}" for s in skipped))
        summary = {"run_dir": str(run_dir.resolve()), "method": run.label, "round": last,
                   "bundles": written, "not_exported": skipped}
        (work / "export.json").write_text(json.dumps(summary, indent=2) + "\n")
        _check_out(out_dir)   # still empty: nothing of the user's is replaced
        if out_dir.exists():
            out_dir.rmdir()
        shutil.move(str(work), str(out_dir))
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return summary
