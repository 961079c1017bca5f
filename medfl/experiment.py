"""The experiment level: every method of a config x its folds x its seeds, and their resume.

:func:`run_experiment` runs every method of a resolved ``fl`` config on the same split of
the same data and writes a comparison (per fold with ``cv``, per seed with ``seeds``);
:func:`resume` continues a stopped run, experiment, fold or seed directory. Each method's
run is a :class:`medfl.engine.runner.Run` (or a backend's subclass of it) in its own
directory; where its clients are is the backend's business (:mod:`medfl.backend`):
``fl.backend`` names it, and the experiment runs inside its :meth:`~medfl.backend.Backend.runs`.
"""

from __future__ import annotations

import json
import logging
from contextlib import nullcontext, suppress
from pathlib import Path
from typing import Any, Callable

from medfl.arm_report import run_json
from medfl.backend import Backend, backend_of, recorded_backend
from medfl.config import method_label, set_threads
from medfl.engine.checkpoints import REFUSALS
from medfl.engine.data import FederatedData, split_data, warn_straddling
from medfl.engine.runner import Run, RunError, RunFactory, build_source
from medfl.integrity import write_json
from medfl.logs import file_log
from medfl.plugins import get_plugin_manager, pinned_names
from medfl.reopen import client_models, one_model, reopen, saved_config

__all__ = ["run_experiment", "resume", "check_split_sizes"]

logger = logging.getLogger(__name__)


def _create_unique_dir(base: Path, overwrite: bool) -> Path:
    """Create the experiment directory: ``base``, or the first free ``base-2``, ``base-3``...
    Each name is taken by an atomic ``mkdir``, so runs started at the same moment never share
    one; ``overwrite`` reuses ``base``."""
    base.parent.mkdir(parents=True, exist_ok=True)
    if overwrite:
        base.mkdir(exist_ok=True)
        return base
    i = 1
    while True:
        cand = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            cand.mkdir()
            return cand
        except FileExistsError:
            i += 1


def _run_methods(cfg: dict[str, Any], exp_dir: Path, data: FederatedData | None, resume_runs: bool,
                 rounds: int | None = None, run_factory: RunFactory = Run) -> dict[str, Any]:
    """Run (or, with ``resume_runs``, continue) every method of ``cfg`` in ``exp_dir/<label>``.

    A method whose directory already holds a run is resumed; one that never started runs
    from round 1 on ``data`` (the experiment's split, reloaded from ``partition.csv`` when
    ``None``). Writes ``comparison.csv`` once every method has finished."""
    from medfl.plotting import plots_wanted
    from medfl.report import write_comparison

    summaries: dict[str, Any] = {}
    for spec in cfg["methods"]:
        label = method_label(spec)
        if resume_runs and (exp_dir / label / "config.json").is_file():
            run_dir = exp_dir / label
            summaries[label] = _resume(run_dir, saved_config(run_dir), rounds, run_factory)["summaries"][label]
            continue
        if data is None:
            data = split_data(build_source(cfg["dataset"]), cfg, saved=exp_dir / "partition.csv")
        run_cfg = cfg if rounds is None else {**cfg, "rounds": int(rounds)}
        run = run_factory(run_cfg, spec, exp_dir / label, data)
        run.prepare(resume=False)
        summaries[label] = run.execute(None if resume_runs else cfg.get("stop_after_round"))
    if summaries and all(summaries.values()):
        write_comparison(exp_dir, summaries, plots=plots_wanted(cfg))
    return summaries


def _folds(cfg: dict[str, Any]) -> int:
    """The number of cross-validation folds of ``cfg`` (0 or 1: none)."""
    return int((cfg.get("cv") or {}).get("folds") or 0)


def _repeats(cfg: dict[str, Any]) -> list[tuple[str, dict[str, Any], int | None, dict[str, Any]]]:
    """The parts ``(folder, its fl config, its fold, its config.json entries)`` of a
    cross-validated experiment (``fold_<k>``) or of one repeated over seeds (``seed_<s>``: the
    seed draws the split, the models' initialisation and the training order alike)."""
    if _folds(cfg) > 1:
        return [(f"fold_{k}", cfg, k, {"fold": k}) for k in range(_folds(cfg))]
    return [(f"seed_{int(s)}", {**cfg, "seed": int(s), "seeds": None}, None, {}) for s in cfg["seeds"]]


def _repeated(cfg: dict[str, Any], exp_dir: Path, resume_runs: bool, rounds: int | None = None,
              run_factory: RunFactory = Run, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every fold (``cv``) or seed (``seeds``) of ``cfg`` as its own experiment in
    ``exp_dir/<folder>`` (:func:`_repeats`), then the report over them: the CV report
    (:func:`medfl.report_repeats.write_cv_report`) or mean ± std over seeds
    (:func:`medfl.report_repeats.write_seeds_report`).

    Returns ``{"dir", "summaries": {"fold_<k>" | "seed_<s>": {label: summary}}}`` with, over
    folds, ``"cv"`` (the CV summary, ``None`` while a fold is unfinished) and ``"folds"``; over
    seeds, ``"seeds"`` (the report, ``None`` while a seed is unfinished) and ``"seed_list"``."""
    from medfl.plotting import plots_wanted
    from medfl.report_repeats import write_cv_report, write_seeds_report

    out = _parts(cfg, exp_dir, _repeats(cfg), resume_runs, rounds, run_factory, meta)
    done = all(s and all(s.values()) for s in out.values())
    folds = _folds(cfg)
    if folds > 1:
        labels, metric = [method_label(m) for m in cfg["methods"]], str(cfg["cv"].get("metric", "auc"))
        cv = write_cv_report(exp_dir, labels, folds, metric, plots=plots_wanted(cfg)) if done else None
        return {"dir": str(exp_dir), "summaries": out, "cv": cv, "folds": folds}
    seeds = [int(s) for s in cfg["seeds"]]
    by_seed = {s: out[f"seed_{s}"] for s in seeds}
    report = write_seeds_report(exp_dir, by_seed, plots=plots_wanted(cfg)) if done else None
    return {"dir": str(exp_dir), "summaries": out, "seeds": report, "seed_list": seeds}


def _parts(cfg: dict[str, Any], exp_dir: Path, parts: list[tuple[str, dict[str, Any], int | None, dict[str, Any]]],
           resume_runs: bool, rounds: int | None, run_factory: RunFactory, meta: dict[str, Any] | None
           ) -> dict[str, Any]:
    """Each part ``(folder, its fl config, its fold, its config.json entries)`` of a CV or
    multi-seed experiment in ``exp_dir/<folder>``: its split drawn and saved (config.json first,
    partition.csv last: it marks a complete part) unless resumed, then its methods."""
    source = None
    out: dict[str, Any] = {}
    for name, part_cfg, fold, entries in parts:
        part_dir = exp_dir / name
        data = None
        if not resume_runs or not (part_dir / "partition.csv").is_file() or not (part_dir / "config.json").is_file():
            source = source or build_source(cfg["dataset"])
            data = split_data(source, part_cfg, fold=fold)
            part_dir.mkdir(parents=True, exist_ok=True)
            write_json(part_dir / "config.json", {"fl": part_cfg, **entries, **(meta or {})})
            data.save(part_dir / "partition.csv")
            warn_straddling(data.report, name)
        out[name] = _run_methods(part_cfg, part_dir, data, resume_runs, rounds, run_factory)
    return out


def run_experiment(cfg: dict[str, Any], run_factory: RunFactory | None = None,
                   meta: dict[str, Any] | None = None, backend: Backend | None = None) -> dict[str, Any]:
    """Run every method of a resolved config on one data split; return their summaries.

    The experiment directory is ``output_dir/name`` (``name-2``, ``name-3``... when it
    exists, unless ``overwrite``); each method runs in a subdirectory named by its label,
    and ``comparison.csv`` lists their final mean metrics side by side.

    With cross-validation (``cv.folds`` > 1) each fold is such an experiment in
    ``fold_<k>/`` and the experiment directory gets ``cv_results.csv``, ``cv_table.csv``,
    ``cv_table.md``, ``cv_summary.json`` and ``cv_<metric>.png``
    (:func:`medfl.report_repeats.write_cv_report`); the result's ``summaries`` are then keyed by
    fold (``fold_<k>``) and it also holds ``cv`` (the CV summary) and ``folds``.

    With ``seeds`` (a list) the whole experiment runs once per seed in ``seed_<s>/`` and
    the experiment directory gets ``seeds_results.csv``, ``seeds_summary.json``,
    ``seeds_table.csv``, ``seeds_table.md`` and ``seeds_metrics.png`` (mean ± std over
    seeds; :func:`medfl.report_repeats.write_seeds_report`); ``summaries`` are keyed by seed
    (``seed_<s>``) and the result also holds ``seeds`` (that summary) and ``seed_list``.

    Args:
        cfg: the resolved ``fl`` config.
        run_factory: builds each method's run, used as it is (a backend's own ``Run``
            subclass); ``None`` (or :class:`Run`): the backend chooses it.
        meta: extra entries of the experiment's and folds' ``config.json``
            (e.g. ``{"engine": "flower"}``).
        backend: the backend to run on (default: the one ``fl.backend`` names,
            :func:`medfl.backend.backend_of`); the experiment runs inside its
            :meth:`~medfl.backend.Backend.runs`, with its ``run_factory`` and ``meta``.
    """
    # fl.threads or --threads, before it trains; "auto" is the entry point's (medfl run, a bundle run)
    set_threads(cfg.get("threads"), apply_auto=False)
    with pinned_names(cfg.get("plugin_names")):   # the qualified names resolve_config recorded
        if run_factory is None or run_factory is Run:
            chosen = backend or backend_of(cfg)
            # config.json records the backend: a stopped run continues there (medfl.backend.resume_command)
            with chosen.runs(cfg) as (factory, extra):
                return _experiment(cfg, factory, {"backend": chosen.name, **((meta if extra is None else extra) or {})})
        return _experiment(cfg, run_factory, meta)


def _experiment(cfg: dict[str, Any], run_factory: RunFactory, meta: dict[str, Any] | None) -> dict[str, Any]:
    """:func:`run_experiment` on ``run_factory``'s runs: the split, the experiment directory,
    then every method (per fold, per seed), tracked by ``fl.tracking``'s trackers."""
    plain = not (_folds(cfg) > 1 or cfg.get("seeds"))
    # the split first: a dataset or partition that cannot work stops before anything is written
    data = split_data(build_source(cfg["dataset"]), cfg) if plain else None
    check_split_sizes(cfg, data)   # every fold's and seed's split too: one line, and no directory
    base = Path(cfg["output_dir"]) / str(cfg["name"])
    made = [d for d in (base, base.parent) if not d.is_dir()]   # what a refusal removes again
    exp_dir = _create_unique_dir(base, bool(cfg.get("overwrite")))
    try:
        with file_log(exp_dir, f"experiment {exp_dir.name}"):
            return _experiment_in(cfg, exp_dir, data, run_factory, meta)
    except REFUSALS:   # a method refused its settings in setup, or a model its options (its run is gone)
        if exp_dir != base or base in made:
            _discard_unstarted(exp_dir, base.parent if base.parent in made else None)
        raise


def _discard_unstarted(exp_dir: Path, output_dir: Path | None = None) -> None:
    """Remove the experiment directory ``exp_dir`` this experiment created when no run of it
    started: a method refused its settings in ``setup`` (:class:`~medfl.method.MethodConfigError`),
    or a model its options (:data:`medfl.engine.checkpoints.REFUSALS`; its own run directory is
    gone already, :meth:`medfl.engine.runner.Run.prepare`), so the
    refusal leaves nothing behind. An experiment where another method's run (or another fold's,
    or seed's) already started keeps its directory and those runs (``medfl runs`` lists them).
    ``output_dir``: the output folder, when the experiment created it too (removed when empty)."""
    import shutil

    from medfl.runs import find_run_dirs

    if find_run_dirs(exp_dir):
        return
    shutil.rmtree(exp_dir, ignore_errors=True)
    if output_dir is not None:
        with suppress(OSError):
            output_dir.rmdir()   # only an empty folder


def check_split_sizes(cfg: dict[str, Any], data: FederatedData | None = None) -> None:
    """Refuse a split that leaves a client fewer training samples than a method of ``cfg``
    needs (:attr:`medfl.method.Method.min_train_samples`), before anything is written.

    Checks the split of a plain experiment (``data``, drawn when ``None``), and with
    cross-validation or ``seeds`` the split of every fold or seed, so a run that cannot
    train stops before its first fold rather than in a later one.

    Args:
        cfg: the resolved ``fl`` config (method names resolvable: inside ``pinned_names``).
        data: the plain experiment's split, when already drawn.

    Raises:
        DataError: one line naming the fold or seed, the client, its training samples, the
            method and what to change (more cases, fewer folds or clients, a larger
            ``min_size``).
    """
    from medfl.data.source import DataError
    from medfl.plugins import lookup

    needs = {method_label(spec): int(getattr(lookup("method", spec["name"]), "min_train_samples", 1))
             for spec in cfg["methods"]}
    label, need = max(needs.items(), key=lambda kv: kv[1], default=("", 1))
    if need <= 1:
        return
    folds = _folds(cfg)
    if data is not None:
        splits: list[tuple[str, FederatedData]] = [("", data)]
    elif folds > 1 or cfg.get("seeds"):
        source = build_source(cfg["dataset"])
        splits = [(f"{name}: ", split_data(source, part, fold=fold)) for name, part, fold, _ in _repeats(cfg)]
    else:
        splits = [("", split_data(build_source(cfg["dataset"]), cfg))]
    for where, split in splits:
        a = split.assignments
        a = a[a["client_id"] != ""]
        counts = a[a["role"] == "train"].groupby("client_id").size().reindex(a["client_id"].unique(), fill_value=0)
        for cid, n in counts.items():
            if n < need:
                name = a.loc[a["client_id"] == cid, "client_name"].iloc[0]
                change = ["more cases (a larger dataset)"] + (["fewer folds (fl.cv.folds)"] if folds > 1 else []) + \
                         ["fewer clients (fl.num_clients)", "a larger fl.partition.min_size where the partitioner has one"]
                raise DataError(f"{where}client {cid} ({name}) has {n} training sample(s) but {label} needs at least "
                                f"{need} (it trains on batches of {need} or more); this split is too small to train: "
                                f"use {', '.join(change[:-1])} or {change[-1]}")


def _experiment_in(cfg: dict[str, Any], exp_dir: Path, data: FederatedData | None, run_factory: RunFactory,
                   meta: dict[str, Any] | None) -> dict[str, Any]:
    """:func:`_experiment` once its directory ``exp_dir`` exists (its ``log.txt`` open): every
    method (per fold, per seed), tracked; ``data`` is the split of a plain experiment (``None``
    with folds or seeds)."""
    write_json(exp_dir / "config.json", {"fl": cfg, **(meta or {})})

    def methods(factory: RunFactory) -> dict[str, Any]:
        if _folds(cfg) > 1 or cfg.get("seeds"):
            return _repeated(cfg, exp_dir, resume_runs=False, run_factory=factory, meta=meta)
        assert data is not None
        data.save(exp_dir / "partition.csv")
        warn_straddling(data.report)
        return {"dir": str(exp_dir), "summaries": _run_methods(cfg, exp_dir, data, resume_runs=False,
                                                               run_factory=factory)}

    return _tracked(exp_dir, cfg, cfg.get("tracking") or [], run_factory, True, methods)


def resume(path: str | Path, rounds: int | None = None, run_factory: RunFactory | None = None,
           backend: Backend | None = None, tracking: list[str] | None = None) -> dict[str, Any]:
    """Continue a stopped run directory, or every run of an experiment directory.

    Args:
        path: a run directory (has ``config.json`` with a ``method``), an experiment
            directory, or a cross-validated experiment (its folds too: a fold that never
            started runs from the beginning, and the CV report is rewritten at the end).
        rounds: a new total number of rounds (default: the configured one). A run that
            early stopping ended (``fl.early_stopping``) is finished whatever ``rounds``
            says: it is not extended (early stopping decided it; the run says so on stderr),
            so an experiment resumed with more rounds extends its other methods' runs.
        run_factory: builds each run, used as it is; ``None`` (or :class:`Run`): the backend
            that ran it chooses (see :func:`run_experiment`).
        backend: the backend to continue on (default: the one that ran it, as its
            experiment's ``config.json`` records it: :func:`medfl.backend.recorded_backend`;
            one whose clients ran elsewhere, such as ``flower``, refuses and names the command
            that resumes there).
        tracking: tracker names to track with besides those the experiment tracked with
            (its ``fl.tracking`` and ``tracking.json``); the runs they started continue.

    A run's ``config.json`` records the qualified name (``dist:name``) each plugin name
    resolved to (``fl.plugin_names``); the resumed run uses those plugins even when another
    plugin registering the same bare name has been installed since. A run directory written
    before medfl recorded them resolves its bare names as they resolve now.

    Raises:
        RunError: ``path`` holds no run to resume.
    """
    path = Path(path)
    saved = saved_config(path)
    top = _top_of(path)
    top_cfg = saved_config(top)["fl"]
    from medfl.config import check_tracking

    # the saved trackers as they were (one whose plugin is gone is left out with a warning, the
    # run still resumes); the ones asked for now are checked
    saved_specs = [dict(e) for e in top_cfg.get("tracking") or [] if isinstance(e, dict) and "name" in e]
    specs = saved_specs + check_tracking([n for n in dict.fromkeys(tracking or [])
                                          if not any(e["name"] == n for e in saved_specs)])

    def resume_with(factory: RunFactory) -> dict[str, Any]:
        return _tracked(top, top_cfg, specs, factory, path == top, lambda f: _resume(path, saved_config(path), rounds, f))

    chosen = None
    if run_factory is None or run_factory is Run:   # a run continues on the backend that ran it (config.json)
        chosen = backend or backend_of({"backend": recorded_backend(path)[0]})
        chosen.check_resume(path)   # before anything is written: e.g. Flower's clients are at the sites
    # --threads (MEDFL_THREADS) wins over the saved fl.threads; "auto" is medfl resume's
    set_threads(saved["fl"].get("threads"), apply_auto=False)
    # the plugins the run started with (a run written before medfl recorded them: bare names, resolved now);
    # an experiment's (or fold's) own log; a method run's directory gets its log with its lock
    with pinned_names(saved.get("fl", {}).get("plugin_names")), \
            (file_log(path, f"resume of {path.name}") if "method" not in saved else nullcontext()):
        if chosen is None:
            return resume_with(run_factory)
        with chosen.runs(saved["fl"], path) as (factory, _):
            return resume_with(factory)


def _top_of(path: Path) -> Path:
    """The experiment directory ``path`` (a run, fold, seed or experiment directory) belongs to."""
    top = path
    while (top.parent / "config.json").is_file():
        top = top.parent
    return top


def _complete(summaries: dict[str, Any]) -> bool:
    """Whether every run of a result's ``summaries`` (by label, or by fold or seed) finished."""
    return bool(summaries) and all(bool(v) and ("method" in v or _complete(v)) for v in summaries.values())


def _tracked(root: Path, cfg: dict[str, Any], specs: list[dict[str, Any]], run_factory: RunFactory, whole: bool,
             work: Callable[[RunFactory], dict[str, Any]]) -> dict[str, Any]:
    """``work(run_factory)`` with the experiment ``root`` tracked by ``specs``' trackers
    (:class:`medfl.tracking_feed.Tracking`; none: ``work`` as it is, and nothing imports a tracker's
    package): every run ``run_factory`` builds is watched, and the experiment's own run ends
    "finished" when ``whole`` (the whole experiment was run or resumed) and every run finished,
    else "stopped"; "failed" or "interrupted" when ``work`` raises."""
    if not specs:
        return work(run_factory)
    from medfl.tracking_feed import Tracking

    tracking = Tracking(root, specs, str(cfg.get("name", root.name)), cfg, final_models=_final_models)
    tracking.start()
    try:
        result = work(lambda c, spec, d, data: tracking.watch(run_factory(c, spec, d, data)))
    except (KeyboardInterrupt, SystemExit):
        tracking.finish("interrupted")
        raise
    except BaseException:
        tracking.finish("failed")
        raise
    tracking.finish("finished" if whole and _complete(result.get("summaries") or {}) else "stopped")
    return result


def _final_models(run: Run) -> dict[str, Any]:
    """The models a finished run's clients evaluate with (``Method.client_eval_model``, as
    :func:`medfl.predict.predict` uses them): ``{"model": module}`` when every client's is the
    same (a global model), else ``{"model_<client>": module}`` per client (personalised)."""
    import torch

    if type(run).update_clients is not Run.update_clients:
        # over Flower (and on Ray) the clients' states stay at the sites: a model rebuilt here
        # would lack their personalised parts, so none is logged rather than a wrong one
        raise RunError(f"the clients ran {getattr(run, 'where', type(run).__name__)}, not in this process; "
                       "their models stay where they ran")
    last = run.rounds_run
    if run.early is not None and run.early.best_round is not None:
        last = int(run.early.best_round)
    models = client_models(run, last)
    example = torch.zeros(1, *map(int, run.data.source.sample_shape))
    if one_model(models) and models:
        return {"model": (next(iter(models.values())), example)}
    return {f"model_{cid}": (m, example) for cid, m in models.items()}


def _resume(path: Path, saved: dict[str, Any], rounds: int | None, run_factory: RunFactory) -> dict[str, Any]:
    """:func:`resume` on ``run_factory``'s runs (``saved``: ``path``'s ``config.json``)."""
    if "method" not in saved:  # experiment (or fold) directory: resume each method
        cfg = saved["fl"]
        if ("fold" not in saved and _folds(cfg) > 1) or cfg.get("seeds"):   # a fold's own methods: below
            return _repeated(cfg, path, resume_runs=True, rounds=rounds, run_factory=run_factory,
                             meta={k: v for k, v in saved.items() if k != "fl"})
        return {"dir": str(path), "summaries": _run_methods(cfg, path, None, resume_runs=True, rounds=rounds,
                                                            run_factory=run_factory)}
    cfg = saved["fl"]
    ignored = None   # --rounds of a run that early stopping ended
    if rounds is not None and int(rounds) != int(cfg["rounds"]) and _stopped_early(path, saved, run_factory):
        ignored, rounds = int(rounds), None
    if rounds is not None:
        cfg["rounds"] = int(rounds)
    run = reopen(path, saved, cfg, run_factory)
    run.prepare(resume=True)
    label = run.label
    if run.stopped_early and run.early is not None:
        logger.info(f"medfl [{label}]: early stopping ended this run after round {run.early.stopped_at} (best round "
                    f"{run.early.best_round}): nothing left to train"
                    + ("" if ignored is None else f"; --rounds {ignored} does not extend it (start a new run, e.g. with "
                                                  "a larger fl.early_stopping.patience, to train longer)"))
    finished = run.start_round > run.federation.rounds or run.stopped_early
    if finished and (path / "summary.json").is_file():
        summary = json.loads((path / "summary.json").read_text())
        # stopped after the summary, before the plots and reports
        if run_json(path, "status.json").get("status") != "finished":
            get_plugin_manager().hook.on_run_end(run=run, summary=summary)
            run._status("finished", run.rounds_run)
        run.files.unlock()
        return {"dir": str(path), "summaries": {label: summary}}
    return {"dir": str(path), "summaries": {label: run.execute(None)}}


def _stopped_early(path: Path, saved: dict[str, Any], run_factory: RunFactory = Run) -> bool:
    """Whether the run in ``path`` (its ``config.json`` ``saved``) was stopped by early
    stopping: its newest intact checkpoint says so (read without changing anything)."""
    if not saved["fl"].get("early_stopping"):
        return False
    run = reopen(path, saved, json.loads(json.dumps(saved["fl"])), run_factory)
    run.prepare(read_only=True)
    return run.stopped_early

