"""The evidence scripts keep running (issue 48, item 6): every script in ``experiments/`` runs its
``--smoke`` mode (a tiny fixture, one seed, two rounds, the fewest arms) to the end, so a config
check or an API change that breaks a script fails here and not months later in a rerun; and every
command that ``experiments/README.md`` quotes for a figure parses with its script's own argument
parser (the flags exist, their values are accepted), without running it."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
SCRIPTS = sorted(p.name for p in EXPERIMENTS.glob("*.py") if not p.name.startswith("_"))


def test_every_script_is_covered() -> None:
    """A new script in experiments/ joins the smoke runs (it needs a ``--smoke`` mode)."""
    assert SCRIPTS, "no scripts found under experiments/"
    for name in SCRIPTS:
        assert "--smoke" in (EXPERIMENTS / name).read_text(), f"experiments/{name} has no --smoke mode"


def load_script(script: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``script`` loaded as a module (its ``main`` not run), with ``experiments/`` on
    ``sys.path`` as when it runs as a command (restored, with whatever the script adds to
    ``sys.path``, by ``monkeypatch`` afterwards)."""
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    monkeypatch.syspath_prepend(str(ROOT))
    spec = importlib.util.spec_from_file_location(f"_experiment_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", SCRIPTS)
def test_smoke_mode_runs(script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``main(["--smoke", "--out", TMP])`` of ``experiments/SCRIPT`` (all that ``python
    experiments/SCRIPT --smoke --out TMP`` runs) returns 0 and writes something under TMP. It
    runs in this process: a process of its own would spend 5-7 CPU seconds importing torch and
    MONAI, more than most smoke runs spend on their work
    (:func:`test_a_script_runs_as_its_own_command` runs one as a command)."""
    import torch

    out = tmp_path / "out"
    monkeypatch.setenv("MEDFL_NO_PROGRESS", "1")
    monkeypatch.setenv("MEDFL_NO_PLOTS", "1")
    monkeypatch.chdir(tmp_path)
    main = load_script(EXPERIMENTS / script, monkeypatch).main
    threads, cpu = torch.get_num_threads(), time.process_time()
    try:
        code = main(["--smoke", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)     # scripts set their own
    print(f"{script} --smoke: {time.process_time() - cpu:.1f} CPU seconds")   # the cost in CI, less the machine's load
    assert code == 0, f"{script} --smoke returned {code}"
    written = [p for p in out.rglob("*") if p.is_file()]
    assert written, f"{script} --smoke wrote nothing under --out"


def test_a_script_runs_as_its_own_command(tmp_path: Path) -> None:
    """``python experiments/privacy_utility.py --smoke --out TMP`` (the cheapest smoke run) as
    a user types it: its own process, the repository on ``PYTHONPATH``, exits 0 and writes."""
    out = tmp_path / "out"
    env = {**os.environ, "MEDFL_NO_PROGRESS": "1", "MEDFL_NO_PLOTS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    proc = subprocess.run([sys.executable, str(EXPERIMENTS / "privacy_utility.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert proc.returncode == 0, f"failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert [p for p in out.rglob("*") if p.is_file()], "wrote nothing under --out"


# ------------------------------------------------------------------------------ README commands
def readme_commands(text: str) -> list[str]:
    """Every ``python experiments/...`` command in the README's code (indented or fenced
    blocks), continuation lines joined and trailing ``# comments`` dropped."""
    commands: list[str] = []
    lines = text.splitlines()
    fenced = False
    k = 0
    while k < len(lines):
        line = lines[k]
        if line.strip().startswith("```"):
            fenced = not fenced
            k += 1
            continue
        code = fenced or line.startswith("    ")
        stripped = line.strip()
        if code and stripped.startswith("python experiments/"):
            parts = [stripped]
            while (parts[-1].endswith("\\") or not _quotes_closed(" ".join(parts))) and k + 1 < len(lines):
                parts[-1] = parts[-1].removesuffix("\\")
                k += 1
                parts.append(lines[k].strip())
            command = " ".join(parts)
            commands.append(re.sub(r"\s+#.*$", "", command).strip())
        k += 1
    return commands


def _quotes_closed(text: str) -> bool:
    """Whether ``text`` splits as a shell line (a quoted JSON argument may span lines)."""
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return False
    return True


def usage_argv(command: str) -> list[str]:
    """A usage line's arguments as one invocation: optional groups ``[--rounds 15]`` are
    taken as given, a trailing ``...`` dropped."""
    command = re.sub(r"\[(--[^\[\]]*)\]", r"\1", command).replace(" ...", "")
    return shlex.split(command, comments=True)


class _Parsed(Exception):
    """Raised by the patched ``parse_args`` with the parsed namespace: the script stops there."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__("parsed")
        self.namespace = namespace


def parse_only(script: Path, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """Run ``script``'s ``main(argv)`` up to its argument parsing and return the namespace; a
    flag it does not know, a bad value or a missing required flag fails (argparse exits 2)."""
    original = argparse.ArgumentParser.parse_args

    def parse(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        raise _Parsed(original(self, args, namespace))

    module = load_script(script, monkeypatch)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
    try:
        module.main(argv)
    except _Parsed as parsed:
        return parsed.namespace
    except SystemExit as exc:
        pytest.fail(f"{script.name} {' '.join(argv)}: its parser refused the arguments (exit {exc.code})")
    pytest.fail(f"{script.name}: main() returned without parsing its arguments")


README_COMMANDS = readme_commands((EXPERIMENTS / "README.md").read_text())
#: the commands each script's docstring (its ``--help``) quotes
DOC_COMMANDS = [command for name in SCRIPTS
                for command in readme_commands(ast.get_docstring(ast.parse((EXPERIMENTS / name).read_text()),
                                                                 clean=False) or "")]


def test_readme_has_commands() -> None:
    """The parser below finds the README's commands (a format change must not empty the test)."""
    assert len(README_COMMANDS) >= 10, README_COMMANDS
    assert {shlex.split(c)[1] for c in DOC_COMMANDS} == {f"experiments/{name}" for name in SCRIPTS}
    scripts = {shlex.split(c)[1] for c in README_COMMANDS}
    assert "experiments/pfedcdp_evidence.py" in scripts and "experiments/fedtpf_evidence.py" in scripts


@pytest.mark.parametrize("command", README_COMMANDS + DOC_COMMANDS)
def test_readme_command_parses(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each figure's command in experiments/README.md, and each command a script's ``--help``
    quotes, names a script that exists and flags its parser accepts, as written."""
    argv = usage_argv(command)
    assert argv[0] == "python", command
    script = ROOT / argv[1]
    assert script.is_file(), f"{argv[1]} does not exist"
    parse_only(script, argv[2:], monkeypatch)


def test_parse_only_catches_an_unknown_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above fails on a flag the script does not have (it is not a no-op)."""
    with pytest.raises(pytest.fail.Exception, match="refused"):
        parse_only(EXPERIMENTS / "pfedcdp_evidence.py", ["--no-such-flag"], monkeypatch)

