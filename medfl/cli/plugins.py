"""``medfl plugins``: every registered plugin, or what one name is."""

from __future__ import annotations

import argparse
import json
from typing import Any

from medfl.plugins import PLUGIN_API_VERSION, describe, plugin_info, registry

__all__ = ["add_parsers", "cmd_plugins"]


def cmd_plugins(args: argparse.Namespace) -> int:
    """List every plugin and what it registered, or describe one name (``medfl plugins NAME``)."""
    if args.name:
        return _describe_plugin(args.name, args.json)
    if args.json:
        print(json.dumps(plugin_info(), indent=2))
        return 0
    reg = registry()
    print(f"medfl plugin API {PLUGIN_API_VERSION}; `medfl plugins NAME` describes one")
    for kind, table in reg.items():
        print(f"{kind}s:")
        clashes = reg.clashes(kind)
        for name, r in sorted(table.items()):
            doc = getattr(r.obj, "description", "") or (getattr(r.obj, "__doc__", "") or "").strip().split("\n")[0]
            mark = f"  [clash: '{r.name}' is ambiguous, write {name}]" if r.name in clashes else ""
            print(f"  {name:<16} {r.qualified:<24} {r.version:<8} {doc}{mark}")
            for pname, preset in sorted((getattr(r.obj, "presets", None) or {}).items()):
                print(f"  {'':<16}   preset {pname!r}: {preset.description or preset.source}")
    refused = [p for p in plugin_info() if p["refused"]]
    for p in refused:
        print(f"skipped: {p['refused']}")
    return 0


def _describe_plugin(name: str, as_json: bool) -> int:
    """``medfl plugins NAME``: each thing registered as ``NAME`` with its parameters and docstring."""
    found = describe(name)
    if as_json:
        print(json.dumps(found, indent=2))
        return 0
    for i, d in enumerate(found):
        if i:
            print()
        print(f"{d['kind']} {d['qualified']}  ({d['distribution']} {d['version']}, plugin {d['plugin']!r})")
        if d["clashes_with"]:
            print(f"  clash: '{d['name']}' is also registered as {', '.join(d['clashes_with'])}; "
                  f"configs must write the qualified name")
        if d["description"]:
            print(f"  {d['description']}")
        print("  parameters:" if d["parameters"] else "  parameters: none")
        for p in d["parameters"]:
            default = "required" if p["required"] else f"default {json.dumps(p['default'])}"
            print(f"    {p['name']:<22} {p['type'] or '-':<14} {default}")
        for pname, preset in d["presets"].items():
            _print_preset(pname, preset)
        if d["doc"]:
            print("\n" + "\n".join("  " + line if line else "" for line in d["doc"].splitlines()))
    return 0


def _print_preset(name: str, preset: dict[str, Any]) -> None:
    """One preset of ``medfl plugins NAME``: its description and source, then every value and
    ``train`` setting with where it comes from (kind and citation)."""
    print(f"  preset {name!r}: {preset['description'] or preset['source']}")
    if preset["description"]:
        print(f"    source: {preset['source']}")
    settings = {**preset["values"], **{f"train.{k}": v for k, v in preset["train"].items()}}
    for key, value in settings.items():
        origin = preset["sources"][key]
        print(f"    {key:<22} {json.dumps(value):<14} {origin['from']}: {origin.get('source', '')}")


def add_parsers(sub: Any) -> None:
    """Add the ``medfl plugins`` command to ``sub`` (the subparsers of ``medfl``)."""
    sp = sub.add_parser("plugins", help="list registered methods, models, partitioners, datasets, metrics, filters, "
                                        "backends; or describe one (medfl plugins fedprox)",
                        description="Without NAME: every registered name, its qualified name (dist:name) and "
                                    "version; a bare name two plugins register is listed once per plugin, "
                                    "qualified, and marked as a clash (configs must then write the qualified "
                                    "name). With NAME (bare or dist:name): its kind, distribution and version, "
                                    "its parameters with their types and defaults, its presets and docstring.")
    sp.add_argument("name", nargs="?", default=None, help="a registered name to describe, e.g. fedprox or medfl:fedprox")
    sp.add_argument("--json", action="store_true",
                    help="as JSON: every plugin (name, distribution, version, hooks, registered, qualified, clashes, "
                         "refused), or with NAME its description")
    sp.set_defaults(func=cmd_plugins)
