"""What the built-in methods share: a keyword read by its rule (:func:`read`) and warnings said
once each (:func:`say_once`)."""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

from medfl.method import MethodConfigError

__all__ = ["read", "say_once"]

_COMPARE = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


def read(where: str, name: str, value: Any, rule: Any, *, none: bool = False, finite: bool = True,
         quote: bool = False) -> Any:
    """The keyword ``name``'s ``value`` checked by its ``rule``: one of a tuple of choices (as a
    str), an integer >= an int rule (a bool is not one), or a number (as a float) in the range
    a str rule writes as the message says it: ``"> 0"``, ``">= 0 and < 1"``, ``"in [0, 1]"``.
    ``none``: ``None`` passes; ``finite``: an infinite number is refused; ``quote``: the message
    quotes the choices.

    Raises:
        MethodConfigError: saying ``where``, the name, what it must be and what it got.
    """
    if value is None and none:
        return None
    if isinstance(rule, tuple):
        if value not in rule:
            raise MethodConfigError(f"{where}: {name} must be one of "
                                    f"{', '.join(map(repr, rule) if quote else rule)}, got {value!r}")
        return str(value)
    if isinstance(rule, int):
        if isinstance(value, bool) or not isinstance(value, int) or value < rule:
            raise MethodConfigError(f"{where}: {name} must be an integer >= {rule}, got {value!r}")
        return value
    low, _, high = rule[4:-1].partition(", ")   # "in [low, high]"
    limits = [(">=", low), ("<=", high)] if rule.startswith("in [") else [p.split(" ") for p in rule.split(" and ")]
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or (finite and not math.isfinite(value))
            or not all(_COMPARE[op](value, float(x)) for op, x in limits)):
        raise MethodConfigError(f"{where}: {name} must be a number {rule}, got {value!r}")
    return float(value)


def say_once(warned: list[str], out: list[str]) -> Callable[[str, str], None]:
    """``say(key, text)``: ``text`` onto ``out`` unless ``key`` is in ``warned`` (then it is)."""
    def say(key: str, text: str) -> None:
        if key not in warned:
            warned.append(key)
            out.append(text)
    return say
