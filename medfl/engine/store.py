"""A client's persistent state on disk, versioned by round (:class:`ClientStore`): what the
in-process engine keeps under a run's ``clients/`` and ``eval_state/`` and a Flower site
under its own state directory, each file with its checksum sidecar
(:mod:`medfl.integrity`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable

import torch

from medfl.integrity import check_sum, sha256_file, sum_path, write_summed

__all__ = ["ClientStore"]

_STATE_RE = re.compile(r"state_r(\d+)\.pt$")

class ClientStore:
    """Per-client persistent state as versioned files ``<root>/<client_id>/state_rNNNN.pt``.

    A client's state after round ``r`` is written to ``state_r{r}``; loading for round ``r``
    takes the newest file from an earlier round. Because old versions are kept until the
    coordinator's checkpoint has moved past them, a run killed mid-round resumes from a
    consistent state. Only one client's state is in memory at a time.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _files(self, client_id: str) -> list[tuple[int, Path]]:
        d = self.root / client_id
        if not d.is_dir():
            return []
        out = []
        for p in d.iterdir():
            m = _STATE_RE.search(p.name)
            if m:
                out.append((int(m.group(1)), p))
        return sorted(out)

    def has(self, client_id: str) -> bool:
        """Whether any state of ``client_id`` was saved."""
        return bool(self._files(client_id))

    def load(self, client_id: str, before_round: int) -> dict[str, Any]:
        """The newest saved state of ``client_id`` from a round earlier than ``before_round``.

        Raises:
            RuntimeError: the file does not match the checksum written with it (naming it).
        """
        files = [p for r, p in self._files(client_id) if r < before_round]
        if not files:
            return {}
        problem = check_sum(files[-1])
        if problem:
            raise RuntimeError(f"client {client_id}'s saved state {files[-1]}: {problem}")
        return torch.load(files[-1], map_location="cpu", weights_only=True)

    def save(self, client_id: str, round: int, state: dict[str, Any]) -> None:
        """Write ``state`` as the client's state after ``round`` (atomically), with a sidecar
        ``.sha256`` of the file that :meth:`load` and :meth:`verify` check."""
        d = self.root / client_id
        d.mkdir(parents=True, exist_ok=True)
        write_summed(d / f"state_r{round:04d}.pt", lambda f: torch.save(state, f), d / f".state_r{round:04d}.pt.tmp")

    def index(self, upto_round: int) -> dict[str, list[Any]]:
        """``{client_id: [round, sha256]}`` of each client's newest state from a round up to
        ``upto_round``: what a checkpoint of that round records, so a resume can check that
        the states it continues from are the ones the checkpoint was taken with."""
        out: dict[str, list[Any]] = {}
        if not self.root.is_dir():
            return out
        for d in sorted(self.root.iterdir()):
            files = [(r, p) for r, p in self._files(d.name) if r <= upto_round]
            if files:
                r, p = files[-1]
                side = sum_path(p)
                out[d.name] = [r, side.read_text().split()[0] if side.is_file() else sha256_file(p)]
        return out

    def verify(self, index: dict[str, list[Any]]) -> list[str]:
        """Problems with the states ``index`` (:meth:`index`) names: missing or changed files."""
        problems = []
        for cid, (r, digest) in sorted(index.items()):
            path = self.root / cid / f"state_r{int(r):04d}.pt"
            if not path.is_file():
                problems.append(f"client {cid}'s state of round {int(r)} is missing ({path})")
            elif sha256_file(path) != digest:
                problems.append(f"client {cid}'s state of round {int(r)} changed since the checkpoint ({path})")
        return problems

    def prune(self, upto_round: int, pinned: Iterable[int] = ()) -> None:
        """Drop versions no longer needed once the checkpoint of ``upto_round`` exists (the
        run passes its *oldest* kept checkpoint, so each kept checkpoint keeps its states).

        Args:
            upto_round: the oldest kept checkpoint's round.
            pinned: rounds of older checkpoints the run keeps as well (early stopping's best
                round): each keeps the version it records, the newest one up to that round.
        """
        if not self.root.is_dir():
            return
        rounds = sorted({int(upto_round), *(int(p) for p in pinned)})
        for d in self.root.iterdir():
            files = self._files(d.name)
            keep = {q for k in rounds for q in [p for r, p in files if r <= k][-1:]}
            for r, p in files:
                if r <= upto_round and p not in keep:
                    _unlink_with_sum(p)

    def rollback(self, after_round: int) -> None:
        """Delete versions written after ``after_round`` (a resumed run redoes them)."""
        if not self.root.is_dir():
            return
        for d in self.root.iterdir():
            for r, p in self._files(d.name):
                if r > after_round:
                    _unlink_with_sum(p)


def _unlink_with_sum(path: Path) -> None:
    """Delete ``path`` and its checksum sidecar (either may be gone)."""
    path.unlink(missing_ok=True)
    sum_path(path).unlink(missing_ok=True)
