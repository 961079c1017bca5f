"""Shared fixtures: a tiny resolved config on the generated synthetic dataset."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from medfl.config import resolve_config

# Drawing a run's PNG plots takes seconds (matplotlib), and hundreds of runs here would spend
# most of the suite's time on them: runs draw none (CSV and JSON results are written all the
# same) except in tests marked ``plots``, which check the figures. Set here, before any
# fixture, so module-scoped runs and the processes tests start (bundles, Flower apps) see it.
os.environ.setdefault("MEDFL_NO_PLOTS", "1")

# The suite runs as a user's clone does, without ``../shared``: fixtures synthesise their
# metadata rows (the processes tests start too), so nothing passes on files users lack. The
# tests of the real metadata files take them from the ``reference_data`` fixture below, and
# skip where they are absent.
from medfl.fixtures import reference_data_dir  # noqa: E402

REFERENCE_DATA = reference_data_dir()
os.environ["MEDFL_REFERENCE_DATA"] = "none"


#: The test modules that take longest (seconds each took in ``make test``'s three workers on the
#: idle 2-core VM, 2026-11-29), slowest first: they run first, so that the workers (``pytest -n 3
#: --dist loadfile --no-loadscope-reorder``, see the Makefile) start on them and the short
#: modules fill in around them instead of one worker finishing a long Flower test alone at the
#: end. A module missing from the list only runs later; the order changes no result.
SLOW_MODULES = (
    "flower/test_flower.py",            # 405: five runs over one real deployment (SecAgg+, a site killed, all paused)
    "flower/test_soak.py",              # 225: a site and the SuperLink killed mid-run, then resumed
    "flower/test_simulation.py",        # 155: beside in-process runs, on Ray (early stopping, Ctrl-C too)
    "test_experiments.py",              # 140: the experiments/ scripts' --smoke runs
    "flower/test_deploy_auth.py",       # 125: TLS, keys, a SuperLink restart and a resume
    "nvflare/test_nvflare.py",          # 125: a job in NVFlare's simulator, every method through its controller
    "flower/test_superlink_lock.py",    # 90: a locked SuperLink database, a run across it
    "test_bundle_readmes.py",           # 90: five bundle READMEs' commands as written (fixture, prep, run)
    "tracking/test_tracking.py",        # 75: a real mlflow server, three bundle runs
    "methods/test_fedskd_bundles.py",   # 70
    "methods/test_ham10000_bundles.py",  # 70
    "test_export.py",                   # 65: the demo trained, exported, run by MONAI's CLI
    "methods/test_fedtpf_bundles.py",   # 60
    "nvflare/test_hostile_job.py",      # 50: three hostile jobs refused in NVFlare's simulator
    "methods/test_pfedcdp_bundle.py",   # 40
    "flower/test_failed_run.py",        # 40: runs that fail to start, real SuperLink and a site
    "prep/test_prep_abide.py",          # 35
    "nvflare/test_docs_nvflare.py",     # 30: docs/nvflare.md's simulator block as written
    "engine/test_payload_guard.py",     # 30
    "prep/test_prep_ham10000.py",       # 30
    "test_bundle_errors.py",            # 30
    "test_example_plugin.py",           # 30
    "flower/test_approval.py",          # 28
    "methods/test_fedkper_bundle.py",   # 28
    "test_wheel.py",                    # 27: a wheel built, installed in a fresh venv, its demo and mias prep run
    "flower/test_coordinator.py",       # 27
    "prep/test_prep_mias.py",           # 26
    "test_bundle_monai_tools.py",       # 25: every bundle through MONAI's workflow, verify_net_in_out, ckpt_export
    "flower/test_secagg_flower.py",     # 24: SecAgg+ over the loop-back grid and on Ray
    "tracking/test_tracker_recovery.py",  # 24
    "prep/test_prep_cbis_ddsm.py",      # 23
    "flower/test_startup_failures.py",  # 23
    "prep/test_prep_derm7pt.py",        # 22
    "test_demo_bundle.py",              # 21
    "test_logging.py",                  # 20
    "engine/test_config_booleans.py",   # 20
    "nvflare/test_builtin_numbers_nvflare.py",  # 20
    "engine/test_engine.py",            # 18
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the modules of :data:`SLOW_MODULES` first, in that order (a stable sort: the tests
    of a module keep their order, and so do the modules not listed)."""
    here = Path(__file__).parent
    rank = {str(here / name): k for k, name in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: rank.get(str(item.path), len(rank)))


def _threads_per_worker() -> None:
    """Under pytest-xdist, give each worker's torch (and the processes it starts: bundles,
    Flower sites) its share of the cores instead of all of them: two workers with two
    OpenMP threads each on two cores slow each other down more than they gain."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)


_threads_per_worker()


@pytest.fixture(autouse=True)
def _plots_only_where_checked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of a test marked ``plots`` draw their figures (``MEDFL_NO_PLOTS`` unset)."""
    if request.node.get_closest_marker("plots") is not None:
        monkeypatch.delenv("MEDFL_NO_PLOTS", raising=False)


# medfl's messages go through the ``medfl`` logger; the entry points (the ``medfl`` command,
# ``python -m medfl.prep...``) show them on stderr (:func:`medfl.logs.configure_console`).
# Tests call the library as those entry points do, so its lines are on the captured stderr
# (``capsys``, ``capfd``) as the command prints them, module-scoped runs included.
from medfl.logs import configure_console as _configure_console  # noqa: E402

_configure_console(force=True)


def _own_handlers(logger: Any) -> list[Any]:
    """The handlers of ``logger`` other than pytest's own captures (which pytest adds and
    removes around each phase of a test itself; :func:`medfl.logs._is_capture`)."""
    from medfl.logs import _is_capture

    return [h for h in logger.handlers if not _is_capture(h)]


@pytest.fixture(autouse=True)
def _medfl_console() -> Any:
    """Every test starts with the logging state the suite set up: medfl's console at INFO on
    the current stderr, and the root and ``medfl`` loggers as they were. A test that ran
    ``medfl -q``, configured logging itself, or built a MONAI ``ConfigWorkflow`` in this
    process (which applies the bundle's ``configs/logging.conf`` with ``fileConfig``: root and
    ``medfl`` handlers, ``medfl`` not propagating) does not change what the next one sees,
    whichever worker and order the tests run in."""
    import logging

    from medfl.logs import StderrHandler

    saved = {name: (logger.level, _own_handlers(logger), logger.propagate, logger.disabled)
             for name, logger in (("", logging.getLogger()), ("medfl", logging.getLogger("medfl")))}
    yield
    for name, (level, handlers, propagate, disabled) in saved.items():
        logger = logging.getLogger(name)
        for h in _own_handlers(logger):
            if h not in handlers:
                logger.removeHandler(h)
                if not isinstance(h, StderrHandler):
                    h.close()
        for h in handlers:
            if h not in logger.handlers:
                logger.addHandler(h)
        logger.setLevel(level)
        logger.propagate, logger.disabled = propagate, disabled
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("medfl.") and isinstance(logger, logging.Logger):
            logger.disabled = False   # fileConfig's disable_existing_loggers
    handlers = [h for h in logging.getLogger("medfl").handlers if isinstance(h, StderrHandler)]
    if len(handlers) != 1 or handlers[0].level != logging.INFO or logging.getLogger("medfl").level != logging.DEBUG:
        _configure_console(force=True)


@pytest.fixture
def tiny_fl(tmp_path: Path) -> dict[str, Any]:
    """A fast experiment: 3 clients, 48 tiny images, small CNN, 2 rounds, no progress bar."""
    return {
        "name": "t", "output_dir": str(tmp_path / "runs"), "seed": 0, "rounds": 2,
        "num_clients": 3, "progress": False,
        "dataset": {"name": "synthetic2d", "root": str(tmp_path / "data"), "num_samples": 96,
                    "num_classes": 2, "image_size": 12, "noise": 0.5},
        "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 8},
        "model": {"name": "small_cnn", "width": 4},
        "train": {"batch_size": 8, "lr": 0.05},
        "methods": [{"name": "fedavg"}],
    }


@pytest.fixture
def resolve():
    """resolve_config, for tests that tweak the tiny config first."""
    return resolve_config


@pytest.fixture(scope="session")
def reference_data() -> Path:
    """The real metadata files (``../shared/reference_data``); skips when absent, as in a
    user's own clone without the shared folder."""
    found = REFERENCE_DATA
    if found is None:
        pytest.skip("real metadata files not found: ../shared/reference_data beside the clone "
                    "(or MEDFL_REFERENCE_DATA) is needed for this test")
    return found


def _run_bundle(config_file: str | Path, *args: str, check: bool = True, cwd: str | Path | None = None,
                timeout: int = 300) -> "subprocess.CompletedProcess[str]":
    """``python -m monai.bundle run --config_file CONFIG ARGS`` in a subprocess, without
    progress bars; with ``check``, fail the test with the end of stderr when it fails."""
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", str(config_file), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "MEDFL_NO_PROGRESS": "1"})
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture
def run_bundle():
    """Run a MONAI bundle config through MONAI's CLI, as a user does (see :func:`_run_bundle`)."""
    return _run_bundle
