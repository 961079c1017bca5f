"""A mistake in a bundle's input, run through MONAI's CLI, ends with medfl's own message.

MONAI re-raises every exception of a ``$`` expression as "Failed to evaluate
ConfigExpression", which would bury medfl's message ~40 lines up; ``medfl.bundle.run`` and
``medfl.bundle.infer`` print it as the last line instead and exit with code 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from medfl.bundle import USER_ERROR_EXIT, exit_on_user_error
from medfl.config import ConfigError

BUNDLES = Path(__file__).resolve().parents[1] / "bundles"


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.mark.parametrize("override, message", [
    (("--fl#methods#0#name", "fedavgx"), "medfl: error: unknown method 'fedavgx'; valid methods: "),
    (("--fl#methods#0#mu", "0.1"), "medfl: error: method 'fedavg' has no parameter(s) 'mu'; valid parameters: "),
], ids=["unknown-method", "unknown-method-parameter"])
def test_train_json_error_is_the_last_line(tmp_path: Path, run_bundle, override: tuple[str, str],
                                           message: str) -> None:
    proc = run_bundle(BUNDLES / "demo" / "configs" / "train.json", "--bundle_root", tmp_path, *override,
                      check=False, timeout=120)
    assert proc.returncode == USER_ERROR_EXIT, proc.stderr[-3000:]
    assert _last_line(proc.stderr).startswith(message), proc.stderr[-3000:]
    assert "Failed to evaluate" not in proc.stderr and "Traceback" not in proc.stderr


def test_inference_json_error_is_the_last_line(tmp_path: Path, run_bundle) -> None:
    """``inference.json`` goes through ``medfl.bundle.infer``: a run directory that does not exist
    is named as such."""
    proc = run_bundle(BUNDLES / "mias" / "configs" / "inference.json", "--bundle_root", tmp_path,
                      check=False, timeout=120)
    assert proc.returncode == USER_ERROR_EXIT, proc.stderr[-3000:]
    want = f"medfl: error: {tmp_path / 'runs' / 'mias' / 'fedavg'}: no such folder"
    assert _last_line(proc.stderr).startswith(want), proc.stderr[-3000:]
    assert "Failed to evaluate" not in proc.stderr


def test_only_medfls_own_errors_end_the_process(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        with exit_on_user_error():
            raise ConfigError("fl.rounds: expected a positive integer, got 0")
    assert exit_info.value.code == USER_ERROR_EXIT
    assert isinstance(exit_info.value.__cause__, ConfigError)   # kept for whoever catches SystemExit
    assert capsys.readouterr().err == "medfl: error: fl.rounds: expected a positive integer, got 0\n"
    # anything else is a bug: it keeps its type and traceback
    with pytest.raises(KeyError, match="bug"):
        with exit_on_user_error():
            raise KeyError("bug")
    assert capsys.readouterr().err == ""
