"""The plugin manager: discovers plugins and builds the registries of named things.

Plugins are modules (or objects) implementing hooks from :mod:`medfl.hookspecs`. They are
found through the ``medfl`` entry-point group, the built-ins included. Loading is lazy (on
first use) and idempotent.

Names: everything registered is reachable by its qualified name ``dist:name`` (``dist``: the
plugin's distribution, ``medfl`` for the built-ins; see :func:`plugin_qualifier` for plugins
registered at runtime) and, when exactly one plugin registers the name, by the bare name. A
bare name two plugins register is refused where it is used (:func:`lookup`), naming both
qualified names; nothing else is affected. A plugin whose ``requires_medfl_api`` does not
admit :data:`PLUGIN_API_VERSION` is skipped with a warning; using what it registers is the
error.

Environment variables:
    MEDFL_LOAD_PLUGINS: comma-separated entry-point or distribution names; when set, only
        these third-party plugins load (medfl's own built-ins always load). Empty string
        loads no third-party plugin.
    MEDFL_TRACE_PLUGINS: when set to a non-empty value, every hook call is printed to stderr.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import inspect
import json
import logging
import os
import re
import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterator

import pluggy

from medfl import hookspecs
from medfl.hookspecs import PLUGIN_API_VERSION

__all__ = [
    "DEFAULT_PLUGINS", "KINDS", "PLUGIN_API_VERSION", "PluginError", "PluginWarning", "Registered",
    "Registry", "api_compatible", "get_plugin_manager", "registry", "resolve", "lookup",
    "qualified_name", "pinned_names", "guarded_lookups", "plugin_qualifier", "plugin_info",
    "describe",
]

logger = logging.getLogger(__name__)

#: Built-in plugin modules; used only when medfl runs from a source tree without its
#: entry points installed (normally they load through the ``medfl`` entry-point group).
#: The same modules, in the same order, as pyproject.toml's ``[project.entry-points.medfl]``
#: (tests/test_plugins.py checks it).
DEFAULT_PLUGINS: tuple[str, ...] = (
    "medfl_plugins.baselines",
    "medfl_plugins.models",
    "medfl_plugins.partitioners",
    "medfl_plugins.datasets",
    "medfl_plugins.metrics",
    "medfl_plugins.reporting",
    "medfl_plugins.fedkper",
    "medfl_plugins.fedskd",
    "medfl_plugins.privacy",
    "medfl_plugins.backends",
    "medfl_plugins.pfedcdp",
    "medfl_plugins.fedsdc",
    "medfl_plugins.fedtpf",
    "medfl_plugins.trackers",
)

#: Kinds of registered things and the registration hook that provides each.
KINDS: dict[str, str] = {
    "method": "register_methods",
    "model": "register_models",
    "partitioner": "register_partitioners",
    "dataset": "register_datasets",
    "metric": "register_metrics",
    "filter": "register_filters",
    "backend": "register_backends",
    "tracker": "register_trackers",
}


class PluginError(RuntimeError):
    """A plugin failed to load, registered something badly, or a name is unknown or ambiguous."""


class PluginWarning(UserWarning):
    """A plugin was skipped (it cannot be imported, or requires another plugin API version);
    the rest loaded."""


_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)?\s*(\d+)(?:\.(\d+))?\s*$")


def api_compatible(requirement: str, provided: str = PLUGIN_API_VERSION) -> bool:
    """Whether the plugin API ``provided`` (``"MAJOR.MINOR"``) meets ``requirement``.

    ``requirement`` is comma-separated clauses, each an operator (``>=``, ``<=``, ``==``,
    ``!=``, ``>``, ``<``; none means ``==``) and a version ``MAJOR`` or ``MAJOR.MINOR``
    (a missing minor is 0), e.g. ``">=1.0,<2"``; every clause must hold. ``"==1"`` holds for
    1.0 only: write ``">=1,<2"`` for "any 1.x".

    Raises:
        ValueError: a clause is not of that form.
    """
    major, _, minor = provided.partition(".")
    have = (int(major), int(minor or 0))
    clauses = str(requirement).split(",")
    if not any(c.strip() for c in clauses):
        raise ValueError("an empty requirement; expected e.g. '>=1.0,<2'")
    for clause in clauses:
        m = _CLAUSE.match(clause)
        if m is None:
            raise ValueError(f"clause {clause.strip()!r} is not an operator and a version such as '>=1.0' "
                             "(operators: >=, <=, ==, !=, >, <)")
        op, want = m.group(1) or "==", (int(m.group(2)), int(m.group(3) or 0))
        ok = {">=": have >= want, "<=": have <= want, "==": have == want, "!=": have != want,
              ">": have > want, "<": have < want}[op]
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class Registered:
    """One registered object with where it came from; ``qualified`` is ``dist:name``."""

    kind: str
    name: str
    obj: Any
    plugin: str
    distribution: str
    version: str
    qualified: str = ""


_pm: pluggy.PluginManager | None = None
_dists: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)
# The cache is keyed by the registered plugin objects themselves, not their ids: holding them
# keeps a freed plugin's id from being reused by the next one registered (CPython reuses ids,
# and a stale registry then named a plugin that was gone).
_registry_cache: tuple[frozenset[int], tuple[Any, ...], "Registry"] | None = None
_pins: dict[str, dict[str, str]] = {}   # kind -> {name: qualified}: see pinned_names
#: the check every :func:`resolve` in a :func:`guarded_lookups` block makes (a site's approvals)
_guard: ContextVar[Callable[[str, str], None] | None] = ContextVar("medfl_plugin_guard", default=None)
_warned: set[str] = set()   # plugins already warned about (API version)
#: plugin name -> (distribution, the one line saying why it did not load): an entry point that
#: could not be imported or registered is skipped, so one broken package stops only what names it
_broken: dict[str, tuple[str, str]] = {}


def _trace(hook_name: str, hook_impls: list, kwargs: dict) -> None:
    names = ", ".join(impl.plugin_name for impl in hook_impls)
    logger.info(f"medfl: hook {hook_name}({', '.join(kwargs)}) -> [{names}]")


def _wanted(ep: md.EntryPoint, dist_name: str) -> bool:
    allowed = os.environ.get("MEDFL_LOAD_PLUGINS")
    if dist_name == "medfl" or allowed is None:
        return True
    names = {n.strip() for n in allowed.split(",") if n.strip()}
    return ep.name in names or dist_name in names


def _register_module(pm: pluggy.PluginManager, module: Any, name: str, dist: str, ver: str) -> None:
    if pm.has_plugin(name):
        return
    try:
        pm.register(module, name=name)
    except ValueError as exc:  # pluggy: plugin already registered under another name
        _skip(name, dist, f"could not be registered: {exc}")
    except pluggy.PluginValidationError as exc:
        _skip(name, dist, f"is invalid: {exc}")
    else:
        _dists[name] = (dist, ver)


def _skip(name: str, dist: str, why: str) -> None:
    """Leave plugin ``name`` out, with one warning naming it, its distribution and ``why``."""
    line = f"plugin {name.rpartition(':')[2]!r} from distribution {dist!r} {why}"
    _broken[name] = (dist, line)
    warnings.warn(f"medfl: skipping {line}", PluginWarning, stacklevel=3)


def get_plugin_manager() -> pluggy.PluginManager:
    """Return the process-wide plugin manager, loading entry points on first call.

    An entry point that fails to import or does not match the hook specifications is skipped
    with one :class:`PluginWarning` naming its package and error; looking up a name then fails
    with that line (:meth:`Registry.resolve`), and everything else runs.
    """
    global _pm
    if _pm is not None:
        return _pm
    pm = pluggy.PluginManager("medfl")
    pm.add_hookspecs(hookspecs)
    if os.environ.get("MEDFL_TRACE_PLUGINS"):
        pm.add_hookcall_monitoring(_trace, lambda outcome, name, impls, kwargs: None)
    found_own = False
    for ep in sorted(md.entry_points(group="medfl"), key=lambda e: e.name):
        dist_name, version = (ep.dist.name, ep.dist.version) if ep.dist is not None else ("unknown", "unknown")
        found_own = found_own or dist_name == "medfl"
        if not _wanted(ep, dist_name):
            continue
        plugin_name = ep.name if dist_name == "medfl" else f"{dist_name}:{ep.name}"
        try:
            module = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import failure gets the same clear line
            _skip(plugin_name, dist_name, f"({ep.value}) failed to import: {type(exc).__name__}: {exc}")
            continue
        _register_module(pm, module, plugin_name, dist_name, version)
    if not found_own:  # running from a source tree without installed metadata
        for mod_name in DEFAULT_PLUGINS:
            module = importlib.import_module(mod_name)
            _register_module(pm, module, mod_name.rsplit(".", 1)[-1], "medfl", "source")
    _pm = pm
    return pm


def _plugin_origin(pm: pluggy.PluginManager, plugin: Any) -> tuple[str, str, str]:
    name = pm.get_name(plugin) or repr(plugin)
    dist, ver = _dists.get(name, ("(registered at runtime)", ""))
    return name, dist, ver


def plugin_qualifier(pm: pluggy.PluginManager, plugin: Any) -> str:
    """The ``dist`` part of the qualified names (``dist:name``) of what ``plugin`` registers.

    An entry-point plugin's distribution name (``medfl`` for the built-ins). A plugin
    registered at runtime (``get_plugin_manager().register(obj, name=...)``) has no
    distribution: the name it was registered under, or, when it was given none (pluggy then
    names it after its ``id``), the name of the module that defines it.
    """
    name = pm.get_name(plugin) or ""
    if name in _dists:
        return _dists[name][0]
    if name and name != str(id(plugin)):
        return name
    module = plugin if isinstance(plugin, ModuleType) else None
    return module.__name__ if module is not None else str(getattr(plugin, "__module__", None)
                                                          or type(plugin).__module__)


def _api_refusal(pm: pluggy.PluginManager, plugin: Any) -> str:
    """Why ``plugin`` cannot load under this medfl's :data:`PLUGIN_API_VERSION` ("" when it can)."""
    wanted = getattr(plugin, "requires_medfl_api", None)
    if wanted is None:
        return ""
    try:
        ok = api_compatible(str(wanted))
    except ValueError as exc:
        return f"plugin {pm.get_name(plugin)!r} declares requires_medfl_api = {wanted!r}, which medfl cannot read: {exc}"
    if ok:
        return ""
    return (f"plugin {pm.get_name(plugin)!r} (distribution {plugin_qualifier(pm, plugin)!r}) requires medfl plugin "
            f"API {wanted}; this medfl provides {PLUGIN_API_VERSION}: install a version of the plugin made for it")


class Registry(dict):
    """``{kind: {name: Registered}}``, the names as commands list them, and a resolver.

    Each kind's table holds every registered object once: under its bare name when exactly
    one plugin registered that name, else under each clashing candidate's qualified name
    (``dist:name``). :meth:`resolve` takes a bare or a qualified name.
    """

    def __init__(self) -> None:
        super().__init__({kind: {} for kind in KINDS})
        self.by_name: dict[str, dict[str, list[Registered]]] = {kind: {} for kind in KINDS}
        self.refused: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}

    def add(self, reg: Registered) -> None:
        """Index ``reg`` under its bare and its qualified name."""
        table = self.by_name[reg.kind]
        for key in dict.fromkeys((reg.name, reg.qualified)):
            table.setdefault(key, []).append(reg)

    def finish(self) -> None:
        """Fill each kind's listing table (bare names where unique, else qualified)."""
        for kind, table in self.by_name.items():
            for key, regs in table.items():
                if ":" not in key:
                    self[kind].update({key: regs[0]} if len(regs) == 1 else {r.qualified: r for r in regs})

    def clashes(self, kind: str) -> dict[str, list[Registered]]:
        """The bare names of ``kind`` registered by more than one plugin, with their candidates."""
        return {k: v for k, v in self.by_name[kind].items() if ":" not in k and len(v) > 1}

    def resolve(self, kind: str, name: str) -> Registered:
        """The object registered as ``name`` (bare or ``dist:name``) of ``kind``.

        Raises:
            PluginError: unknown name (with close matches), an ambiguous bare name (naming
                every candidate's qualified name), or a name only a refused plugin registered.
        """
        if kind not in self.by_name:
            raise PluginError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
        pinned = _pins.get(kind, {}).get(name)
        if pinned is not None and pinned != name:
            try:
                return self.resolve(kind, pinned)
            except PluginError as exc:
                raise PluginError(f"{kind} {name!r} was resolved to {pinned!r} when this run started "
                                  f"(its config.json records it), and {pinned!r} cannot be used now: {exc}") from exc
        regs = self.by_name[kind].get(name, [])
        if len(regs) == 1:
            return regs[0]
        if len(regs) > 1:
            names = [r.qualified for r in regs]
            if len(set(names)) < len(names):
                names = [f"{r.qualified} (plugin {r.plugin!r})" for r in regs]
            raise PluginError(f"{kind} {name!r} is ambiguous: it is registered by {len(regs)} plugins, as "
                              f"{' and '.join(names)}; write the qualified name to choose one (e.g. {regs[0].qualified!r})"
                              + ("" if ":" not in name else " (two plugins share this qualifier: register one "
                                 "of them under another name)"))
        if name in self.refused[kind]:
            raise PluginError(f"{kind} {name!r} cannot be used: {self.refused[kind][name]}")
        qualifier = name.partition(":")[0] if ":" in name else None
        broken = [line for _, (dist, line) in sorted(_broken.items()) if qualifier in (None, dist)]
        if qualifier is not None and broken:
            raise PluginError(f"{kind} {name!r} cannot be used: {broken[0]}")
        valid = sorted(self[kind])
        pool = sorted(k for k in self.by_name[kind] if (":" in k) == (":" in name))
        close = difflib.get_close_matches(name, pool, n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        unloaded = "".join(f"; not loaded: {line}" for line in broken)
        raise PluginError(f"unknown {kind} {name!r}; valid {kind}s: {', '.join(valid) or '(none)'}{hint}{unloaded}")


def _build() -> Registry:
    pm = get_plugin_manager()
    out = Registry()
    for kind, hook_name in KINDS.items():
        hook = getattr(pm.hook, hook_name)
        for impl in hook.get_hookimpls():
            pname, dist, ver = _plugin_origin(pm, impl.plugin)
            qual = plugin_qualifier(pm, impl.plugin)
            refusal = _api_refusal(pm, impl.plugin)
            if refusal and pname not in _warned:
                _warned.add(pname)
                warnings.warn(f"medfl: skipping {refusal}", PluginWarning, stacklevel=2)

            def register(obj: Any, name: str | None = None, *, _kind=kind, _p=(pname, dist, ver), _q=qual,
                         _refusal=refusal) -> None:
                key = name or getattr(obj, "name", None) or getattr(obj, "__name__", None)
                if not isinstance(key, str) or not key or ":" in key:
                    raise PluginError(
                        f"plugin {_p[0]!r} from distribution {_p[1]!r} registered a {_kind} "
                        f"without a valid name (a non-empty string without ':'): {key!r} for {obj!r}"
                    )
                if _refusal:
                    out.refused[_kind][key] = out.refused[_kind][f"{_q}:{key}"] = _refusal
                    return
                out.add(Registered(_kind, key, obj, *_p, qualified=f"{_q}:{key}"))

            if os.environ.get("MEDFL_TRACE_PLUGINS"):  # called per plugin, outside pluggy's monitor
                _trace(hook_name, [impl], {"register": register})
            impl.function(register=register)
    out.finish()
    return out


def registry() -> Registry:
    """Return ``{kind: {name: Registered}}`` for every registered method, model, etc. (names
    listed as :class:`Registry` says), rebuilt whenever plugins are registered or unregistered.
    ``registry().resolve(kind, name)`` looks a name up."""
    global _registry_cache
    pm = get_plugin_manager()
    plugins = tuple(pm.get_plugins())
    key = frozenset(id(p) for p in plugins)
    if _registry_cache is None or _registry_cache[0] != key:
        _registry_cache = (key, plugins, _build())
    return _registry_cache[2]


def resolve(kind: str, name: str) -> Registered:
    """The :class:`Registered` entry of ``name`` (bare or qualified ``dist:name``) of ``kind``.

    Inside a :func:`guarded_lookups` block, the block's check runs on the name before the
    entry is returned (a site refuses a model plugin its operator did not approve).

    Raises:
        PluginError: unknown (close matches named), ambiguous (every candidate's qualified
            name given) or refused (API version) name.
        Exception: whatever the block's check raises to refuse the name.
    """
    found = registry().resolve(kind, name)
    check = _guard.get()
    if check is not None:
        token = _guard.set(None)   # the check may look plugins up itself
        try:
            check(kind, name)
        finally:
            _guard.reset(token)
    return found


def lookup(kind: str, name: str) -> Any:
    """Return the object registered as ``name`` of ``kind`` (method, model, ...).

    ``name`` is bare (``fedavg``) or qualified (``medfl:fedavg``); a bare name that several
    plugins register is refused here, naming each candidate's qualified name.

    Raises:
        PluginError: unknown or ambiguous name; the message lists the valid ones.
    """
    return resolve(kind, name).obj


def qualified_name(kind: str, name: str) -> str:
    """The qualified name (``dist:name``) that ``name`` of ``kind`` resolves to now.

    Raises:
        PluginError: as :func:`lookup`.
    """
    return resolve(kind, name).qualified


@contextmanager
def pinned_names(pins: dict[str, dict[str, str]] | None) -> Iterator[None]:
    """Within the block, resolve the names in ``pins`` (``{kind: {name: qualified}}``, what a
    run's ``config.json`` records as ``plugin_names``) to the qualified names recorded,
    whatever has been installed since. Nested blocks see the union, inner entries winning."""
    global _pins
    before = _pins
    merged = {k: dict(v) for k, v in before.items()}
    for kind, names in (pins or {}).items():
        merged.setdefault(kind, {}).update(names)
    _pins = merged
    try:
        yield
    finally:
        _pins = before


@contextmanager
def guarded_lookups(check: Callable[[str, str], None]) -> Iterator[None]:
    """Within the block (this thread or task: a context variable), every :func:`resolve`,
    :func:`lookup` and :func:`qualified_name` first calls ``check(kind, name)``, which raises
    to refuse the name. A site's approvals use it (:func:`medfl.approval.guarded_models`):
    a model that builds another registered model from its options (a wrapper calling
    ``build_model`` or ``lookup("model", ...)``) cannot make the site run a model plugin
    its operator did not approve. Blocks do not nest: the inner check replaces the outer."""
    token = _guard.set(check)
    try:
        yield
    finally:
        _guard.reset(token)


def plugin_info() -> list[dict[str, Any]]:
    """Describe every loaded plugin: name, distribution, version, hooks, registrations.

    ``registered`` maps each kind to the names the plugin registered (bare); ``qualified``
    to the same names qualified (``dist:name``); ``clashes`` lists the ``kind:name``s another
    plugin registers too (usable only qualified); ``refused`` says why the plugin was skipped
    (it could not be imported, or its ``requires_medfl_api`` does not admit
    :data:`PLUGIN_API_VERSION`)."""
    pm = get_plugin_manager()
    reg = registry()
    rows = []
    for plugin in pm.get_plugins():
        name, dist, ver = _plugin_origin(pm, plugin)
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        registered: dict[str, list[str]] = {}
        qualified: dict[str, list[str]] = {}
        clashes: list[str] = []
        for kind in KINDS:
            mine = {r.qualified: r for regs in reg.by_name[kind].values() for r in regs if r.plugin == name}.values()
            if mine:
                registered[kind] = sorted({r.name for r in mine})
                qualified[kind] = sorted({r.qualified for r in mine})
                clashes += [f"{kind}:{r.name}" for r in mine if len(reg.by_name[kind].get(r.name, [])) > 1]
        rows.append(
            {"name": name, "distribution": dist, "version": ver, "qualifier": plugin_qualifier(pm, plugin),
             "hooks": hooks, "registered": registered, "qualified": qualified, "clashes": sorted(set(clashes)),
             "refused": _api_refusal(pm, plugin)}
        )
    rows += [{"name": name, "distribution": dist, "version": "", "qualifier": dist, "hooks": [], "registered": {},
              "qualified": {}, "clashes": [], "refused": line} for name, (dist, line) in _broken.items()]
    return sorted(rows, key=lambda r: r["name"])


def _parameters(kind: str, obj: Any) -> list[dict[str, Any]]:
    """The parameters a config entry of ``obj`` takes: name, default (``None`` with
    ``required``), type (the annotation as written), in signature order."""
    target = obj.__init__ if kind in ("method", "filter", "backend") and inspect.isclass(obj) else obj
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):   # a builtin or C callable: nothing readable
        return []
    out = []
    for p in sig.parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        ann = p.annotation
        type_name = "" if ann is p.empty else ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann))
        out.append({"name": p.name, "required": p.default is p.empty,
                    "default": None if p.default is p.empty else _jsonable(p.default), "type": type_name})
    return out


def _jsonable(value: Any) -> Any:
    """``value`` when JSON can hold it as is, else its ``repr``."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def describe(name: str) -> list[dict[str, Any]]:
    """Everything registered as ``name`` (bare or qualified ``dist:name``), of every kind:
    kind, name, qualified name, plugin, distribution, version, parameters (name, default,
    type, required), presets (methods: values, train settings and each one's source),
    docstring, and the other candidates when the bare name clashes (``clashes_with``). What ``medfl plugins NAME`` prints.

    Raises:
        PluginError: nothing is registered under ``name``; the message names close matches.
    """
    reg = registry()
    found: list[Registered] = []
    refused: list[str] = []
    for kind in KINDS:
        found += reg.by_name[kind].get(name, [])
        if name in reg.refused[kind]:
            refused.append(f"{kind} {name!r}: {reg.refused[kind][name]}")
    if not found:
        if refused:
            raise PluginError("; ".join(refused))
        pool = sorted({k for kind in KINDS for k in reg.by_name[kind] if (":" in k) == (":" in name)})
        close = difflib.get_close_matches(name, pool, n=5)
        raise PluginError(f"nothing is registered as {name!r}"
                          + (f"; did you mean {' or '.join(map(repr, close))}?" if close else "")
                          + " (`medfl plugins` lists every name)")
    out = []
    for r in found:
        presets = getattr(r.obj, "presets", None) or {}
        others = [o.qualified for o in reg.by_name[r.kind].get(r.name, []) if o is not r]
        out.append({"kind": r.kind, "name": r.name, "qualified": r.qualified, "plugin": r.plugin,
                    "distribution": r.distribution, "version": r.version,
                    "description": str(getattr(r.obj, "description", "") or ""),
                    "parameters": _parameters(r.kind, r.obj),
                    "presets": {k: _describe_preset(v) for k, v in sorted(presets.items())},
                    "doc": inspect.getdoc(r.obj) or "", "clashes_with": others})
    return out


def _describe_preset(preset: Any) -> dict[str, Any]:
    """What :func:`describe` says of one preset: its source, description, values, ``train``
    settings and, for each of those (``train.`` prefixed), where it comes from as
    ``config.json`` records it (``{"from": kind, "source": citation}``, ``"unstated"`` where
    the preset cites none)."""
    return {"values": _jsonable(dict(preset.values)), "train": _jsonable(dict(preset.train)),
            "source": preset.source, "description": preset.description,
            "sources": {key: preset.origin(key) for key in preset.entries()}}


def _reset_for_tests() -> None:
    """Forget the loaded plugin manager (tests that change entry points use this)."""
    global _pm, _registry_cache
    _pm = _registry_cache = None
    for table in (_dists, _warned, _broken):
        table.clear()
