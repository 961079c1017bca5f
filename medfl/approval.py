"""Which plugin code a site runs: its operator's approvals.

A method's client code runs at the site, next to the data, and whatever it returns leaves
the site; no check of the returned message can stop code written to leak (the payload
guard, :mod:`medfl.guard`, catches mistakes). What real federations do against untrusted
code is have the data holder approve the code beforehand: Fed-BioMed's nodes, for example,
only train with training plans whose hash their operator approved. medfl does the same
for plugins. Unlike Fed-BioMed, the coordinator never ships code: it names a method, and
the site runs the plugin of that name *installed at the site*. An approval pins that
installed code:

``kind``, ``name``
    what the coordinator asks for (``method``; ``filter`` and any later plugin kind whose
    code runs on the site's data: :data:`APPROVED_KINDS`);
``distribution``, ``version``
    the installed distribution that registered it (``medfl`` for the built-ins);
``sha256``
    a hash of the plugin's source files: every ``.py`` file of the top-level package of
    the module that defines it (``medfl_plugins`` for the built-ins: ``plugins/*.py``), or
    the module file alone when it is not in a package.

``medfl approve NAME --file approvals.json`` records the identity of an installed plugin
(after the operator has reviewed it); ``medfl flower site ... --approvals approvals.json``
(or ``MEDFL_APPROVALS=approvals.json`` in the environment of a plain ``flower-supernode``)
makes the site refuse, on every message and before any plugin code runs, a method that is
not in the file or whose version or code differs. The file is read again for every
message, so approving or revoking takes effect without restarting the site.

Without an approvals file a site runs any method installed in its environment (it says so
when it starts and once for each method it runs). That is the default because a site can
only ever run plugins its operator installed (nothing is downloaded from the coordinator;
``MEDFL_LOAD_PLUGINS`` restricts which installed third-party plugins load), and because
one-machine trials and tests need no file; real deployments should pass ``--approvals``.

Not covered: code that runs when plugins are imported (every installed entry point is
imported when medfl loads its plugins; restrict them with ``MEDFL_LOAD_PLUGINS``), model
plugins (models are built from registered model factories but are not approved here), and
medfl itself (the framework, pinned by the ``version`` of the built-ins' approvals).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import inspect
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

__all__ = ["APPROVALS_ENV", "APPROVED_KINDS", "ApprovalError", "CodeIdentity", "Approvals", "code_identity",
           "required", "check_control", "approvals_path"]

#: Environment variable naming a site's approvals file (``medfl flower site --approvals`` sets it).
APPROVALS_ENV = "MEDFL_APPROVALS"
#: Plugin kinds whose code a site runs on its data and whose output leaves the site.
APPROVED_KINDS: tuple[str, ...] = ("method", "filter")
_FORMAT = 1
_HASHES: dict[tuple[str, int, int], str] = {}   # (file, mtime_ns, size) -> sha256 of its bytes
_WARNED: set[tuple[str, str, str]] = set()


class ApprovalError(RuntimeError):
    """A plugin is not approved, its code changed, or the approvals file is unusable."""


@dataclass(frozen=True)
class CodeIdentity:
    """What identifies one registered plugin's code.

    Attributes:
        kind: the plugin kind (``method``, ``filter``...).
        name: the registered name.
        distribution: the installed distribution that provides it.
        version: that distribution's version.
        sha256: hash of its source files (see the module docstring).
        files: those files, relative to the directory holding the package.
    """

    kind: str
    name: str
    distribution: str
    version: str
    sha256: str
    files: tuple[str, ...]

    def describe(self) -> str:
        """``method 'fedavg' (medfl 0.1.0, sha256 1a2b3c4d5e6f...)``."""
        return f"{self.kind} {self.name!r} ({self.distribution} {self.version}, sha256 {self.sha256[:12]}...)"


def _source_files(obj: Any, kind: str, name: str) -> tuple[Path, list[Path]]:
    """The directory that relative names start from, and the source files of ``obj``'s code."""
    module = inspect.getmodule(obj)
    path = None
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:
        pass
    if module is None or path is None:
        raise ApprovalError(f"{kind} {name!r} has no source file (defined interactively or in compiled code); "
                            "only plugins installed from source files can be approved")
    top = sys.modules.get(module.__name__.split(".")[0])
    roots = [Path(p) for p in getattr(top, "__path__", [])] if top is not None else []
    if not roots:
        file = Path(path).resolve()
        return file.parent, [file]
    files = sorted({f.resolve() for r in roots for f in Path(r).rglob("*.py") if "__pycache__" not in f.parts})
    return Path(roots[0]).resolve().parent, files


def _file_hash(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_mtime_ns, st.st_size)
    digest = _HASHES.get(key)
    if digest is None:
        digest = _HASHES[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest


def _distribution(obj: Any, registered_dist: str, registered_version: str) -> tuple[str, str]:
    if registered_dist and not registered_dist.startswith("("):
        return registered_dist, registered_version
    top = (getattr(obj, "__module__", "") or "").split(".")[0]
    dists = md.packages_distributions().get(top, [])
    if dists:
        try:
            return dists[0], md.version(dists[0])
        except md.PackageNotFoundError:
            pass
    return "(none: registered at runtime)", ""


def code_identity(kind: str, name: str) -> CodeIdentity:
    """The identity of the installed plugin registered as ``name`` of ``kind``.

    Raises:
        ApprovalError: no such plugin is installed here, or it has no source file.
    """
    from medfl.plugins import registry

    table = registry().get(kind)
    if table is None:
        raise ApprovalError(f"unknown plugin kind {kind!r}; kinds: {', '.join(sorted(registry()))}")
    if name not in table:
        raise ApprovalError(f"no {kind} {name!r} is installed here (installed: {', '.join(sorted(table)) or 'none'})")
    reg = table[name]
    base, files = _source_files(reg.obj, kind, name)
    h = hashlib.sha256()
    rel = []
    for f in files:
        r = f.relative_to(base).as_posix() if f.is_relative_to(base) else f.name
        rel.append(r)
        h.update(r.encode() + b"\0" + _file_hash(f).encode() + b"\n")
    dist, version = _distribution(reg.obj, reg.distribution, reg.version)
    return CodeIdentity(kind=kind, name=name, distribution=dist, version=version, sha256=h.hexdigest(),
                        files=tuple(rel))


class Approvals:
    """A site's approvals file: ``{"medfl_approvals": 1, "approved": [entry, ...]}``, each
    entry a :class:`CodeIdentity` plus when it was approved.

    Args:
        path: the file (it need not exist yet when approving).
        entries: its entries by ``(kind, name)``.
    """

    def __init__(self, path: str | Path, entries: dict[tuple[str, str], dict[str, Any]] | None = None) -> None:
        self.path = Path(path)
        self.entries = dict(entries or {})

    @classmethod
    def load(cls, path: str | Path, missing_ok: bool = False) -> "Approvals":
        """Read an approvals file.

        Raises:
            ApprovalError: the file is missing (unless ``missing_ok``) or malformed.
        """
        path = Path(path)
        if not path.is_file():
            if missing_ok:
                return cls(path)
            raise ApprovalError(f"approvals file {path} not found; create it with `medfl approve METHOD --file {path}`")
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ApprovalError(f"approvals file {path} is not readable JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("medfl_approvals") != _FORMAT or not isinstance(
                data.get("approved"), list):
            raise ApprovalError(f"approvals file {path} is not a medfl approvals file "
                                f"(expected {{\"medfl_approvals\": {_FORMAT}, \"approved\": [...]}})")
        entries: dict[tuple[str, str], dict[str, Any]] = {}
        for i, e in enumerate(data["approved"]):
            if not isinstance(e, dict) or not all(isinstance(e.get(k), str) for k in ("kind", "name", "sha256")):
                raise ApprovalError(f"approvals file {path}: entry {i} lacks kind, name or sha256")
            entries[(e["kind"], e["name"])] = e
        return cls(path, entries)

    def save(self) -> None:
        """Write the file (atomically)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"medfl_approvals": _FORMAT,
                "approved": [self.entries[k] for k in sorted(self.entries)]}
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(self.path)

    def approve(self, identity: CodeIdentity) -> None:
        """Record (or replace) the approval of ``identity``."""
        entry = asdict(identity)
        entry["files"] = list(identity.files)
        entry["approved_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.entries[(identity.kind, identity.name)] = entry

    def revoke(self, kind: str, name: str) -> bool:
        """Remove an approval; whether there was one."""
        return self.entries.pop((kind, name), None) is not None

    def refusal(self, identity: CodeIdentity) -> str | None:
        """Why ``identity`` may not run (``None``: it is approved)."""
        e = self.entries.get((identity.kind, identity.name))
        if e is None:
            return f"it is not in the approvals file {self.path}"
        if e.get("distribution") != identity.distribution or e.get("version") != identity.version:
            return (f"the approved one is {e.get('distribution')} {e.get('version')}, the installed one "
                    f"{identity.distribution} {identity.version}")
        if e["sha256"] != identity.sha256:
            approved = set(e.get("files", []))
            added = sorted(set(identity.files) - approved)
            gone = sorted(approved - set(identity.files))
            what = "its source files changed since it was approved"
            if added or gone:
                what += f" (files added: {added or 'none'}; removed: {gone or 'none'})"
            return f"{what}: sha256 {identity.sha256[:12]}..., approved {e['sha256'][:12]}..."
        return None


def approvals_path() -> Path | None:
    """The approvals file this process enforces (:data:`APPROVALS_ENV`), if any."""
    value = os.environ.get(APPROVALS_ENV, "").strip()
    return Path(value) if value else None


def required(control: dict[str, Any]) -> list[tuple[str, str]]:
    """The ``(kind, name)`` of every plugin a site message asks the site to run: its
    ``method`` and any ``filters`` (entries with a ``name``), in that order."""
    out: list[tuple[str, str]] = []
    method = control.get("method")
    if isinstance(method, dict) and "name" in method:
        out.append(("method", str(method["name"])))
    for f in control.get("filters") or []:
        if isinstance(f, dict) and "name" in f:
            out.append(("filter", str(f["name"])))
    return out


def check_control(control: dict[str, Any], who: str, path: Path | None = None,
                  kinds: Iterable[str] = APPROVED_KINDS) -> None:
    """Refuse a message whose plugins are not approved (the site's check, before any plugin
    code runs). ``path`` defaults to :func:`approvals_path`; without one, each plugin is
    allowed and announced once on stderr.

    Raises:
        ApprovalError: naming the plugin, why it is refused and how to approve it.
    """
    path = approvals_path() if path is None else path
    wanted = [(k, n) for k, n in required(control) if k in set(kinds)]
    if not wanted:
        return
    if path is None:
        for kind, name in wanted:
            if (who, kind, name) not in _WARNED:
                _WARNED.add((who, kind, name))
                print(f"{who}: running {kind} {name!r} without approval (no approvals file: this site runs any "
                      f"installed {kind} the coordinator names; see `medfl approve`)", file=sys.stderr, flush=True)
        return
    approvals = Approvals.load(path)
    for kind, name in wanted:
        try:
            identity = code_identity(kind, name)
        except ApprovalError as exc:
            raise ApprovalError(f"refused {kind} {name!r}: {exc}") from None
        reason = approvals.refusal(identity)
        if reason is not None:
            raise ApprovalError(
                f"refused {identity.describe()}: {reason}. The site operator can review its code "
                f"({', '.join(identity.files[:4])}{', ...' if len(identity.files) > 4 else ''}) and approve it "
                f"with `medfl approve {name} --kind {kind} --file {path}`")
