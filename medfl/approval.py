"""Which plugin code a site runs: its operator's approvals.

A method's client code runs at the site, next to the data, and whatever it returns leaves
the site; no check of the returned message can stop code written to leak (the payload
guard, :mod:`medfl.guard`, catches mistakes). What real federations do against untrusted
code is have the data holder approve the code beforehand: Fed-BioMed's nodes, for example,
only train with training plans whose hash their operator approved. medfl does the same
for plugins. Unlike Fed-BioMed, the coordinator never ships code: it names a method, and
the site runs the plugin of that name *installed at the site*. An approval pins that
installed code, and everything that runs with it:

``kind``, ``name``
    what the site runs: every kind :mod:`medfl.plugins` registers (:data:`APPROVED_KINDS`):
    the coordinator's ``method``, ``filter`` (the run's chain) and ``model`` (each client's,
    each model sent for scoring, and each model one of them builds from its options, checked
    when it is looked up: :func:`guarded_models`); every registered ``metric`` (an evaluation computes
    them all); the site's own ``dataset`` and ``partitioner``;
``distribution``, ``version``
    the installed distribution that registered it (``medfl`` for the built-ins);
``files``, ``sha256``
    the SHA-256 of every source file that runs with it, and a hash of that listing:
    every file of the distribution that defines it (all its top-level packages, their data
    files included: a ``settings.txt`` or JSON the code reads is pinned like its source;
    the module's own top-level package or file when it has no distribution; a plugin that is
    a single module, not a package, has no data files medfl can tell apart from the folder
    it is installed in, so files beside it are not pinned: ship data inside a package), of medfl
    itself (the engine where FedAvg's client step lives), and of every module these import
    (found in their source, followed transitively) that is neither in the standard library
    nor a distribution medfl requires or offers as an extra (torch, MONAI, Flower, MLflow...:
    the site's environment, installed by its operator). A refusal names the file that changed.

Bytecode is pinned too: a ``.pyc`` that does not hold the code its source compiles to is
refused (:mod:`medfl.code_identity`).

``medfl approve NAME --file approvals.json`` records the identity of an installed plugin
(after the operator has reviewed it), ``medfl approve --all`` every installed one and
``medfl approve --update`` everything the file lists, as installed now (after an upgrade);
``medfl flower site ... --approvals approvals.json``
(or ``MEDFL_APPROVALS=approvals.json`` in the environment of a plain ``flower-supernode``)
makes the site refuse, on every message and before any plugin code runs, a plugin that is
not in the file or whose version or code differs. The file is read again for every
message, so approving or revoking takes effect without restarting the site. The same file
holds the site's privacy policy (:mod:`medfl.policy`).

Without an approvals file a site runs any plugin installed in its environment (it says so
when it starts and once for each plugin it runs). That is the default because a site can
only ever run plugins its operator installed (nothing is downloaded from the coordinator;
``MEDFL_LOAD_PLUGINS`` restricts which installed third-party plugins load), and because
one-machine trials and tests need no file; real deployments should pass ``--approvals``.

Not covered: code that runs when plugins are imported (every installed entry point is
imported when medfl loads its plugins; restrict them with ``MEDFL_LOAD_PLUGINS``), modules
imported under a name computed at run time (not found in the source), and the libraries of
the site's environment (pinned by its operator's install, not by an approval).
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Iterator

from medfl.code_identity import ApprovalError, CodeIdentity, code_identity
from medfl.policy import SitePolicy

__all__ = ["APPROVALS_ENV", "OPT_OUT", "APPROVED_KINDS", "ApprovalError", "Approvals", "approval_identities",
           "plugin_kinds", "required", "check_control", "guarded_models", "approvals_path"]

logger = logging.getLogger(__name__)

#: Environment variable naming a site's approvals file (``medfl flower site --approvals`` sets it).
APPROVALS_ENV = "MEDFL_APPROVALS"
#: Its value (and ``--approvals``') by which a site opts out by name: it runs any installed plugin
#: the coordinator names, and says so (an NVFlare site answers nothing without a file or this).
OPT_OUT = "none"
#: Plugin kinds whose code a site runs on its data and whose output leaves the site: every
#: kind :data:`medfl.plugins.KINDS` registers but ``backend`` (the coordinator's choice of
#: where the clients are; a site never runs one).
APPROVED_KINDS: tuple[str, ...] = ("method", "filter", "model", "metric", "dataset", "partitioner")
_FORMAT = 2
_WARNED: set[tuple[str, str, str]] = set()


def plugin_kinds(name: str) -> list[str]:
    """The kinds a site runs (:data:`APPROVED_KINDS`) under which a plugin named ``name``
    (bare or qualified) is registered here: what ``medfl approve --kind`` takes for it."""
    from medfl.plugins import registry

    reg = registry()
    return [kind for kind in APPROVED_KINDS if reg.by_name.get(kind, {}).get(name)]


def _kind_hint(kind: str, name: str) -> str | None:
    """Why ``name`` is no ``kind`` when it is a plugin of other kinds, naming the ``--kind``
    that approves it; ``None`` when it is registered as ``kind`` or as no other kind."""
    kinds = plugin_kinds(name)
    others = [k for k in kinds if k != kind]
    if kind in kinds or kind not in APPROVED_KINDS or not others:   # an unknown --kind: code_identity says so
        return None
    options = " or ".join(f"--kind {k}" for k in others)
    return (f"{name!r} is not a {kind} but a {' and a '.join(others)} plugin: approve it with {options} "
            f"(`medfl approve {name} --kind {others[0]}`)")


def approval_identities(wanted: Iterable[tuple[str, str]],
                        cache: dict[frozenset[str], Any] | None = None) -> list[CodeIdentity]:
    """The identity (:func:`code_identity`) of every ``(kind, name)`` of ``wanted``, each one
    checked before any is returned, so that ``medfl approve`` records all of them or none.

    Raises:
        ApprovalError: one message naming every ``(kind, name)`` that cannot be approved
            (not installed, ambiguous, not pinnable); a name registered as another kind says
            which ``--kind`` approves it.
    """
    found: list[CodeIdentity] = []
    problems: list[str] = []
    for kind, name in wanted:
        try:
            found.append(code_identity(kind, name, cache))
        except ApprovalError as exc:
            problems.append(_kind_hint(kind, name) or str(exc))
    if len(problems) > 1:
        raise ApprovalError(f"{len(problems)} names cannot be approved: " + "; ".join(problems))
    if problems:
        raise ApprovalError(problems[0])
    return found


class Approvals:
    """A site's approvals file: ``{"medfl_approvals": 2, "approved": [entry, ...],
    "code": {sha256: {file: sha256}}, "policy": {...}}``, each entry a :class:`CodeIdentity`
    plus when it was approved, its files' hashes kept once per digest in ``code`` (the
    plugins of one install share them); the optional ``policy`` is the least privacy the
    site accepts (:mod:`medfl.policy`).

    Args:
        path: the file (it need not exist yet when approving).
        entries: its entries by ``(kind, name)``.
        policy: the ``policy`` section as written in the file (``None``: none).
    """

    def __init__(self, path: str | Path, entries: dict[tuple[str, str], dict[str, Any]] | None = None,
                 policy: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.entries = dict(entries or {})
        self.policy = policy

    @classmethod
    def load(cls, path: str | Path, missing_ok: bool = False) -> "Approvals":
        """Read an approvals file (and check its policy, :func:`medfl.policy.SitePolicy.from_dict`).
        Files of format 1 (which pinned only each plugin's own package) are read; their
        entries are refused until approved again (``medfl approve --update``).

        Raises:
            ApprovalError: the file is missing (unless ``missing_ok``) or malformed, or its
                policy is (:class:`medfl.policy.PolicyError`).
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
        if not isinstance(data, dict) or data.get("medfl_approvals") not in (1, _FORMAT) or not isinstance(
                data.get("approved"), list):
            raise ApprovalError(f"approvals file {path} is not a medfl approvals file "
                                f"(expected {{\"medfl_approvals\": {_FORMAT}, \"approved\": [...]}})")
        code = data.get("code", {})
        if not isinstance(code, dict) or not all(isinstance(v, dict) for v in code.values()):
            raise ApprovalError(f"approvals file {path}: 'code' must map each approved sha256 to its files' hashes")
        entries: dict[tuple[str, str], dict[str, Any]] = {}
        for i, e in enumerate(data["approved"]):
            if not isinstance(e, dict) or not all(isinstance(e.get(k), str) for k in ("kind", "name", "sha256")):
                raise ApprovalError(f"approvals file {path}: entry {i} lacks kind, name or sha256")
            if "files" not in e and e["sha256"] in code:
                e = {**e, "files": code[e["sha256"]]}
            entries[(e["kind"], e["name"])] = e
        policy = data.get("policy")
        if policy is not None:
            SitePolicy.from_dict(policy, f"approvals file {path}: policy")
        return cls(path, entries, policy)

    def save(self) -> None:
        """Write the file (atomically)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        approved, code = [], {}
        for k in sorted(self.entries):
            e = dict(self.entries[k])
            if isinstance(e.get("files"), dict):   # each listing once: plugins of one install share it
                code[e["sha256"]] = e.pop("files")
            approved.append(e)
        data: dict[str, Any] = {"medfl_approvals": _FORMAT, "approved": approved, "code": code}
        if self.policy is not None:
            data["policy"] = self.policy
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(self.path)

    def approve(self, identity: CodeIdentity) -> None:
        """Record (or replace) the approval of ``identity``."""
        entry = asdict(identity)
        entry["files"] = dict(identity.files)
        entry["approved_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.entries[(identity.kind, identity.name)] = entry

    def revoke(self, kind: str, name: str) -> bool:
        """Remove an approval; whether there was one."""
        return self.entries.pop((kind, name), None) is not None

    def check_listed(self, wanted: Iterable[tuple[str, str]]) -> None:
        """Refuse, before any is revoked, ``(kind, name)`` pairs of ``wanted`` the file does
        not list (a name it lists as another kind says which ``--kind`` to give).

        Raises:
            ApprovalError: naming every pair that is not in the file.
        """
        problems = []
        for kind, name in wanted:
            if (kind, name) in self.entries:
                continue
            others = sorted(k for k, n in self.entries if n == name)
            problems.append(f"{kind} {name!r} is not in {self.path}" + (
                f" (it lists {name!r} as a {' and a '.join(others)}: give "
                f"{' or '.join(f'--kind {k}' for k in others)})" if others else ""))
        if problems:
            raise ApprovalError("; ".join(problems))

    def refusal(self, identity: CodeIdentity) -> str | None:
        """Why ``identity`` may not run (``None``: it is approved); a changed file is named."""
        e = self.entries.get((identity.kind, identity.name))
        if e is None:
            return f"it is not in the approvals file {self.path}"
        if e.get("distribution") != identity.distribution or e.get("version") != identity.version:
            return (f"the approved one is {e.get('distribution')} {e.get('version')}, the installed one "
                    f"{identity.distribution} {identity.version}")
        if e["sha256"] != identity.sha256:
            approved = e.get("files")
            if not isinstance(approved, dict):
                return ("it was approved by an older medfl, which pinned only the plugin's own package (not the "
                        "modules it imports, nor medfl itself)")
            now = identity.files
            parts = [f"{what}: {', '.join(names[:5])}{f' and {len(names) - 5} more' if len(names) > 5 else ''}"
                     for what, names in (("changed", sorted(f for f in now if f in approved and now[f] != approved[f])),
                                         ("added", sorted(set(now) - set(approved))),
                                         ("removed", sorted(set(approved) - set(now)))) if names]
            return (f"its code changed since it was approved ({'; '.join(parts) or 'same files'}): "
                    f"sha256 {identity.sha256[:12]}..., approved {e['sha256'][:12]}...")
        return None


def approvals_path() -> Path | None:
    """The approvals file this process enforces (:data:`APPROVALS_ENV`), if any (none where
    it is unset or :data:`OPT_OUT`)."""
    value = os.environ.get(APPROVALS_ENV, "").strip()
    return Path(value) if value and value != OPT_OUT else None


def required(control: dict[str, Any], site: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """The ``(kind, name)`` of every plugin a site message makes the site run: its
    ``method``, its ``filters`` (entries with a ``name``), the model of the message
    (``model``) and of every model it sends for scoring (``specs``), with a method every
    registered metric (an evaluation computes them all, :func:`medfl.engine.evaluation.evaluate_metrics`),
    and ``site``: what the site's own config runs (its dataset and partitioner)."""
    out: list[tuple[str, str]] = []

    def add(kind: str, entry: Any) -> None:
        if isinstance(entry, dict) and "name" in entry and (kind, str(entry["name"])) not in out:
            out.append((kind, str(entry["name"])))

    method = control.get("method")
    add("method", method)
    for f in control.get("filters") or []:
        add("filter", f)
    add("model", control.get("model"))
    for spec in dict(control.get("specs") or {}).values():
        add("model", spec)
    if isinstance(method, dict) and "name" in method:
        from medfl.plugins import registry

        for name in sorted(registry().get("metric", {})):
            add("metric", {"name": name})
    for kind, name in site:
        add(kind, {"name": name})
    return out


def check_control(control: dict[str, Any], who: str, path: Path | None = None,
                  kinds: Iterable[str] = APPROVED_KINDS, site: Iterable[tuple[str, str]] = ()) -> Approvals | None:
    """Refuse a message whose plugins are not approved (the site's check, before any plugin
    code runs): every plugin of :func:`required` (``site``: the site's own ones). ``path``
    defaults to :func:`approvals_path`; without one, each plugin is allowed and announced
    once on stderr. Returns the approvals file read (its ``policy`` is checked by the
    caller, :meth:`medfl.site.Site.check`), or ``None`` without one.

    Raises:
        ApprovalError: naming the plugin, why it is refused (the file that changed) and how
            to approve it.
    """
    path = approvals_path() if path is None else path
    wanted = [(k, n) for k, n in required(control, site) if k in set(kinds)]
    if path is None:
        for kind, name in wanted:
            if (who, kind, name) not in _WARNED:
                _WARNED.add((who, kind, name))
                logger.warning(f"{who}: running {kind} {name!r} without approval (no approvals file: this site runs any "
                               f"installed {kind} the coordinator names; see `medfl approve`)")
        return None
    approvals = Approvals.load(path)
    cache: dict[frozenset[str], Any] = {}
    for kind, name in wanted:
        _check_one(approvals, kind, name, cache)
    return approvals


def _check_one(approvals: Approvals, kind: str, name: str, cache: dict[frozenset[str], Any], via: str = "") -> None:
    """Refuse ``name`` of ``kind`` unless ``approvals`` lists it with its installed version
    and code; ``via``: what runs it (``, built by model 'stem_cnn'``), said in the refusal.

    Raises:
        ApprovalError: naming the plugin, why, and the ``medfl approve`` command that approves it.
    """
    try:
        identity = code_identity(kind, name, cache)
    except ApprovalError as exc:
        raise ApprovalError(f"refused {kind} {name!r}{via}: {exc}") from None
    reason = approvals.refusal(identity)
    if reason is not None:
        raise ApprovalError(
            f"refused {identity.describe()}{via}: {reason}. The site operator can review its code and approve it "
            f"with `medfl approve {name} --kind {kind} --file {approvals.path}` (or approve again everything the "
            f"file lists, as installed now: `medfl approve --update --file {approvals.path}`)")


@contextmanager
def guarded_models(approvals: Approvals | None, who: str, allowed: Iterable[str] = ()) -> Iterator[None]:
    """Within the block, every model plugin the registry looks up (:func:`medfl.plugins.lookup`,
    through :func:`~medfl.plugins.guarded_lookups`) must be approved in ``approvals`` with its
    installed version and code, as :func:`check_control` requires of the message's own models:
    a wrapper model that builds an inner model from its options (``{"name": "stem_cnn",
    "inner": {"name": ...}}``, with ``build_model`` or ``lookup("model", ...)``) cannot make
    the site run a model plugin its operator never approved. The inner model is refused
    before its factory runs, naming the models being built around it
    (:func:`medfl.models.registry.building`).

    Args:
        approvals: the site's approvals file, as :func:`check_control` read it for the
            message; ``None`` (no file): each model is allowed and announced once on stderr.
        who: the site, in messages (``medfl site 0``).
        allowed: model names :func:`check_control` already approved for the message.

    Raises:
        ApprovalError: from a lookup in the block: naming the model, the wrapper and why.
    """
    from medfl.models.registry import building
    from medfl.plugins import guarded_lookups

    done = set(allowed)
    cache: dict[frozenset[str], Any] = {}

    def check(kind: str, name: str) -> None:
        if kind != "model" or name in done:
            return
        outer = building()
        via = f", built by model {outer[-1]!r}" if outer else ""
        if approvals is None:
            if (who, kind, name) not in _WARNED:
                _WARNED.add((who, kind, name))
                logger.warning(f"{who}: running {kind} {name!r}{via} without approval (no approvals file: this site "
                               f"runs any installed {kind}; see `medfl approve`)")
        else:
            _check_one(approvals, kind, name, cache, via)
        done.add(name)

    with guarded_lookups(check):
        yield
