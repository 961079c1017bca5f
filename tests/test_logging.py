"""medfl's logging (:mod:`medfl.logs`): no stderr print left, the console of the entry points
(``-v``/``-q``), the ``log.txt`` of every run directory (appended on resume, never leaked), and
progress inside a round (per client, per epoch)."""

from __future__ import annotations

import ast
import io
import json
import logging
import sys
import threading
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from medfl import cli
from medfl.logs import (LOG_FILE, FileLog, StderrHandler, Throttle, app_configured, configure_console,
                        console_level, ensure_console, file_log, plugin_logger)

ROOT = Path(__file__).resolve().parents[1]
MEDFL = logging.getLogger("medfl")

def _stderr_calls(path: Path) -> list[str]:
    """``print(..., file=sys.stderr)`` calls and ``sys.stderr.<write/flush/...>(...)`` calls
    of a module, as ``path:line``."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id == "print":
            if any(kw.arg == "file" and ast.unparse(kw.value) in ("sys.stderr", "sys.__stderr__", "stderr")
                   for kw in node.keywords):
                found.append(f"{path}:{node.lineno}")
        elif isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) in ("sys.stderr", "sys.__stderr__"):
            found.append(f"{path}:{node.lineno}")
    return found


def test_no_print_to_stderr_left_in_medfl_or_plugins() -> None:
    files = sorted([*(ROOT / "medfl").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")])
    assert len(files) > 50
    left = [hit for f in files for hit in _stderr_calls(f)]
    assert left == [], "diagnostics go through logging.getLogger(__name__), not stderr: " + ", ".join(left)


def test_the_ast_check_finds_the_forms_it_forbids(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('import sys\nprint("x", file=sys.stderr)\nprint(\n  "y",\n  file=sys.stderr, flush=True)\n'
                   'sys.stderr.write("z")\nprint("stdout is fine")\n')
    assert _stderr_calls(bad) == [f"{bad}:2", f"{bad}:3", f"{bad}:6"]


def test_every_medfl_logger_is_under_medfl() -> None:
    import medfl_plugins.pfedcdp.method as pfedcdp
    import medfl_plugins.privacy as privacy

    assert pfedcdp.logger.name == "medfl.plugins.pfedcdp" and privacy.logger.name == "medfl.plugins.privacy"
    assert plugin_logger("someone.else.mod").name == "medfl.plugins.mod"
    from medfl.engine import runner

    assert runner.logger.name == "medfl.engine.runner"


# ---------------------------------------------------------------- the console
def test_console_writes_to_the_current_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    logging.getLogger("medfl.test").info("to the captured stderr")
    buf = io.StringIO()
    with redirect_stderr(buf):
        logging.getLogger("medfl.test").warning("medfl: to the redirected one")
        logging.getLogger("medfl.test").debug("not at INFO")
    assert buf.getvalue() == "medfl: to the redirected one\n"   # the message as it reads, no prefix
    assert capsys.readouterr().err == "to the captured stderr\n"


def test_console_levels_and_one_handler() -> None:
    assert console_level() == logging.INFO and console_level(verbose=1) == logging.DEBUG
    assert console_level(quiet=1) == logging.WARNING and console_level(quiet=2) == logging.ERROR
    configure_console(logging.WARNING)
    configure_console(logging.DEBUG)
    consoles = [h for h in MEDFL.handlers if isinstance(h, StderrHandler)]
    assert len(consoles) == 1 and consoles[0].level == logging.DEBUG and MEDFL.level == logging.DEBUG


def test_an_application_s_own_logging_configuration_is_kept() -> None:
    """An application that configured logging (basicConfig, a bundle's logging.conf) keeps it:
    the entry points add no console of their own."""
    mine = logging.StreamHandler(io.StringIO())
    logging.getLogger().addHandler(mine)
    try:
        assert app_configured()
        assert configure_console() is None and ensure_console() is None
    finally:
        logging.getLogger().removeHandler(mine)
    assert not app_configured()
    assert ensure_console() is None   # the console the tests run with stays (no second one)


def test_cli_verbose_and_quiet(tiny_fl: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``medfl -v run`` shows the per-epoch DEBUG lines, ``medfl run -q`` none of the INFO lines
    (the partition summary); the run's log.txt has everything either way."""
    cfg = tmp_path / "train.json"
    cfg.write_text(json.dumps({"fl": {**tiny_fl, "rounds": 1}}))
    assert cli.main(["-v", "run", str(cfg), "--fl#name", "loud"]) == 0
    loud = capsys.readouterr().err
    assert "medfl partition: " in loud and "epoch 1/1: loss " in loud
    assert cli.main(["run", str(cfg), "--fl#name", "quiet", "-q"]) == 0
    quiet = capsys.readouterr()
    assert "medfl partition: " not in quiet.err and "epoch 1/1" not in quiet.err
    assert "local_test" in quiet.out   # the results table is output, not a diagnostic
    for name in ("loud", "quiet"):
        text = (Path(tiny_fl["output_dir"]) / name / "fedavg" / LOG_FILE).read_text()
        assert "epoch 1/1: loss " in text and "DEBUG medfl.training: " in text
    assert cli.main(["-q", "report", str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no such folder" in capsys.readouterr().err   # errors show whatever -q says


def test_cli_help_names_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = capsys.readouterr().out
    assert "--verbose" in out and "--quiet" in out and "log.txt" in out


# ---------------------------------------------------------------- the run's log.txt
def _consoles_and_files() -> list[logging.Handler]:
    return list(MEDFL.handlers)


def test_run_log_has_every_round_and_is_appended_on_resume(tiny_fl: dict[str, Any],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from medfl.engine import exchanges
    from medfl.experiment import resume, run_experiment
    from medfl.config import resolve_config

    monkeypatch.setattr(exchanges, "PROGRESS_EVERY_S", 0.0)   # every client's line at INFO
    before = _consoles_and_files()
    result = run_experiment(resolve_config({**tiny_fl, "stop_after_round": 1}))
    assert _consoles_and_files() == before
    run_dir = Path(result["dir"]) / "fedavg"
    first = (run_dir / LOG_FILE).read_text()
    n = 3
    assert "INFO medfl.engine.exchanges: medfl [fedavg] round 1: client " in first
    assert sum(f"({k}/{n} clients" in first for k in range(1, n + 1)) == n
    assert "round 2:" not in first and "epoch 1/1: loss " in first and "medfl [fedavg]: round 1 of 2 in " in first
    assert "INFO medfl.engine.data: medfl partition: " not in first   # the split is before the run
    experiment_log = (Path(result["dir"]) / LOG_FILE).read_text()
    assert "medfl partition: " in experiment_log and "log opened" in experiment_log

    resume(result["dir"])
    assert _consoles_and_files() == before
    again = (run_dir / LOG_FILE).read_text()
    assert again.startswith(first)   # appended, not overwritten
    rest = again[len(first):]
    assert "medfl [fedavg]: resumed at round 2 (after the checkpoint of round 1)" in rest
    assert "round 2: client" in rest and "round 1: client" not in rest and "medfl [fedavg]: round 2 of 2 in " in rest
    assert (Path(result["dir"]) / LOG_FILE).read_text().startswith(experiment_log)


def test_a_failing_run_leaks_no_handler_and_logs_the_failure(tiny_fl: dict[str, Any],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from medfl.config import resolve_config
    from medfl.engine import exchanges
    from medfl.experiment import run_experiment

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("client exploded")

    monkeypatch.setattr(exchanges, "run_client_update", boom)
    before = _consoles_and_files()
    with pytest.raises(RuntimeError, match="client exploded"):
        run_experiment(resolve_config(tiny_fl))
    assert _consoles_and_files() == before
    run_dir = Path(tiny_fl["output_dir"]) / "t" / "fedavg"
    text = (run_dir / LOG_FILE).read_text()
    assert "round 1: client 0 training (1/" in text
    assert json.loads((run_dir / "status.json").read_text())["status"] == "failed"


def test_a_run_that_fails_while_preparing_leaks_no_handler(tiny_fl: dict[str, Any],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from medfl.config import resolve_config
    from medfl.engine.checkpoints import Checkpoints
    from medfl.experiment import run_experiment

    def boom(self: Any) -> None:
        raise OSError("no room for config.json")

    monkeypatch.setattr(Checkpoints, "_write_static", boom)
    before = _consoles_and_files()
    with pytest.raises(OSError, match="no room"):
        run_experiment(resolve_config(tiny_fl))
    assert _consoles_and_files() == before


def test_file_log_keeps_to_its_thread_and_closes(tmp_path: Path) -> None:
    log = logging.getLogger("medfl.test")
    with file_log(tmp_path, "unit") as opened:
        handler = opened.handler
        log.debug("a detail of this thread")
        other = threading.Thread(target=lambda: log.warning("another thread's run"))
        other.start()
        other.join(60)
    assert handler is not None and handler not in MEDFL.handlers and handler.stream is None   # closed
    text = (tmp_path / LOG_FILE).read_text()
    assert "DEBUG medfl.test: a detail of this thread" in text and "another thread" not in text
    assert "INFO medfl.logs: log opened (pid " in text and ": unit" in text
    log.info("after the block")
    assert "after the block" not in (tmp_path / LOG_FILE).read_text()


def test_file_log_without_any_configuration_keeps_warnings_on_stderr(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A library caller that configured nothing still sees medfl's warnings (Python's last
    resort would, and a file handler alone would silence it); INFO goes to the file only."""
    from medfl.logs import remove_console

    remove_console()
    MEDFL.setLevel(logging.NOTSET)
    try:
        with file_log(tmp_path):
            logging.getLogger("medfl.test").warning("medfl: a warning")
            logging.getLogger("medfl.test").info("medfl: a fact")
        assert MEDFL.level == logging.NOTSET and not any(isinstance(h, StderrHandler) for h in MEDFL.handlers)
    finally:
        configure_console(force=True)
    assert capsys.readouterr().err == "medfl: a warning\n"
    text = (tmp_path / LOG_FILE).read_text()
    assert "WARNING medfl.test: medfl: a warning" in text and "INFO medfl.test: medfl: a fact" in text


def test_attach_twice_is_one_handler(tmp_path: Path) -> None:
    log = FileLog(tmp_path)
    before = len(MEDFL.handlers)
    log.attach()
    log.attach()
    assert len(MEDFL.handlers) == before + 1
    log.detach()
    log.detach()
    assert len(MEDFL.handlers) == before and not log.attached


# ---------------------------------------------------------------- progress inside a round
def test_per_client_lines_are_info_only_every_so_often(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    from medfl.engine import exchanges

    clock = iter([0.0, 10.0, 31.0, 40.0, 100.0]).__next__
    monkeypatch.setattr(exchanges, "Throttle", lambda every: Throttle(every, clock=clock))
    progress = exchanges.RoundProgress("fedavg", 3, 4, bar=False)
    with caplog.at_level(logging.DEBUG, logger="medfl"):
        for cid in "0123":
            progress.start(cid)
            progress.done(cid)
    progress.close()
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "trained" in r.getMessage()]
    assert [lvl for lvl, _ in lines] == ["DEBUG", "INFO", "DEBUG", "INFO"]   # 30 s apart at most once
    assert lines[1][1].startswith("medfl [fedavg] round 3: client 1 trained (2/4 clients, ")


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal (as a user's console does)."""

    def isatty(self) -> bool:
        return True


def test_a_redirected_stderr_gets_a_line_per_round_and_no_bar(tiny_fl: dict[str, Any],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``medfl run ... 2> log.txt``: no bar frames in the file, a line per round instead."""
    from medfl.config import resolve_config
    from medfl.experiment import run_experiment

    monkeypatch.delenv("MEDFL_NO_PROGRESS", raising=False)
    stream = io.StringIO()   # not a terminal, as a file or a pipe
    with monkeypatch.context() as mp:
        mp.setattr(sys, "stderr", stream)
        result = run_experiment(resolve_config({**tiny_fl, "progress": True}))
    err = stream.getvalue()
    assert "round/s" not in err and "client/s" not in err and "\r" not in err and "%|" not in err
    assert [line.split(" (")[0] for line in err.splitlines() if " done (" in line] == \
        ["medfl [fedavg] round 1 of 2 done", "medfl [fedavg] round 2 of 2 done"]
    log = (Path(result["dir"]) / "fedavg" / LOG_FILE).read_text()
    assert "INFO medfl.engine.exchanges: medfl [fedavg] round 2 of 2 done (" in log


@pytest.mark.parametrize(("terminal", "env", "wanted", "bar", "level"), [
    (True, None, True, True, "DEBUG"),      # a terminal: the bar, the round lines only in log.txt
    (False, None, True, False, "INFO"),     # redirected: no bar, a line per round
    (True, "1", True, False, "DEBUG"),      # MEDFL_NO_PROGRESS: quiet everywhere
    (True, None, False, False, "DEBUG"),    # fl.progress false: quiet everywhere
])
def test_round_bar_on_a_terminal_only(terminal: bool, env: str | None, wanted: bool, bar: bool, level: str,
                                      monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from medfl.engine.exchanges import RoundBar

    if env is None:
        monkeypatch.delenv("MEDFL_NO_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("MEDFL_NO_PROGRESS", env)
    stream: io.StringIO = _Terminal() if terminal else io.StringIO()
    with monkeypatch.context() as mp, caplog.at_level(logging.DEBUG, logger="medfl"):
        mp.setattr(sys, "stderr", stream)
        rounds = RoundBar(iter([3, 4]), "fedavg", 2, 4, wanted)
        for r in rounds:
            rounds.set_postfix({"local_acc": f"0.{r}00"})
        rounds.close()
    assert ("fedavg: 100%|" in stream.getvalue() and "4/4 [" in stream.getvalue()) is bar
    lines = [(rec.levelname, rec.getMessage().split(" (")[0], rec.getMessage().split("): ")[-1])
             for rec in caplog.records if " done (" in rec.getMessage()]
    assert lines == [(level, "medfl [fedavg] round 3 of 4 done", "local_acc=0.300"),
                     (level, "medfl [fedavg] round 4 of 4 done", "local_acc=0.400")]


@pytest.mark.parametrize(("env", "wanted", "expected"), [
    (None, True, None), ("", True, None), ("0", True, None), ("false", True, None), ("1", True, True),
    ("yes", True, True), (None, False, True),
])
def test_progress_bar_disabled(env: str | None, wanted: bool, expected: bool | None,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``None`` lets tqdm draw only on a terminal; ``True`` draws nothing."""
    from medfl.logs import progress_bar_disabled

    if env is None:
        monkeypatch.delenv("MEDFL_NO_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("MEDFL_NO_PROGRESS", env)
    assert progress_bar_disabled(wanted) is expected


def test_prep_bar_is_not_written_into_a_redirected_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    from medfl.prep.common import progress

    monkeypatch.delenv("MEDFL_NO_PROGRESS", raising=False)
    for terminal in (False, True):
        stream: io.StringIO = _Terminal() if terminal else io.StringIO()
        with monkeypatch.context() as mp:
            mp.setattr(sys, "stderr", stream)
            assert list(progress(range(3), "prep")) == [0, 1, 2]
        assert ("prep: 100%|" in stream.getvalue()) is terminal


def _tiny_training(debug: bool) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    from medfl.training import train_epochs

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    data = TensorDataset(torch.randn(70, 12), torch.randint(0, 3, (70,)))
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    level = MEDFL.level
    MEDFL.setLevel(logging.DEBUG if debug else logging.INFO)
    try:
        stats = train_epochs(model, loader, opt, epochs=3)
    finally:
        MEDFL.setLevel(level)
    return stats, {k: v.clone() for k, v in model.state_dict().items()}


def test_per_epoch_lines_change_no_number(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="medfl.training"):
        stats, state = _tiny_training(debug=True)
    epochs = [r.getMessage() for r in caplog.records if r.name == "medfl.training"]
    assert len(epochs) == 3 and all(f"epoch {e}/3: loss " in m for e, m in zip((1, 2, 3), epochs))
    assert all("(9 batches, " in m and "batches/s)" in m for m in epochs)
    losses = [float(m.split("loss ")[1].split(" ")[0]) for m in epochs]
    assert sum(losses) / 3 == pytest.approx(stats["loss"], rel=1e-3)   # equal epochs: the mean of the means
    quiet_stats, quiet_state = _tiny_training(debug=False)
    assert quiet_stats == stats   # bit-identical: reading the sums per epoch changes none
    assert all(torch.equal(state[k], quiet_state[k]) for k in state)


def _tiny_dp_training(debug: bool) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    from medfl.models import small_cnn
    from medfl.privacy.dp_sgd import make_private_model, train_epochs_dp

    torch.manual_seed(0)
    model = make_private_model(small_cnn(width=4))[0]
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 1, 16, 16, generator=g), torch.randint(0, 2, (24,), generator=g))
    level = MEDFL.level
    MEDFL.setLevel(logging.DEBUG if debug else logging.INFO)
    try:
        stats = train_epochs_dp(model, data, torch.optim.SGD(model.parameters(), lr=0.1), 3, batch_size=8,
                                noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    finally:
        MEDFL.setLevel(level)
    return stats, {k: v.clone() for k, v in model.state_dict().items()}


def test_dp_sgd_epochs_have_their_lines_too(caplog: pytest.LogCaptureFixture) -> None:
    """DP-SGD's own loop says each epoch as train_epochs does (its Poisson draws are the
    batches), and saying it changes no number."""
    with caplog.at_level(logging.DEBUG, logger="medfl.training"):
        stats, state = _tiny_dp_training(debug=True)
    epochs = [r.getMessage() for r in caplog.records if r.name == "medfl.training"]
    assert len(epochs) == 3 and all(m.startswith(f"epoch {e}/3: loss ") for e, m in zip((1, 2, 3), epochs))
    assert all("(3 batches, " in m for m in epochs)   # ceil(24 / 8) draws per epoch
    quiet_stats, quiet_state = _tiny_dp_training(debug=False)
    assert quiet_stats == stats
    assert all(torch.equal(state[k], quiet_state[k]) for k in state)


def test_prep_entry_point_shows_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m medfl.prep...`` (run_script) configures the console itself."""
    from medfl.prep.common import DataError, run_script

    def main(argv: list[str] | None) -> int:
        logging.getLogger("medfl.prep.common").warning("warning: 2 rows name no file")
        raise DataError("the download has no metadata.csv")

    with pytest.raises(SystemExit) as exit_info:
        run_script(main, [])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "warning: 2 rows name no file\nerror: the download has no metadata.csv\n"


def test_bundle_logging_conf_configures_medfl(tmp_path: Path) -> None:
    """Under MONAI's bundle runner the bundle's logging.conf (loggers root and medfl, a console
    on stderr with timestamps and levels) configures medfl's lines; the run still writes its
    log.txt."""
    import shutil
    import subprocess

    bundle = tmp_path / "demo"
    shutil.copytree(ROOT / "bundles" / "demo", bundle)
    (bundle / "configs" / "logging.conf").write_text(
        "[loggers]\nkeys=root,medfl\n\n[handlers]\nkeys=console\n\n[formatters]\nkeys=plain\n\n"
        "[logger_root]\nlevel=INFO\nhandlers=console\n\n"
        "[logger_medfl]\nlevel=INFO\nhandlers=console\nqualname=medfl\npropagate=0\n\n"
        "[handler_console]\nclass=StreamHandler\nlevel=INFO\nformatter=plain\nargs=(sys.stderr,)\n\n"
        "[formatter_plain]\nformat=%(asctime)s %(levelname)s %(name)s: %(message)s\n")
    proc = subprocess.run(
        [sys.executable, "-m", "monai.bundle", "run", "--config_file", str(bundle / "configs" / "train.json"),
         "--logging_file", str(bundle / "configs" / "logging.conf"), "--bundle_root", str(tmp_path),
         "--fl#rounds", "1", "--fl#dataset#num_samples", "120", "--fl#partition#min_size", "10",
         "--fl#progress", "False"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if " medfl.engine.data: medfl partition: " in ln]
    assert len(lines) == 1 and " INFO medfl.engine.data: " in lines[0]   # the conf's format, once
    run_log = (tmp_path / "runs" / "demo" / "fedavg" / LOG_FILE).read_text()
    assert "INFO medfl.logs: log opened (pid " in run_log and "INFO medfl.engine.runner: medfl [fedavg]: round 1 of 1 in " in run_log
    experiment = (tmp_path / "runs" / "demo" / LOG_FILE).read_text()
    assert " INFO medfl.engine.data: medfl partition: " in experiment   # the conf's INFO, in the file too


_LOG_LINE = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING|ERROR) [\w.]+: (.*)$"
# what `medfl run` does once its console is installed, after which a library is imported that
# calls logging.basicConfig (Opacus, mlflow.pytorch; an explicit call too): the run logs on
_LIBRARY_AFTER_CONSOLE = """
import logging, sys
from medfl.cli import main
from medfl.logs import configure_console
configure_console()
import opacus, mlflow.pytorch
logging.basicConfig(level=logging.DEBUG)
assert logging.getLogger().handlers, "no root handler: nothing to test"
sys.exit(main(["run", sys.argv[1]]))
"""


def test_other_libraries_logging_set_up_never_changes_medfls_console(tiny_fl: dict[str, Any],
                                                                      tmp_path: Path) -> None:
    """Once Opacus or ``mlflow.pytorch`` is imported (each calls ``logging.basicConfig``: a root
    handler), medfl's console prints each of its lines once, and no DEBUG line without ``-v``;
    the run's ``log.txt`` gets every line, DEBUG included, as before."""
    import re
    import subprocess

    pytest.importorskip("mlflow", reason="mlflow is not installed: pip install \"medfl[tracking]\"")
    cfg = tmp_path / "train.json"
    cfg.write_text(json.dumps({"fl": {**tiny_fl, "rounds": 1}}))
    proc = subprocess.run([sys.executable, "-c", _LIBRARY_AFTER_CONSOLE, str(cfg)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "runs").glob("*/fedavg/log.txt"))
    assert len(runs) == 1, runs
    lines = [m.groups() for m in map(re.compile(_LOG_LINE).match, runs[0].read_text().splitlines()) if m]
    shown = [msg for level, msg in lines if level != "DEBUG" and msg and not msg.startswith("log opened")]
    hidden = [msg for level, msg in lines if level == "DEBUG"]
    assert shown and hidden, lines   # the run logged at INFO and at DEBUG
    for msg in set(shown):
        assert proc.stderr.count(msg) == sum(m == msg for m in shown), (msg, proc.stderr[-3000:])
    for msg in set(hidden):
        assert msg not in proc.stderr, (msg, proc.stderr[-3000:])
    assert "DEBUG" not in proc.stderr and ":medfl." not in proc.stderr, proc.stderr[-3000:]
