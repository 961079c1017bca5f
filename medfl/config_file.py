"""Reading a bundle config file: its ``fl`` section, with ``#``-path overrides applied.

:func:`load_bundle_config` is what ``medfl run``, a Flower site and medfl's ServerApp read
their experiment with; a plain JSON config is read without importing MONAI.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

__all__ = ["load_bundle_config"]


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
            *parents, last = str(key).replace("#", "::").split("::")
            if not str(key) or not isinstance(config, dict):
                raise _NotPlain
            node: Any = config
            for k in parents:
                node = node[k] if isinstance(node, dict) else node[int(k)]
            node[last if isinstance(node, dict) else int(last)] = copy.deepcopy(value)
        check(config)
    except (_NotPlain, ValueError, KeyError, IndexError, TypeError):
        return None       # MONAI's parser decides, and words any error as it always has
    if not isinstance(config, dict) or "fl" not in config:
        return None
    return config["fl"]
