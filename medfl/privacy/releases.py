"""Who released what: a site's ledger of its DP releases and the coordinator's journal of the
DP releases it received.

A differential-privacy release is safe to repeat only as the very same bytes. Asked again
with another noise multiplier, a site that drew the same standard-normal noise at the new
scale would hand the coordinator two equations in two unknowns (``u + s1 z`` and ``u + s2 z``)
from which it solves the clipped value ``u`` exactly. Both ends therefore keep a durable
record, appended and flushed to disk (``fsync``) before the release travels on:

* a **site** (:class:`SiteReleaseLedger`, ``<state-dir>/<run id>/site_<client>/releases.jsonl``
  and the released replies under ``releases/``) records, for every training reply that
  carries a DP release, the run, round, client, step, mechanisms with their noise multiplier
  and clip, a digest of the released bytes and a digest of the instruction that asked for
  it. A second request for the same (run, round, client, step) gets the stored reply, byte
  for byte, when its instruction is the same; any other instruction (another noise
  multiplier, another clip, another mechanism, another model) is refused with a
  :class:`ReleaseRefused` naming the rule.
* the **coordinator** (:class:`ReleaseJournal`, ``<run dir>/releases.jsonl``) records every
  DP reply it received (round, step, client, the resolved filter chain and DP-SGD settings it
  was released under, the digest of what arrived) before the round's checkpoint. A resumed
  run re-runs a round released before the crash under the journaled parameters (so a site
  replays the same bytes, and in process the same seeds give them again) and counts in
  ``privacy.csv`` every release it saw whose bytes differ (:meth:`ReleaseJournal.extra`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from medfl.integrity import append_text

__all__ = ["payload_digest", "append_record", "read_records", "ReleaseRefused", "SiteReleaseLedger",
           "ReleaseJournal", "asked_releases", "ledger_releases", "LEDGER_FILE", "JOURNAL_FILE"]

#: The site's ledger, in its run directory (``<state-dir>/<run id>/site_<client>/``).
LEDGER_FILE = "releases.jsonl"
#: The coordinator's journal, in the method's run directory.
JOURNAL_FILE = "releases.jsonl"


def _feed(h: Any, value: Any) -> None:
    """Feed a canonical encoding of ``value`` (tensors, arrays, numbers, strings, lists and
    dicts of them) into the hash ``h``: dict keys sorted, tensors by dtype, shape and bytes."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif hasattr(value, "__array_interface__"):
        _feed(h, torch.as_tensor(value))
    elif isinstance(value, dict):
        h.update(f"D{len(value)}".encode())
        for k in sorted(value, key=str):
            _feed(h, str(k))
            _feed(h, value[k])
    elif isinstance(value, (list, tuple)):
        h.update(f"L{len(value)}".encode())
        for v in value:
            _feed(h, v)
    else:
        h.update(f"S{type(value).__name__}:{value!r};".encode())


def payload_digest(*values: Any) -> str:
    """SHA-256 (hex) of the canonical encoding of ``values`` (payload trees, control fields):
    equal for equal bytes, in any process. What it is for: recognising the same release, and
    the same instruction, again."""
    h = hashlib.sha256()
    for v in values:
        _feed(h, v)
    return h.hexdigest()


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line to ``path`` and flush it to disk (``fsync``) before
    returning: a record written before a release leaves survives a crash right after."""
    path.parent.mkdir(parents=True, exist_ok=True)
    append_text(path, json.dumps(record, sort_keys=True) + "\n", sync=True)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file written by :func:`append_record` (none when it does
    not exist). A last line cut short by a crash during its write is ignored (its release
    had not left yet: the record is written before)."""
    if not path.is_file():
        return []
    out = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not a JSON record; the file was changed") from None
    return out


def _fsync_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` atomically (a temporary file, flushed, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


class ReleaseRefused(RuntimeError):
    """A site refuses to release again what it released before under another instruction."""


class SiteReleaseLedger:
    """A site's own ledger of the DP releases it made in one run (see the module docstring).

    Args:
        root: the site's directory for the run (``<state-dir>/<run id>/site_<client>``).
        where: who keeps it, for messages (``"medfl site 0"``).
    """

    def __init__(self, root: Path, where: str) -> None:
        self.root = Path(root)
        self.path = self.root / LEDGER_FILE
        self.where = where

    def _reply_path(self, round: int, step: int) -> Path:
        return self.root / "releases" / f"round_{int(round):04d}_step_{int(step)}.pt"

    def records(self) -> list[dict[str, Any]]:
        """Every record of the ledger, oldest first."""
        return read_records(self.path)

    def replay(self, run: str, round: int, client: str, step: int, mechanisms: list[dict[str, Any]],
               instruction: str) -> tuple[Any, int, dict[str, Any]] | None:
        """What to answer a request for the release of (``run``, ``round``, ``client``,
        ``step``) asked by an instruction of digest ``instruction``: ``None`` when this site
        has not released it yet, else the reply it released (payload, num_examples, metrics),
        to send again as it was.

        Raises:
            ReleaseRefused: the release was made under another instruction (another noise
                multiplier, clip, mechanism or model): naming the rule and both settings.
        """
        done = [r for r in self.records() if (r["run"], int(r["round"]), str(r["client"]), int(r["step"]))
                == (run, int(round), str(client), int(step))]
        if not done:
            return None
        first = done[0]
        if first["instruction"] != instruction:
            raise ReleaseRefused(
                f"{self.where}: refused to release round {round} step {step} of run {run} again: it was released "
                f"under another instruction ({_describe(first['mechanisms'])}; now {_describe(mechanisms)}). "
                "Rule: a site releases each (run, round, client, step) once; a repeated request gets the same bytes "
                "only for the same instruction, never a new draw at another noise level "
                f"(ledger {self.path})")
        path = self._reply_path(round, step)
        if not path.is_file():
            raise ReleaseRefused(f"{self.where}: round {round} step {step} of run {run} was released (ledger "
                                 f"{self.path}) but the released reply {path} is gone, so it cannot be sent again "
                                 "as it was; refused (rule: a release is repeated as the same bytes or not at all)")
        saved = torch.load(path, weights_only=True)
        if payload_digest(saved["payload"]) != first["released"]:
            raise ReleaseRefused(f"{self.where}: the released reply {path} does not match the digest in the ledger "
                                 f"{self.path}; refused to send it")
        return saved["payload"], int(saved["num_examples"]), dict(saved["metrics"])

    def record(self, run: str, round: int, client: str, step: int, mechanisms: list[dict[str, Any]],
               instruction: str, payload: Any, num_examples: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Keep the reply (flushed to disk) and append one ledger record for it, before it
        leaves the site; return the record."""
        _fsync_save({"payload": payload, "num_examples": int(num_examples), "metrics": dict(metrics)},
                    self._reply_path(round, step))
        rec = {"run": run, "round": int(round), "client": str(client), "step": int(step),
               "mechanisms": mechanisms, "released": payload_digest(payload), "instruction": instruction}
        append_record(self.path, rec)
        return rec


    def prune(self, upto: int) -> None:
        """Delete the kept replies of rounds up to ``upto`` (the coordinator's oldest kept
        checkpoint: a resume never asks for them again); their ledger records stay, so a
        request for one of them is refused, never answered with a new draw."""
        folder = self.root / "releases"
        if upto <= 0 or not folder.is_dir():
            return
        for path in folder.glob("round_*_step_*.pt"):
            if int(path.name.split("_")[1]) <= upto:
                path.unlink(missing_ok=True)


def ledger_releases(state_dir: Path) -> dict[tuple[str, int, str, int], Path]:
    """Every release the site ledgers in a site's ``state_dir`` record
    (``<run id>/site_<client>/releases.jsonl``): ``(run, round, client, step)`` -> the ledger.
    What the site's budget (:mod:`medfl.budget`) must count.

    Raises:
        ValueError: a ledger line other than its last is not a JSON record.
    """
    out = {}
    for path in sorted(Path(state_dir).glob(f"*/site_*/{LEDGER_FILE}")):
        for r in read_records(path):
            out[(str(r["run"]), int(r["round"]), str(r["client"]), int(r["step"]))] = path
    return out


def _describe(mechanisms: list[dict[str, Any]]) -> str:
    return ", ".join(f"{m['mechanism']} at noise multiplier {m['noise_multiplier']:.6g}, clip {m['clip']:.6g}"
                     for m in mechanisms) or "no mechanism"


class ReleaseJournal:
    """The coordinator's journal of the DP releases it received (see the module docstring).

    Args:
        run_dir: the method's run directory.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / JOURNAL_FILE
        self._records: list[dict[str, Any]] | None = None   # read once, then kept in step with the file

    def records(self) -> list[dict[str, Any]]:
        """Every record, oldest first."""
        if self._records is None:
            self._records = read_records(self.path)
        return self._records

    def note(self, round: int, step: int, client: str, filters: list[dict[str, Any]], dp: dict[str, Any] | None,
             payload: Any) -> None:
        """Record one DP reply as it arrived (before the filters are undone), flushed to disk."""
        rec = {"round": int(round), "step": int(step), "client": str(client), "filters": filters, "dp": dp,
               "digest": payload_digest(payload)}
        self.records()
        append_record(self.path, rec)
        assert self._records is not None
        self._records.append(json.loads(json.dumps(rec)))

    def after(self, round: int) -> dict[int, list[dict[str, Any]]]:
        """The records of rounds after ``round`` (released, then lost to a crash before the
        round's checkpoint), by round."""
        out: dict[int, list[dict[str, Any]]] = {}
        for rec in self.records():
            if int(rec["round"]) > round:
                out.setdefault(int(rec["round"]), []).append(rec)
        return out

    def extra(self, round: int, counted: dict[str, int]) -> dict[str, int]:
        """Per client, the releases of ``round`` the coordinator received beyond the
        ``counted`` ones: distinct (step, bytes) it journaled, less those counted. A release
        re-run after a crash that came back as the same bytes is one release; one that came
        back different is two, and the ledger must count both."""
        seen: dict[str, set[tuple[int, str]]] = {}
        for rec in self.records():
            if int(rec["round"]) == round:
                seen.setdefault(str(rec["client"]), set()).add((int(rec["step"]), str(rec["digest"])))
        return {cid: len(s) - counted.get(cid, 0) for cid, s in seen.items() if len(s) > counted.get(cid, 0)}


def asked_releases(method: Any, chain: Any, train: dict[str, Any], instruction: Any) -> list[dict[str, Any]]:
    """The DP releases a training instruction asks a client for: one entry (``mechanism``,
    ``noise_multiplier``, ``clip``) per DP filter of ``chain`` (a :class:`medfl.filters.FilterChain`),
    for DP-SGD when ``train`` has ``dp``, and for the method's own release
    (``Method.release_plan``) when the instruction is its release (``config["dp_release"]``).
    Empty: the reply is no DP release (no ledger record)."""
    from medfl.messages import RELEASE_FLAG

    out = [{"mechanism": r.mechanism, "noise_multiplier": float(r.noise_multiplier), "clip": float(r.clip)}
           for r in chain.releases()]
    dp = train.get("dp")
    if isinstance(dp, dict):
        out.append({"mechanism": "dp_sgd", "noise_multiplier": float(dp["noise_multiplier"]),
                    "clip": float(dp["max_grad_norm"])})
    if instruction.config.get(RELEASE_FLAG) is True:
        rel = method.release_plan()
        if rel is not None:
            out.append({"mechanism": rel.mechanism, "noise_multiplier": float(rel.noise_multiplier),
                        "clip": float(rel.clip)})
    return out
