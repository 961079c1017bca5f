"""A method's named settings (:class:`Preset`) and where each of their values comes from.

A method lists its presets in :attr:`medfl.method.Method.presets`; a method entry picks one
with ``"preset"``, and the run's ``config.json`` records each value with its source
(:func:`medfl.config.preset_record`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Preset", "SOURCE_KINDS", "parse_source"]

#: Where a preset value comes from (:attr:`Preset.sources`): the paper (section, equation,
#: table or page), the authors' code (repository, file and line), a reading of a sentence that
#: admits another, or medfl's own choice where the source is silent.
SOURCE_KINDS = ("paper", "authors_code", "reading", "open")


@dataclass(frozen=True)
class Preset:
    """A named set of a method's settings, chosen with ``{"name": ..., "preset": NAME}``.

    A method entry's own keys win over the preset's; what each hyperparameter's value is and
    where it came from is written to the run's ``config.json`` (``preset``: each value with
    its source's kind and citation, ``"config"`` where the entry overrides it, and medfl's
    defaults of the rest).

    Attributes:
        source: where the values come from (``"paper 003, Sec. V-A, Table VIII"``).
        values: hyperparameters (keyword arguments of the method's ``__init__``).
        train: the entry's ``fl.train`` overrides (optimizer, lr, batch_size, epochs...).
        experiment: the source's experiment settings outside a method entry (``rounds``,
            ``partition``, ``fraction``, ``num_clients``...): recorded in ``config.json`` and
            said on stderr where the run differs, never applied (every method of an experiment
            shares one split and one number of rounds).
        description: one line for ``medfl plugins``.
        sources: where each entry of ``values`` and ``train`` (``train.`` prefixed) comes
            from, as ``"<kind>: <citation>"`` with a kind of :data:`SOURCE_KINDS`:
            ``"paper: Sec. III-D, eq. 8"``, ``"authors_code: shadhin39/PFedCDP,
            differential_privacy.py, line 12"``, ``"reading: <the sentence read>; other
            reading: <...>"`` or ``"open: <medfl's choice and why>"``. ``medfl plugins NAME``
            prints them; :meth:`source_problems` lists the entries without a valid one.
    """

    source: str
    values: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    experiment: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict)

    def entries(self) -> list[str]:
        """Every entry a source is due for: the keys of ``values``, then ``train.<key>`` for
        each key of ``train``."""
        return [*self.values, *(f"train.{k}" for k in self.train)]

    def source_of(self, key: str) -> tuple[str, str] | None:
        """Where one entry comes from, as ``(kind, citation)``: ``key`` is a key of ``values``
        or ``"train.<key>"``; ``None`` when ``sources`` gives none.

        Raises:
            ValueError: the entry of ``sources`` is not ``"<kind>: <citation>"`` with a kind
                of :data:`SOURCE_KINDS` and a citation that is not empty.
        """
        return parse_source(self.sources[key], f"sources[{key!r}]") if key in self.sources else None

    def origin(self, key: str) -> dict[str, str]:
        """Where one entry comes from as ``config.json`` records it: ``{"from": kind, "source":
        citation}`` (:meth:`source_of`), or ``{"from": "unstated", "source": why}`` where the
        preset cites none or one that is not ``"<kind>: <citation>"``."""
        try:
            found = self.source_of(key)
        except ValueError as e:
            return {"from": "unstated", "source": f"the preset's source is malformed: {e}"}
        if found is None:
            return {"from": "unstated", "source": f"the preset cites no source for {key}"}
        return {"from": found[0], "source": found[1]}

    def source_problems(self) -> list[str]:
        """What keeps this preset from citing a source for each of its entries, one line per
        entry: a key of ``values``/``train`` with no source, a source that is not
        ``"<kind>: <citation>"`` (kind of :data:`SOURCE_KINDS`, citation not empty), and a key
        of ``sources`` that names no entry. Empty when every entry cites its source
        (medfl's tests require that of every built-in preset)."""
        problems = []
        for key in self.entries():
            try:
                found = self.source_of(key)
            except ValueError as e:
                problems.append(f"{key}: {e}")
                continue
            if found is None:
                problems.append(f"{key}: no source (sources[{key!r}] = \"<kind>: <citation>\", kind one of "
                                f"{', '.join(SOURCE_KINDS)})")
            elif found[0] == "reading" and "other reading" not in found[1]:
                problems.append(f"{key}: a reading names the sentence read and the other reading "
                                "('reading: <sentence>; other reading: <...>')")
        known = set(self.entries())
        problems += [f"sources[{k!r}] names no entry of values or train (train entries are 'train.<key>')"
                     for k in self.sources if k not in known]
        return problems


def parse_source(text: Any, where: str = "source") -> tuple[str, str]:
    """``(kind, citation)`` of a preset source written ``"<kind>: <citation>"``.

    Raises:
        ValueError: ``text`` is not a string of that form, its kind is not one of
            :data:`SOURCE_KINDS` or its citation is empty; the message names ``where``.
    """
    kind, sep, citation = text.partition(":") if isinstance(text, str) else ("", "", "")
    kind, citation = kind.strip(), citation.strip()
    if not sep or kind not in SOURCE_KINDS or not citation:
        raise ValueError(f"{where} must be '<kind>: <citation>' with a kind of {', '.join(SOURCE_KINDS)} and a "
                         f"citation, got {text!r}")
    return kind, citation
