"""What is wrong with a data_prep input, in words: :class:`PrepError`, what keeps a path from
being read as a file (:func:`file_problem`), file names made printable. The bottom of medfl.prep."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from medfl.data.source import DataError

__all__ = ["PrepError", "NotDownloaded", "NOT_DOWNLOADED", "PRESENT_ONLY_HINT", "file_problem", "check_file",
           "printable"]


class PrepError(DataError):
    """Bad input to a data_prep script; the message names the file or field and what was
    expected. ``item`` is the file (or record) concerned, for the skip report."""

    def __init__(self, message: str, item: str | Path | None = None) -> None:
        super().__init__(message)
        self.item = str(item) if item is not None else ""


class NotDownloaded(PrepError):
    """A sample the metadata lists whose file is not under ``--raw`` at all: a partial
    download, which ``--present-only`` prepares without (a file that is there but unreadable
    is a plain :class:`PrepError`)."""


#: the skipped.csv stage of a sample whose file was not downloaded (``--present-only``)
NOT_DOWNLOADED = "not downloaded"

#: the hint a stop on an absent file ends with
PRESENT_ONLY_HINT = ("; if the download is partial, pass --present-only to prepare the samples "
                     "that are present (the others are listed in skipped.csv)")


def file_problem(path: str | Path) -> str:
    """What keeps ``path`` from being read as a file, in a few words: ``""`` for a non-empty
    regular file this process may read, ``"not found"`` where nothing is (not even a link),
    else ``"a directory"``, ``"a symlink loop (...)"``, ``"a broken symlink (...)"``,
    ``"an empty file (0 bytes)"``, ``"unreadable (permission denied)"``, ``"a FIFO, socket or
    device"``. Nothing is read (``stat`` only)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        if not os.path.islink(path):
            return "not found" if exc.errno in (errno.ENOENT, errno.ENOTDIR) else f"unreadable ({exc.strerror})"
        target = os.readlink(path)
        if exc.errno == errno.ELOOP:
            return f"a symlink loop (-> {target}, which leads back to itself)"
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return f"a broken symlink (-> {target}, which does not exist)"
        return f"a symlink (-> {target}) that cannot be followed ({exc.strerror})"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if not stat.S_ISREG(st.st_mode):
        return "a FIFO, socket or device"
    if st.st_size == 0:
        return "an empty file (0 bytes)"
    if not os.access(path, os.R_OK):
        return "unreadable (permission denied)"
    return ""


def check_file(path: Path, expected: str) -> Path:
    """``path``, when it is a non-empty regular file this process may read (:func:`file_problem`).

    Args:
        expected: what it should be, for the message ("the JPEG image of ...").

    Raises:
        NotDownloaded: nothing at ``path``, not even a broken link.
        PrepError: one line naming what is there instead (a directory, a symlink loop, an empty
            file...); never with the ``--present-only`` hint, since the path exists.
    """
    problem = file_problem(path)
    if problem:
        raise (NotDownloaded if problem == "not found" else PrepError)(f"{path}: {problem}; expected {expected}", path)
    return path


def printable(text: str) -> str:
    """``text`` as valid UTF-8 text: the bytes of a file name that is not UTF-8 (which
    Python holds as surrogate escapes, ``b'\\xff'`` as ``'\\udcff'``) become ``\\xNN``
    escapes, so that a manifest, ``skipped.csv``, a report or a message can hold it."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:       # a lone surrogate that is not an escaped byte
        return text.encode("utf-8", "backslashreplace").decode("utf-8")

