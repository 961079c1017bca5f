"""Every "continue with" hint medfl prints names a command that does what it says (issue 51).

A stopped run (``fl.stop_after_round``: a plain experiment, seeds, cross-validation folds)
and an interrupted one print the command that continues them; each test here runs the
printed command as a user would paste it and checks that every run then finished all its
rounds. The hints of a run whose clients ran over Flower are run in
``tests/flower/test_coordinator.py`` (``test_stopped_flower_run_resumes_to_the_uninterrupted_result``).
A static check finds every hint in medfl's source and requires it to come from
:func:`medfl.backend.resume_command` (or a run's ``resume_command``), which those tests run.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from medfl import hookimpl
from medfl.cli import main
from medfl.plugins import get_plugin_manager

ROOT = Path(__file__).resolve().parents[1]

#: a hint: "continue with `CMD`" (the result's lines) or "continue with: CMD" (a run's log line)
_HINT = re.compile(r"(?:continue|resume) with:? (?:`(medfl [^`]+)`|(medfl \S.*)$)", re.M)


def hints(text: str) -> list[str]:
    """The commands the "continue with" / "resume with" hints in ``text`` name, in order, once each."""
    return list(dict.fromkeys(a or b.strip() for a, b in _HINT.findall(text)))


def _finished_runs(exp_dir: Path) -> dict[str, tuple[str, int]]:
    """Every method run under ``exp_dir``: its ``status.json``'s status and last round."""
    out = {}
    for status in sorted(exp_dir.rglob("status.json")):
        saved = json.loads(status.read_text())
        out[str(status.parent.relative_to(exp_dir))] = (saved["status"], int(saved["last_round"]))
    return out


class _Interrupt:
    """A throwaway plugin: Ctrl-C after round 1 of the first run (as a user presses it)."""

    def __init__(self) -> None:
        self.fired = False

    @hookimpl
    def on_round_end(self, run: Any, round: int, metrics: list[dict[str, Any]]) -> None:
        if round == 1 and not self.fired:
            self.fired = True
            raise KeyboardInterrupt


CASES = [
    ("experiment", {"stop_after_round": 1}, ["fedavg"]),
    ("seeds", {"seeds": [0, 1], "stop_after_round": 1}, ["seed_0/fedavg", "seed_1/fedavg"]),
    ("folds", {"cv": {"folds": 2}, "stop_after_round": 1}, ["fold_0/fedavg", "fold_1/fedavg"]),
    ("interrupted", {}, ["fedavg"]),
]


@pytest.mark.parametrize("case, extra, runs", CASES, ids=[c[0] for c in CASES])
def test_the_printed_resume_command_finishes_the_run(tiny_fl: dict[str, Any], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str], case: str,
                                                    extra: dict[str, Any], runs: list[str]) -> None:
    """Stopped or interrupted after round 1 of 2, the run prints one hint; the command it
    names, split as a shell splits it (the output folder has a space), finishes every run."""
    fl = {**tiny_fl, "name": case, "output_dir": str(tmp_path / "my runs"), **extra}
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"fl": fl}))
    exp_dir = Path(fl["output_dir"]) / case
    pm = get_plugin_manager()
    if case == "interrupted":
        pm.register(_Interrupt(), name="interrupt-after-round-1")
    try:
        code = main(["run", str(config)])
    finally:
        if case == "interrupted":
            pm.unregister(name="interrupt-after-round-1")
    assert code == (130 if case == "interrupted" else 0)
    out = capsys.readouterr()
    stopped = _finished_runs(exp_dir)
    assert sorted(stopped) == runs and all(st != "finished" for st, _ in stopped.values()), stopped
    printed = hints(out.out + out.err)
    assert len(printed) == 1, (printed, out.out[-2000:], out.err[-2000:])
    argv = shlex.split(printed[0])
    assert argv[:2] == ["medfl", "resume"], printed   # the runs' clients are in this process
    assert main(argv[1:]) == 0
    again = capsys.readouterr()
    assert _finished_runs(exp_dir) == {r: ("finished", fl["rounds"]) for r in runs}
    assert hints(again.out + again.err) == []   # nothing left to continue


#: hints that name no command of their own (an option of the command being run): file, text, why
NOT_COMMANDS = {
    ("medfl/engine/checkpoints.py", "resume with \"\n                                f\"--rounds"):
        "an option of the `medfl resume` (or `medfl flower run --resume`) being refused",
    ("medfl/cli/flower.py", "continue with \"\n                   \"--resume)"):
        "`medfl flower run` on Ctrl-C; the coordinator's own line above it names the whole command",
}


#: a string that tells how to continue a run: "continue with ...", "resume with ...", "resume
#: it first (...)", or a resume command spelled out
_HINT_TEXT = re.compile(r"(continue|resume) with\b|resume it first|medfl resume |flower run --resume ")


def _hint_statements() -> list[tuple[str, str]]:
    """Every statement of medfl's source holding a hint string (:data:`_HINT_TEXT`;
    docstrings and the ``resume_command`` functions that build the commands left out):
    ``(file, statement source)``."""
    found = []
    for path in sorted((ROOT / "medfl").rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        docs = {id(node.body[0].value) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and node.body and isinstance(node.body[0], ast.Expr)}
        builders = [(f.lineno, f.end_lineno or f.lineno) for f in ast.walk(tree)
                    if isinstance(f, ast.FunctionDef) and f.name == "resume_command"]
        statements = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and not isinstance(
            n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.While, ast.Try, ast.With))
            and not any(a <= n.lineno <= b for a, b in builders)]
        for stmt in statements:
            strings = [n for n in ast.walk(stmt) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                       and id(n) not in docs]
            if any(_HINT_TEXT.search(s.value) for s in strings):
                found.append((str(path.relative_to(ROOT)), ast.get_source_segment(source, stmt) or ""))
    return found


def test_every_resume_hint_in_the_source_comes_from_resume_command() -> None:
    """A hint written as text (``f"continue with `medfl resume {path}`"``) would name the same
    command whatever backend ran the run (issue 51: a Flower run told to `medfl resume`); the
    hints come from ``resume_command``, whose commands the tests above (and the Flower test)
    run. A new hint that names no command of its own is added to :data:`NOT_COMMANDS`."""
    statements = _hint_statements()
    assert len(statements) >= 8, statements   # the scan finds the hints
    unexplained = [(f, s) for f, s in statements if "resume_command(" not in s
                   and not any(f == nf and text in s for nf, text in NOT_COMMANDS)]
    assert unexplained == [], "hints not built by resume_command:\n" + "\n\n".join(f"{f}:\n{s}" for f, s in unexplained)
    for nf, text in NOT_COMMANDS:
        assert any(f == nf and text in s for f, s in statements), f"NOT_COMMANDS entry no longer in {nf}: {text!r}"
    # no hint spells the command out itself
    for f, s in statements:
        assert not re.search(r"(with:? `?|\()medfl (resume|flower run --resume) \{", s), (f, s)
