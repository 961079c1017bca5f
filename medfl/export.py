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
transforms only (:func:`medfl.export_files.inference_data`); :func:`export_run` checks every
exported network against the run's own model on a probe batch before it writes anything, so an
exported model predicts what ``medfl predict`` does.
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

from medfl.export_files import (ATOL, LOGGING_CONF, ExportError, inference_config, inference_data, license_text,
                                metadata, readme, torchscript)
from medfl.rundir import resume_command

__all__ = [
    "RunPredictor",
    "SourceDataset",
    "complete_spec",
    "export_run",
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

# ---------------------------------------------------------------------------------- network specs


def _resnet_defaults() -> dict[str, Any]:
    from medfl.models.resnet import FeatureResNet

    return {n: p.default for n, p in inspect.signature(FeatureResNet.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


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
    if not (spec.get("name") in _RESNETS and spec.get("norm", "batch") == "batch"
            and not spec.get("dp_compatible", False)):   # not a plain monai.networks.nets.ResNet
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


# ---------------------------------------------------------------------- inference workflow pieces


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


# ----------------------------------------------------------------------------------------- export


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
    if not torch.allclose(want, got, atol=ATOL):
        return (f"the network rebuilt from the model spec gives other outputs than the run's {type(model).__name__} "
                f"(largest difference {float((want - got).abs().max()):.3g}): the method evaluates with more than "
                "the registered model")
    return config, monai_state(config, state)


def _write_bundle(folder: Path, run: Any, role: str, config: dict[str, Any], state: dict[str, torch.Tensor],
                  source: Any, probe: torch.Tensor, probs: bool, data: dict[str, Any], last: int,
                  licence: tuple[str, str]) -> dict[str, Any] | str:
    """One exported bundle in ``folder``; returns its entry of ``export.json``, or why it is
    not exported (a medfl model that is no TorchScript)."""
    names = [n or str(k) for k, n in enumerate(source.class_names)]
    meta = metadata(run, role, config, source, probs, data["packages"])
    monai_route = meta["medfl_export"]["route"] == "monai"
    network = config if monai_route else "$torch.jit.load(@bundle_root + '/models/model.ts', map_location=@device)"
    inference = inference_config(network, data["config"], names, int(run.config["train"].get("eval_batch_size", 64)),
                                  probs)
    net = instantiate(config)
    net.load_state_dict(state, strict=True)
    (folder / "models").mkdir(parents=True)
    ts = torchscript(net, folder / "models" / "model.ts", probe,
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
    (folder / "configs" / "logging.conf").write_text(LOGGING_CONF)
    (folder / "LICENSE").write_text(licence[0], encoding="utf-8")
    (folder / "docs" / "README.md").write_text(readme(run, role, meta, data, last, licence[1]), encoding="utf-8")
    return {"folder": folder.name, "model": role, "route": meta["medfl_export"]["route"],
            "network": config["_target_"] if monai_route else "torch.jit.load(models/model.ts)",
            "torchscript": ts.get("method")}

def _check_out(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        what = "a file" if not out_dir.is_dir() else "not empty"
        raise ExportError(f"{out_dir}: {what}; export writes into a new or empty folder and overwrites nothing "
                          "(choose another --out)")


def _finished(run_dir: Path) -> None:
    from medfl.reopen import saved_config
    from medfl.runs import missing_folder

    if not missing_folder(run_dir) and not (run_dir / "config.json").is_file():
        raise ExportError(f"{run_dir}: no config.json; not a medfl run directory")
    saved = saved_config(run_dir)   # a missing folder, or a config.json medfl did not write
    if not (run_dir / "status.json").is_file():
        if saved.get("method") is None:
            return   # an experiment directory: open_run says so, naming its runs
        raise ExportError(f"{run_dir}: no status.json; the run never started a round (nothing to export)")
    status = json.loads((run_dir / "status.json").read_text())
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
    preprocessing in MONAI transforms, :func:`medfl.export_files.inference_data`), ``configs/metadata.json``,
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
            preprocessing has no MONAI-only form (:func:`~medfl.export_files.inference_data`), ``license_file`` is
            missing, or no model of the run can be exported.
        RunError: an experiment directory (the message lists its runs), no checkpoint.
    """
    from medfl.reopen import open_run

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    _check_out(out_dir)
    _finished(run_dir)
    run, last = open_run(run_dir, "export")
    source = run.data.source
    data = inference_data(run.config["dataset"], source)
    licence = license_text(license_file)
    gen = torch.Generator().manual_seed(0)
    probe = torch.rand((2, *[int(s) for s in source.sample_shape]), generator=gen)
    wanted, skipped = _wanted(run, last, probe)
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


def _wanted(run: Any, last: int, probe: torch.Tensor
            ) -> tuple[list[tuple[str, str, dict[str, Any], dict[str, torch.Tensor]]], list[dict[str, str]]]:
    """``(wanted, skipped)``: each model of the run to export as ``(folder, role, network
    config, state)``, rebuilt and checked on ``probe`` at once (a method may hand every client
    the same module object, a cached model, with that client's weights loaded); and each model
    left out as ``{"model": role, "reason": why}``. The global model where the coordinator's
    state is a complete one, the method's final models, and each client's evaluation model at
    round ``last`` where it differs from the global one."""
    from medfl.models.registry import build_model
    from medfl.reopen import eval_models, same_state

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
    return wanted, skipped
