"""The plugin manager: discovers plugins and builds the registries of named things.

Plugins are modules (or objects) implementing hooks from :mod:`medfl.hookspecs`. They are
found through the ``medfl`` entry-point group, the built-ins included. Loading is lazy (on
first use) and idempotent.

Environment variables:
    MEDFL_LOAD_PLUGINS: comma-separated entry-point or distribution names; when set, only
        these third-party plugins load (medfl's own built-ins always load). Empty string
        loads no third-party plugin.
    MEDFL_TRACE_PLUGINS: when set to a non-empty value, every hook call is printed to stderr.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pluggy

from medfl import hookspecs

__all__ = [
    "DEFAULT_PLUGINS",
    "KINDS",
    "PluginError",
    "Registered",
    "get_plugin_manager",
    "registry",
    "lookup",
    "plugin_info",
]

logger = logging.getLogger(__name__)

#: Built-in plugin modules; used only when medfl runs from a source tree without its
#: entry points installed (normally they load through the ``medfl`` entry-point group).
DEFAULT_PLUGINS: tuple[str, ...] = (
    "medfl_plugins.baselines",
    "medfl_plugins.models",
    "medfl_plugins.partitioners",
    "medfl_plugins.datasets",
    "medfl_plugins.metrics",
    "medfl_plugins.reporting",
    "medfl_plugins.privacy",
    "medfl_plugins.backends",
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
}


class PluginError(RuntimeError):
    """A plugin failed to load, registered something badly, or a name is unknown."""


@dataclass(frozen=True)
class Registered:
    """One registered object with where it came from."""

    kind: str
    name: str
    obj: Any
    plugin: str
    distribution: str
    version: str


_pm: pluggy.PluginManager | None = None
_dists: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)
# The cache is keyed by the registered plugin objects themselves, not their ids: holding them
# keeps a freed plugin's id from being reused by the next one registered (CPython reuses ids,
# and a stale registry then named a plugin that was gone).
_registry_cache: tuple[frozenset[int], tuple[Any, ...], dict[str, dict[str, Registered]]] | None = None


def _trace(hook_name: str, hook_impls: list, kwargs: dict) -> None:
    names = ", ".join(impl.plugin_name for impl in hook_impls)
    logger.info(f"medfl: hook {hook_name}({', '.join(kwargs)}) -> [{names}]")


def _wanted(ep: md.EntryPoint, dist_name: str) -> bool:
    if dist_name == "medfl":
        return True
    allowed = os.environ.get("MEDFL_LOAD_PLUGINS")
    if allowed is None:
        return True
    names = {n.strip() for n in allowed.split(",") if n.strip()}
    return ep.name in names or dist_name in names


def _register_module(pm: pluggy.PluginManager, module: Any, name: str, dist: str, ver: str) -> None:
    if pm.has_plugin(name):
        return
    try:
        pm.register(module, name=name)
    except ValueError as exc:  # pluggy: plugin already registered under another name
        raise PluginError(f"plugin {name!r} from distribution {dist!r} could not be registered: {exc}")
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {name!r} from distribution {dist!r} is invalid: {exc}") from exc
    _dists[name] = (dist, ver)


def get_plugin_manager() -> pluggy.PluginManager:
    """Return the process-wide plugin manager, loading entry points on first call.

    Raises:
        PluginError: a plugin failed to import or does not match the hook specifications.
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
        dist_name = ep.dist.name if ep.dist is not None else "unknown"
        version = ep.dist.version if ep.dist is not None else "unknown"
        if dist_name == "medfl":
            found_own = True
        if not _wanted(ep, dist_name):
            continue
        plugin_name = ep.name if dist_name == "medfl" else f"{dist_name}:{ep.name}"
        try:
            module = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import failure gets the same clear error
            raise PluginError(
                f"plugin {ep.name!r} from distribution {dist_name!r} ({ep.value}) failed to "
                f"import: {type(exc).__name__}: {exc}"
            ) from exc
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


def _build() -> dict[str, dict[str, Registered]]:
    pm = get_plugin_manager()
    out: dict[str, dict[str, Registered]] = {kind: {} for kind in KINDS}
    for kind, hook_name in KINDS.items():
        hook = getattr(pm.hook, hook_name)
        for impl in hook.get_hookimpls():
            pname, dist, ver = _plugin_origin(pm, impl.plugin)

            def register(obj: Any, name: str | None = None, *, _kind=kind, _p=(pname, dist, ver)) -> None:
                key = name or getattr(obj, "name", None) or getattr(obj, "__name__", None)
                if not isinstance(key, str) or not key:
                    raise PluginError(
                        f"plugin {_p[0]!r} from distribution {_p[1]!r} registered a {_kind} "
                        f"without a name: {obj!r}"
                    )
                if key in out[_kind]:
                    first = out[_kind][key]
                    raise PluginError(
                        f"{_kind} {key!r} is registered twice: by plugin {first.plugin!r} "
                        f"(distribution {first.distribution!r}) and by plugin {_p[0]!r} "
                        f"(distribution {_p[1]!r})"
                    )
                out[_kind][key] = Registered(_kind, key, obj, *_p)

            if os.environ.get("MEDFL_TRACE_PLUGINS"):  # called per plugin, outside pluggy's monitor
                _trace(hook_name, [impl], {"register": register})
            impl.function(register=register)
    return out


def registry() -> dict[str, dict[str, Registered]]:
    """Return ``{kind: {name: Registered}}`` for every registered method, model, etc.

    Rebuilt whenever plugins are registered or unregistered.
    """
    global _registry_cache
    pm = get_plugin_manager()
    plugins = tuple(pm.get_plugins())
    key = frozenset(id(p) for p in plugins)
    if _registry_cache is None or _registry_cache[0] != key:
        _registry_cache = (key, plugins, _build())
    return _registry_cache[2]


def lookup(kind: str, name: str) -> Any:
    """Return the object registered as ``name`` of ``kind`` (method, model, ...).

    Raises:
        PluginError: unknown name; the message lists the valid ones.
    """
    table = registry()[kind]
    if name not in table:
        valid = ", ".join(sorted(table)) or "(none)"
        raise PluginError(f"unknown {kind} {name!r}; valid {kind}s: {valid}")
    return table[name].obj


def plugin_info() -> list[dict[str, Any]]:
    """Describe every loaded plugin: name, distribution, version, hooks, registrations."""
    pm = get_plugin_manager()
    reg = registry()
    rows = []
    for plugin in pm.get_plugins():
        name, dist, ver = _plugin_origin(pm, plugin)
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        registered: dict[str, list[str]] = {}
        for kind, table in reg.items():
            names = sorted(n for n, r in table.items() if r.plugin == name)
            if names:
                registered[kind] = names
        rows.append(
            {"name": name, "distribution": dist, "version": ver, "hooks": hooks,
             "registered": registered}
        )
    return sorted(rows, key=lambda r: r["name"])


def _reset_for_tests() -> None:
    """Forget the loaded plugin manager (tests that change entry points use this)."""
    global _pm, _registry_cache
    _pm = None
    _registry_cache = None
    _dists.clear()
