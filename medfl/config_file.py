"""Reading a bundle config file: its ``fl`` section, with ``#``-path overrides applied.

:func:`load_bundle_config` is what ``medfl run``, a Flower site and medfl's ServerApp read
their experiment with; a plain JSON config is read without importing MONAI.

What a site receives from a coordinator (an NVFlare job's bundle and overrides, a Flower run
config, every field of every message) is not the site's text: it is read as plain JSON data
(:func:`plain_fl`, :func:`refuse_syntax`), never by MONAI's parser, and MONAI's syntax in it
(a ``$`` expression, an ``@`` or ``%`` reference, a ``_target_``-style key) is refused naming
the key, before anything else runs.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

__all__ = ["load_bundle_config", "plain_fl", "refuse_syntax", "set_override", "PlainDataError"]


def load_bundle_config(config_file: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read a bundle config with MONAI's ConfigParser, apply ``#``-path overrides, and return
    the parsed ``fl`` section (references such as ``@bundle_root`` resolved). A plain JSON
    config, with nothing MONAI's syntax would act on, is read with ``json`` instead, to the
    same content and without importing MONAI (:func:`_plain_json_fl`).

    Raises:
        FileNotFoundError: the config file does not exist.
        KeyError: the config has no ``fl`` section.
    """
    path = Path(config_file)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: config file not found")
    plain = _plain_json_fl(path, overrides or {})
    if plain is not None:
        return plain
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(path))
    for key, value in (overrides or {}).items():
        parser[key] = value
    if "fl" not in parser.get():
        raise KeyError(f"{path}: no 'fl' section; a medfl bundle config keeps the experiment under 'fl'")
    return parser.get_parsed_content("fl")


class _NotPlain(Exception):
    """The config needs MONAI's parser (see :func:`_plain_json_fl`)."""


def _plain_json_fl(path: Path, overrides: dict[str, Any]) -> dict[str, Any] | None:
    """The ``fl`` section of a JSON config that MONAI's ``ConfigParser`` would return as it
    is, read without importing MONAI (``import monai`` loads all of MONAI, seconds on a slow
    CPU, and every ``medfl run``, site and Flower run reads a config); ``None`` where MONAI's
    parser must read it: not a ``.json`` file, a duplicate key, an override whose path is not
    there, or anything MONAI's syntax could act on anywhere in the file or the overrides (a
    string holding ``@``, ``%`` or ``#`` or starting with ``$``: references, macros, ids
    (MONAI writes a ``#`` in any string as ``::``), expressions; a
    key of the ``_target_`` form or holding ``#``, ``::``, ``@``, ``$`` or ``%``). Overrides are
    set as MONAI's ``parser[id] = value`` sets them (``#`` or ``::`` between levels, digits
    index lists, the parent must exist)."""
    if path.suffix.lower() != ".json":
        return None

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(items)
        if len(out) != len(items):
            raise _NotPlain
        return out

    def check(obj: Any) -> None:
        if isinstance(obj, str):
            if "@" in obj or "%" in obj or "#" in obj or obj.startswith("$"):
                raise _NotPlain
        elif isinstance(obj, dict):
            for k, v in obj.items():
                if not isinstance(k, str) or any(c in k for c in ("#", "::", "@", "$", "%")) or (
                        len(k) > 1 and k.startswith("_") and k.endswith("_")):
                    raise _NotPlain
                check(v)
        elif isinstance(obj, list):
            for v in obj:
                check(v)

    try:
        with open(path) as f:      # as MONAI opens it
            config = json.load(f, object_pairs_hook=pairs)
        for key, value in overrides.items():
            if not str(key) or not isinstance(config, dict):
                raise _NotPlain
            set_override(config, str(key), value)
        check(config)
    except (_NotPlain, ValueError, KeyError, IndexError, TypeError):
        return None       # MONAI's parser decides, and words any error as it always has
    if not isinstance(config, dict) or "fl" not in config:
        return None
    return config["fl"]


class PlainDataError(ValueError):
    """Data a site received from a coordinator is not plain JSON data (the message names the key)."""


def set_override(config: dict[str, Any], key: str, value: Any) -> None:
    """Set the ``#``-path ``key`` (``fl#train#lr``; ``::`` also separates levels, digits index
    lists) of ``config`` to a copy of ``value``, as MONAI's ``parser[key] = value`` does: the
    parent must exist.

    Raises:
        KeyError, IndexError, ValueError, TypeError: the parent is not there.
    """
    *parents, last = key.replace("#", "::").split("::")
    node: Any = config
    for k in parents:
        node = node[k] if isinstance(node, dict) else node[int(k)]
    node[last if isinstance(node, dict) else int(last)] = copy.deepcopy(value)


def refuse_syntax(obj: Any, where: str, path: str = "", *, json_only: bool = True) -> None:
    """Refuse MONAI's config syntax anywhere in ``obj`` (data a site received from a
    coordinator): a string starting with ``$`` (an expression MONAI would evaluate as Python),
    ``@`` (a reference) or ``%`` (a macro), a key of the ``_name_`` form (``_target_``,
    ``_requires_``, ...: MONAI builds or runs something) or starting with one of those
    characters. With ``json_only`` only JSON types pass (dicts with string keys, lists, strings,
    numbers, booleans, ``None``; without it any other leaf, e.g. a tensor); ``path`` is the
    ``#``-path of ``obj`` in what was received.

    Raises:
        PlainDataError: naming ``where`` and the key.
    """
    at = f"{where}: key {path!r}" if path else where
    if isinstance(obj, str):
        if obj[:1] in ("$", "@", "%"):
            raise PlainDataError(f"{at} holds {obj[:40]!r}: MONAI config syntax ({obj[0]}) in what a coordinator "
                                 "sent; a site reads it as plain data and runs none of it (refused)")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            key = f"{path}#{k}" if path else str(k)
            if not isinstance(k, str) or k[:1] in ("$", "@", "%") or (len(k) > 2 and k[0] == k[-1] == "_"):
                raise PlainDataError(f"{where}: key {key!r}: MONAI config syntax in a key of what a coordinator sent "
                                     "(a component to build or code to run); a site reads it as plain data (refused)")
            refuse_syntax(v, where, key, json_only=json_only)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            refuse_syntax(v, where, f"{path}#{i}" if path else str(i), json_only=json_only)
    elif json_only and not (obj is None or isinstance(obj, (bool, int, float))):
        raise PlainDataError(f"{at}: a {type(obj).__name__}, expected JSON data")


def plain_fl(bundle: Any, overrides: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``fl`` section of a bundle config a site received from a coordinator, with its
    ``#``-path ``overrides`` set, read as plain data (:func:`refuse_syntax` on both first).

    Raises:
        PlainDataError: MONAI syntax, an override whose parent is not there, or no ``fl`` dict.
    """
    refuse_syntax(bundle, f"{where}: bundle")
    refuse_syntax(overrides, f"{where}: overrides")
    if not isinstance(bundle, dict):
        raise PlainDataError(f"{where}: bundle: expected a JSON object, got {type(bundle).__name__}")
    config = copy.deepcopy(bundle)
    for key, value in overrides.items():
        try:
            set_override(config, key, value)
        except (KeyError, IndexError, ValueError, TypeError):
            raise PlainDataError(f"{where}: overrides: key {key!r}: no such place in the bundle config") from None
    if not isinstance(config.get("fl"), dict):
        raise PlainDataError(f"{where}: bundle: no 'fl' section (a medfl bundle config keeps the experiment under 'fl')")
    return config["fl"]
