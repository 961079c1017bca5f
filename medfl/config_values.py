"""How a setting's value is read wherever it comes from (a config file, ``--fl#key value``
through medfl's or MONAI's command line, a plugin's parameters), and the error a bad one raises.

The base that the config's reading (:mod:`medfl.config`) and a plugin's parameters
(:meth:`medfl.method.Configurable.from_config`) share: it imports nothing of medfl.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["ConfigError", "BOOL_WORDS", "read_bool", "read_plugin_values", "check_keys", "optional_section", "named"]


class ConfigError(ValueError):
    """The ``fl`` config has an unknown key, a wrong type or an unknown plugin name."""


def check_keys(section: dict[str, Any], valid: dict[str, Any], where: str) -> None:
    """Refuse the keys of ``section`` that ``valid`` lacks.

    Raises:
        ConfigError: naming ``where``, the unknown keys and the valid ones.
    """
    unknown = sorted(set(section) - set(valid))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: "
                          f"{', '.join(sorted(valid))}")


#: How a boolean may be spelled in a config or on the command line (any case): MONAI's bundle
#: CLI hands over ``--fl#plots false`` as the word, ``medfl``'s own reads ``yes`` as a word too.
BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "1": True, "0": False}


def read_bool(value: Any, where: str, *, nullable: bool = False) -> bool | None:
    """A boolean setting read one way wherever it comes from (a config file, ``--fl#key value``
    through medfl's or MONAI's command line, a plugin parameter): ``true``/``false``, the
    integers 1/0, or a word of :data:`BOOL_WORDS` in any case; ``None`` too where ``nullable``.

    Raises:
        ConfigError: anything else, naming ``where`` and the value.
    """
    if isinstance(value, bool) or (value is None and nullable):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in BOOL_WORDS:
        return BOOL_WORDS[value.strip().lower()]
    raise ConfigError(f"{where}: expected true or false (or yes/no, 1/0){', or null' if nullable else ''}, "
                      f"got {value!r}")


def _annotation(p: inspect.Parameter) -> str:
    """A parameter's annotation as written (``"bool | None"``), whether a string or a type."""
    a = p.annotation
    if a is inspect.Parameter.empty:
        return ""
    return (a if isinstance(a, str) else getattr(a, "__name__", str(a))).replace("typing.", "").replace(" ", "")


def _size_like(name: str) -> bool:
    """Whether a plugin parameter is a size or count by its name (``image_size``,
    ``spatial_size``, ``num_classes``, ``width``; not ``min_size``/``max_size``, whose 0 may mean
    something)."""
    return not name.startswith(("min_", "max_")) and (name.endswith("_size") or name.startswith("num_")
                                                      or name == "width")


def read_plugin_values(params: Any, spec: dict[str, Any], where: str, skip: tuple[str, ...] = (),
                       sizes: bool = True) -> dict[str, Any]:
    """Read a plugin spec's values against its parameters (``inspect`` parameters by name), in
    place: a parameter annotated ``bool`` (or with a ``True``/``False`` default) through
    :func:`read_bool`; with ``sizes`` (dataset, partitioner and model plugins; a method checks
    its own hyperparameters), a size or count (:func:`_size_like`: ``image_size``,
    ``spatial_size``, ``num_*``, ``width``) must be a positive integer, or a non-empty list of
    them where the annotation is a sequence, or ``None`` where the parameter allows it. So
    ``image_size=0`` is refused here, not by a convolution after the run directory was made.

    Returns:
        ``spec``.

    Raises:
        ConfigError: naming ``<where>.<key>``, the value and what was expected.
    """
    for key, value in spec.items():
        p = params.get(key)
        if key == "name" or key in skip or p is None:
            continue
        kind = _annotation(p)
        nullable = "None" in kind.split("|") or kind.startswith("Optional[") or p.default is None
        if kind.removeprefix("Optional[").removesuffix("]") in ("bool", "bool|None", "None|bool") or (
                not kind and isinstance(p.default, bool)):
            spec[key] = read_bool(value, f"{where}.{key}", nullable=nullable)
        elif sizes and _size_like(key) and not (value is None and nullable):
            sequence = kind.startswith(("Sequence[", "list[", "tuple["))
            items = value if sequence and isinstance(value, (list, tuple)) else [value]
            if not items or (sequence and not isinstance(value, (list, tuple))) or any(
                    isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in items):
                what = "a non-empty list of positive integers" if sequence else "a positive integer"
                raise ConfigError(f"{where}.{key}: expected {what}{' or null' if nullable else ''} (a size or "
                                  f"count), got {value!r}")
    return spec


def optional_section(value: Any, defaults: dict[str, Any], where: str, example: str) -> dict[str, Any] | None:
    """A section that is off when ``None`` (or false), else a dict of ``defaults``' keys:
    ``None``, or a new dict of ``value`` over ``defaults``.

    Raises:
        ConfigError: not a dict (the message shows ``example``), or an unknown key.
    """
    if value is None or value is False:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected null or a dict like {example}, got {value!r}")
    check_keys(value, defaults, where)
    return {**defaults, **value}


def named(value: Any, where: str) -> dict[str, Any]:
    """A plugin spec ``{"name": ..., **parameters}`` (a new dict) from a name or such a dict.

    Raises:
        ConfigError: neither, naming ``where`` and the value.
    """
    if isinstance(value, str):
        return {"name": value}
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ConfigError(f"{where}: expected a name or a dict with a 'name' key, got {value!r}")
    return dict(value)
