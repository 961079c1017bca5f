"""``--raw`` and ``--out`` checked (:func:`check_dirs`), and the staging folder beside ``--out``
that becomes it only when the script succeeds (:func:`staged_main`)."""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from medfl.prep.errors import PrepError, file_problem, printable

__all__ = ["check_dirs", "final_out", "staged_main"]


def check_dirs(raw: Path, out: Path, overwrite: bool) -> tuple[Path, Path]:
    """Resolve and check ``--raw`` and ``--out``; create ``out``.

    Raises:
        PrepError: ``raw`` is not a directory, ``out`` is inside ``raw`` (the raw directory is
            never written to), or ``out`` holds an earlier manifest and not ``overwrite``.
    """
    for option, path in (("--raw", raw), ("--out", out)):
        if "symlink loop" in file_problem(path):        # resolve() stops on it
            raise PrepError(f"{option} {path}: {file_problem(path)}; expected a folder", path)
    raw, out = Path(raw).resolve(), Path(out).resolve()
    if not raw.is_dir():
        raise PrepError(f"--raw {raw}: not a directory; expected the dataset as downloaded", raw)
    if out == raw or raw in out.parents:
        raise PrepError(f"--out {out} is inside --raw {raw}; data_prep never writes into the raw "
                        "dataset, choose an --out outside it", out)
    if out.exists() and not out.is_dir():
        raise PrepError(f"--out {out} is a file; expected a folder to write the prepared dataset into", out)
    if (out / "manifest.csv").exists() and not overwrite:
        raise PrepError(f"--out {out} already holds a manifest.csv from an earlier run; pass "
                        "--overwrite to replace it, or choose another --out", out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PrepError(f"--out {out}: cannot create it ({exc.strerror or exc}); choose a folder you can write to",
                        out) from None
    if not os.access(out.parent, os.W_OK | os.X_OK) or (out.is_dir() and not os.access(out, os.W_OK | os.X_OK)):
        raise PrepError(f"--out {out}: not writable; choose a folder you can write to", out)
    return raw, _stage(out)


#: the staging folders of the scripts running in this process: (staging, final --out)
_STAGED: list[tuple[Path, Path]] = []


def final_out(path: str | Path) -> Path:
    """The ``--out`` that the staging folder ``path`` ends up as (``path`` itself when it is
    none): what a report names."""
    return next((final for work, final in _STAGED if Path(path) == work), Path(path))


def _stage(out: Path) -> Path:
    """A fresh folder beside ``out`` that the script writes everything into;
    :func:`staged_main` renames it into place when the script succeeds, so a stop never
    leaves half an output and a failed ``--overwrite`` never touches the earlier dataset."""
    for old in out.parent.glob(f".{out.name}.partial-*"):   # left by a killed run (kill -9)
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    work = out.parent / f".{out.name}.partial-{os.getpid()}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    _STAGED.append((work, out))
    return work


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (its staging folder is in use)."""
    try:
        os.kill(pid, 0)
    except OSError as exc:       # another error (EPERM): it runs, as another user
        return not isinstance(exc, ProcessLookupError)
    return True


def _finish_stage(work: Path, out: Path, ok: bool) -> None:
    """Move what the script wrote in ``work`` into ``out`` (``work`` renamed when ``out`` does
    not exist; otherwise each entry replaces the one of its name, others are kept), or, after a
    failure, keep only the report (``report.json``, ``skipped.csv``) in ``<out>.failed/`` and
    remove the rest."""
    report = work / "report.json"
    if report.is_file():       # the report names the folder the dataset ends up in (as JSON text)
        report.write_text(report.read_text().replace(json.dumps(printable(str(work)))[1:-1],
                                                     json.dumps(printable(str(out)))[1:-1]))
    if ok:
        if not out.exists():
            work.rename(out)
            return
        # an existing --out (an earlier dataset with --overwrite, or a folder with other files):
        # each entry the script wrote replaces the entry of that name; nothing else is touched
        for entry in sorted(work.iterdir()):
            target = out / entry.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            entry.rename(target)
        shutil.rmtree(work, ignore_errors=True)
        failed = out.parent / f"{out.name}.failed"
        if failed.is_dir():
            shutil.rmtree(failed)   # an earlier failure's report: this run succeeded
        return
    reports = [work / n for n in ("report.json", "skipped.csv") if (work / n).is_file()]
    if reports:
        failed = out.parent / f"{out.name}.failed"
        failed.mkdir(exist_ok=True)
        for f in reports:
            f.replace(failed / f.name)
    shutil.rmtree(work, ignore_errors=True)


def staged_main(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Decorate a script's ``main``: the ``--out`` its :func:`check_dirs` staged is renamed
    into place when ``main`` returns 0, and removed when it fails or stops (Ctrl-C), keeping
    only the report in ``<out>.failed/``; messages that name the staging folder name that
    instead. Nothing the user had in ``--out`` changes unless the script succeeds."""

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        depth = len(_STAGED)
        try:
            code = main(argv)
        except BaseException as exc:
            while len(_STAGED) > depth:
                work, out = _STAGED.pop()
                _finish_stage(work, out, ok=False)
                if isinstance(exc, PrepError) and exc.args:
                    exc.args = (str(exc.args[0]).replace(str(work), str(out.parent / f"{out.name}.failed")),
                                *exc.args[1:])
            raise
        while len(_STAGED) > depth:
            work, out = _STAGED.pop()
            _finish_stage(work, out, ok=code == 0)
        return code

    return wrapper

