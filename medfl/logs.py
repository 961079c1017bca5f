"""medfl's logging: every module logs to a logger under ``medfl`` (``logging.getLogger(__name__)``;
the built-in plugins of ``medfl_plugins`` under ``medfl.plugins.<module>``, :func:`plugin_logger`),
so one logger, ``medfl``, says where all of it goes.

Library code never adds a handler when it is imported. Entry points do:

- the ``medfl`` command, ``python -m medfl.prep...``, ``python -m medfl.fixtures``, the
  Flower launcher and :func:`medfl.bundle.run` call :func:`configure_console` (or
  :func:`ensure_console`) (a handler on ``medfl`` that writes each line
  as it was always printed, to the *current* ``sys.stderr``), unless the application has
  configured logging itself (:func:`app_configured`). While that handler is installed the
  ``medfl`` logger does not propagate to the root logger, so a root handler that another
  library adds later (``logging.basicConfig`` on import: Opacus, ``mlflow.pytorch``) neither
  prints medfl's lines a second time nor shows its DEBUG lines; a test runner's capture on the
  root logger (pytest's ``caplog``) still gets every record (:class:`CaptureRelay`);
- a MONAI bundle run (``python -m monai.bundle run``) configures them from the bundle's
  ``configs/logging.conf``.

While a run is active its directory gets a ``log.txt`` (:class:`FileLog`): everything logged
under ``medfl`` by the thread that runs it, with timestamps and levels, appended across
resumes. The engine's :class:`medfl.rundir.RunDir` attaches it with the run's lock and
detaches it with the lock's release; the experiment directory and a Flower site's work
directory get theirs the same way.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["ROOT", "LOG_FILE", "FILE_FORMAT", "StderrHandler", "CaptureRelay", "console_level", "configure_console",
           "app_configured", "ensure_console", "remove_console", "FileLog", "file_log", "plugin_logger", "Throttle",
           "NO_PROGRESS_ENV", "progress_bar_disabled"]

#: The logger every medfl message goes through (its children: one per module).
ROOT = "medfl"
#: The log file of a run directory, an experiment directory and a Flower site's work directory.
LOG_FILE = "log.txt"
#: How a line of :data:`LOG_FILE` reads.
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class StderrHandler(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is when a record is emitted
    (as ``print(..., file=sys.stderr)`` did), so a redirected or captured stderr (pytest's
    ``capsys``, a subprocess pipe, ``contextlib.redirect_stderr``) gets the line as it reads."""

    def __init__(self, level: int = logging.NOTSET) -> None:
        super().__init__(sys.stderr)
        self.setLevel(level)
        self.setFormatter(logging.Formatter("%(message)s"))

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201 - the current sys.stderr
        """The current ``sys.stderr``."""
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001 - the base class assigns it; always sys.stderr
        pass

    def format(self, record: logging.LogRecord) -> str:
        """The line, with a path that is not UTF-8 (``'\\udcff'`` for the byte ``\\xff``)
        escaped as ``\\udcff``, as Python's own stderr writes it: a stderr that refuses such
        characters (a pipe opened strict, pytest's capture) gets the line, not a traceback."""
        return super().format(record).encode("utf-8", "backslashreplace").decode("utf-8")


def _printable_stdout() -> None:
    """Let ``print`` write a path that is not UTF-8 (a folder named with the byte ``\\xff``)
    as ``\\udcff`` instead of stopping with ``UnicodeEncodeError``: a UTF-8 locale other than
    C opens stdout strict. Only a stdout that is still the interpreter's own is changed."""
    out = sys.stdout
    if out is sys.__stdout__ and isinstance(out, io.TextIOWrapper) and out.errors == "strict":
        out.reconfigure(errors="backslashreplace")


def console_level(verbose: int = 0, quiet: int = 0) -> int:
    """The console's level for ``-v``/``-q`` counts: INFO by default, DEBUG with ``-v``,
    WARNING with ``-q`` (``-qq``: ERROR only)."""
    if verbose and not quiet:
        return logging.DEBUG
    if quiet:
        return logging.WARNING if quiet == 1 else logging.ERROR
    return logging.INFO


def _is_capture(handler: logging.Handler) -> bool:
    """Whether ``handler`` is a test runner's capture (pytest's ``caplog`` and its reports),
    which collects records but shows no user anything: not an application's configuration."""
    return type(handler).__module__.startswith("_pytest")


class CaptureRelay(logging.Handler):
    """Installed with medfl's console (:func:`configure_console`), which keeps medfl's records
    from the root logger: hands each record to the test runner's captures on the root logger
    (pytest's ``caplog`` and its reports, :func:`_is_capture`), which show no user anything, as
    propagation did; not one that is on ``medfl`` itself too (pytest 9 attaches its captures
    to the loggers that do not propagate), which has the record already. Any other root
    handler (one a library added with ``logging.basicConfig``) gets nothing from medfl."""

    def emit(self, record: logging.LogRecord) -> None:
        """Pass ``record`` to each capture on the root logger whose level it reaches."""
        own = logging.getLogger(ROOT).handlers
        for h in logging.getLogger().handlers:
            if _is_capture(h) and h not in own and record.levelno >= h.level:
                h.handle(record)


def app_configured() -> bool:
    """Whether the application configured logging itself: a handler (other than medfl's own
    console and run logs, and a test runner's capture) on the root logger or on ``medfl``
    (``logging.basicConfig``, ``logging.config.fileConfig`` of a bundle's ``logging.conf``)."""
    for name in ("", ROOT):
        for h in logging.getLogger(name).handlers:
            if not isinstance(h, (StderrHandler, _RunFileHandler, CaptureRelay)) and not _is_capture(h):
                return True
    return False


def _shown() -> bool:
    """Whether some handler shows medfl's warnings: one on ``medfl`` or the root logger other
    than the run logs and a test runner's capture."""
    return any(not isinstance(h, (_RunFileHandler, CaptureRelay)) and not _is_capture(h)
               for name in ("", ROOT) for h in logging.getLogger(name).handlers)


#: The attribute of the console handler that keeps the ``medfl`` logger's ``propagate`` from
#: before :func:`configure_console` (put back by :func:`remove_console`).
_PROPAGATE = "_medfl_propagate"


def remove_console() -> None:
    """Take the console handler :func:`configure_console` added off ``medfl`` (and close it);
    ``medfl`` propagates to the root logger again as it did before."""
    log = logging.getLogger(ROOT)
    for h in [h for h in log.handlers if isinstance(h, (StderrHandler, CaptureRelay))]:
        log.removeHandler(h)
        if hasattr(h, _PROPAGATE):
            log.propagate = bool(getattr(h, _PROPAGATE))
        h.close()


def configure_console(level: int = logging.INFO, force: bool = False) -> logging.Handler | None:
    """For an entry point: print medfl's messages on stderr at ``level`` and above, each line
    as it reads (``%(message)s``: the messages name their run and say ``warning:`` themselves),
    unless the application configured logging (:func:`app_configured`; ``force``: regardless).
    A strict stdout prints paths that are not UTF-8 escaped from then on (``_printable_stdout``).

    The ``medfl`` logger itself is set to DEBUG so that a run's ``log.txt`` gets the details
    (per-epoch progress) whatever the console shows, and stops propagating to the root logger
    while the handler is installed (the module docstring says why; :class:`CaptureRelay`).
    Calling it again replaces the handler (never two). Returns the handler, or ``None`` when the
    application's configuration stays.
    """
    if not force and app_configured():
        return None
    _printable_stdout()
    remove_console()
    handler = StderrHandler(level)
    log = logging.getLogger(ROOT)
    setattr(handler, _PROPAGATE, log.propagate)
    log.addHandler(handler)
    log.addHandler(CaptureRelay())
    log.propagate = False
    log.setLevel(logging.DEBUG)
    return handler


def ensure_console() -> logging.Handler | None:
    """For an entry point that another may have started (``medfl.bundle.run``, called by the
    ``medfl`` command and by ``python -m monai.bundle run``): :func:`configure_console` at INFO
    only when nothing shows medfl's messages yet (no handler of the application's, a bundle's
    ``logging.conf`` or the ``medfl`` command's own)."""
    return None if _shown() else configure_console(logging.INFO, force=True)


def plugin_logger(module: str) -> logging.Logger:
    """The logger of a built-in plugin module (``medfl_plugins.pfedcdp`` -> ``medfl.plugins.pfedcdp``):
    under ``medfl``, so a ``logging.conf`` that sets ``medfl`` sets the plugins too."""
    return logging.getLogger(f"{ROOT}.plugins.{module.rsplit('.', 1)[-1]}")


class _RunFileHandler(logging.FileHandler):
    """A run's ``log.txt``: the records of one thread (the one running the run), so runs and
    simulated sites in other threads of the process keep to their own files. A path that is
    not UTF-8 (a folder named with the byte ``\\xff``, held as ``'\\udcff'``) is written
    escaped (``\\udcff``), so the file stays UTF-8 and the record is kept."""

    def __init__(self, path: Path, thread: int, header: logging.LogRecord) -> None:
        super().__init__(path, mode="a", encoding="utf-8", delay=True, errors="backslashreplace")
        self.thread = thread
        self.header: logging.LogRecord | None = header
        self.setLevel(logging.DEBUG)
        self.setFormatter(logging.Formatter(FILE_FORMAT))

    def filter(self, record: logging.LogRecord) -> bool:  # type: ignore[override]
        """Only the records logged by the thread that opened the file."""
        return record.thread == self.thread and bool(super().filter(record))

    def emit(self, record: logging.LogRecord) -> None:
        """Write ``record``, after the file's header line when it is the first: a directory
        where nothing was logged (a resume refused before it changed anything) is left as it was."""
        if self.header is not None:
            header, self.header = self.header, None
            super().emit(header)
        super().emit(record)


class FileLog:
    """A directory's ``log.txt`` (:data:`LOG_FILE`) while something runs in it: :meth:`attach`
    adds a DEBUG file handler to the ``medfl`` logger (appending: a resumed run continues the
    same file), :meth:`detach` removes and closes it. Attaching twice is one handler; detaching
    when not attached does nothing, so a run's ``finally`` may always detach.

    The file holds what is logged, nothing else: medfl logs run-level facts (rounds, clients,
    losses averaged over a client's epoch, warnings), never a sample.

    Args:
        directory: where ``log.txt`` is written (created if missing).
    """

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / LOG_FILE
        self.handler: _RunFileHandler | None = None
        self._console: StderrHandler | None = None   # the warnings' console while nothing else shows them
        self._level: int | None = None               # the medfl logger's level before attach set it

    @property
    def attached(self) -> bool:
        """Whether the file handler is on the ``medfl`` logger now."""
        return self.handler is not None

    def attach(self, header: str = "") -> None:
        """Start writing this directory's log (``header``: said in the file's first line, written
        with the first record; the file is created then, not before)."""
        if self.handler is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        log = logging.getLogger(ROOT)
        if not _shown():
            # nothing shows medfl's warnings but Python's last resort, which a file handler would
            # silence: show them as it did, until detach
            self._console = StderrHandler(logging.WARNING)
            log.addHandler(self._console)
        # the file's own first line, written before its first record (no console shows it)
        opened = logging.LogRecord(f"{ROOT}.logs", logging.INFO, __file__, 0, "log opened (pid %d)%s",
                                   (os.getpid(), f": {header}" if header else ""), None)
        self.handler = _RunFileHandler(self.path, threading.get_ident(), opened)
        log.addHandler(self.handler)
        if log.level == logging.NOTSET:   # nothing configured: the file still gets medfl's INFO lines
            self._level = log.level
            log.setLevel(logging.INFO)

    def detach(self) -> None:
        """Stop writing this directory's log; close the file."""
        if self.handler is None:
            return
        handler, self.handler = self.handler, None
        log = logging.getLogger(ROOT)
        for h in (handler, self._console):
            if h is not None:
                log.removeHandler(h)
                h.close()
        self._console = None
        if self._level is not None:
            log.setLevel(self._level)
            self._level = None


@contextmanager
def file_log(directory: str | Path, header: str = "") -> Iterator[FileLog]:
    """:class:`FileLog` of ``directory`` attached for the ``with`` block (detached however it
    ends)."""
    log = FileLog(directory)
    log.attach(header)
    try:
        yield log
    finally:
        log.detach()


class Throttle:
    """Says whether a periodic progress line is due: at most one every ``every_s`` seconds
    (the first one only after ``every_s``), so a long loop says where it is without a line
    per step in a CI log.

    Args:
        every_s: the shortest time between two lines, in seconds.
        clock: the time source (``time.monotonic``).
    """

    def __init__(self, every_s: float, clock=time.monotonic) -> None:  # noqa: ANN001 - a clock
        self.every_s = float(every_s)
        self.clock = clock
        self.last = clock()

    def due(self) -> bool:
        """Whether a line is due now (and if so, the next one is ``every_s`` from now)."""
        now = self.clock()
        if now - self.last >= self.every_s:
            self.last = now
            return True
        return False


#: The environment variable that turns every progress bar off (set to anything but ``""``,
#: ``0``, ``false``, ``no``), as ``fl.progress: false`` does for a run's.
NO_PROGRESS_ENV = "MEDFL_NO_PROGRESS"


def progress_bar_disabled(wanted: bool = True) -> bool | None:
    """tqdm's ``disable`` for a progress bar on stderr: ``True`` (no bar) where progress is not
    ``wanted`` (a run's ``fl.progress``) or :data:`NO_PROGRESS_ENV` is set, else ``None``:
    tqdm then draws the bar only where stderr is a terminal, so a redirected stderr
    (``medfl run ... 2> log.txt``, CI) gets no bar frames."""
    if not wanted or os.environ.get(NO_PROGRESS_ENV, "").strip().lower() not in ("", "0", "false", "no"):
        return True
    return None
