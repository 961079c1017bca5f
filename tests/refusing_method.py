"""A method plugin that refuses its settings where a plugin may: in ``__init__`` (the
hyperparameters alone) or in ``setup`` (where it first sees the run's training settings).
Shared by tests/engine/test_method_refusal.py (in process, and a bundle under MONAI's CLI)
and tests/flower/test_method_refusal_flower.py (``medfl flower run``)."""

from __future__ import annotations

from typing import Any

from medfl import MethodConfigError
from medfl.method import Federation
from medfl_plugins.baselines import FedAvg

#: The registered name of :class:`Refusing`.
NAME = "refusing"
#: The ``medfl: error:`` line of each refusal, for a run of one round.
LINES = {
    "init": "medfl: error: refusing: where='init' is refused in __init__ (the hyperparameters alone)",
    "setup": "medfl: error: refusing: min_rounds=5 needs fl.rounds >= 5, the run has 1; lower min_rounds or "
             "raise fl.rounds",
}


class Refusing(FedAvg):
    """FedAvg that refuses its settings: ``where="init"`` raises
    :class:`~medfl.method.MethodConfigError` in ``__init__``; ``"setup"`` raises it in
    ``setup`` when the run has fewer than ``min_rounds`` rounds; ``"bug"`` raises a plain
    ``ValueError`` in ``setup`` (a bug, not a refusal); ``"never"`` runs as FedAvg."""

    name = NAME
    description = "FedAvg that refuses its settings (tests)"

    def __init__(self, where: str = "never", min_rounds: int = 5) -> None:
        super().__init__()
        if where == "init":
            raise MethodConfigError("refusing: where='init' is refused in __init__ (the hyperparameters alone)")
        self.where, self.min_rounds = str(where), int(min_rounds)

    def setup(self, federation: Federation) -> None:
        """Refuse a run shorter than ``min_rounds`` (``where="setup"``), or fail (``"bug"``)."""
        if self.where == "setup" and federation.rounds < self.min_rounds:
            raise MethodConfigError(f"refusing: min_rounds={self.min_rounds} needs fl.rounds >= {self.min_rounds}, "
                                    f"the run has {federation.rounds}; lower min_rounds or raise fl.rounds")
        if self.where == "bug":
            raise ValueError("refusing: a bug in setup")
        super().setup(federation)


def entry(where: str) -> dict[str, Any]:
    """The config's method entry of a :class:`Refusing` run refusing at ``where``."""
    return {"name": NAME, "where": where}
