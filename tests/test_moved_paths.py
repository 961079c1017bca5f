"""Old import paths of moved modules still work until the next release, with a warning.

``medfl.engine.training`` -> ``medfl.training``, ``medfl.engine.hub`` -> ``medfl.hub`` and
``medfl.engine.public`` -> ``medfl.public``: a name read from the old path is the new
module's object and warns (:class:`DeprecationWarning` naming the new path); importing the
old module itself is quiet. The traffic phases the report reads live in ``medfl.traffic``.
"""

from __future__ import annotations

import importlib
import warnings

import pytest

import medfl.hub
import medfl.public
import medfl.training
import medfl.traffic

MOVED = [
    ("medfl.engine.training", medfl.training, ["train_epochs", "StepMeans", "make_optimizer", "predict_proba",
                                               "get_state", "weighted_average", "NonFiniteError", "move_state"]),
    ("medfl.engine.hub", medfl.hub, ["HubAndSpoke", "norm_keys"]),
    ("medfl.engine.public", medfl.public, ["PublicData", "check_compatible", "PUBLIC_KEYS"]),
]


@pytest.mark.parametrize("old, new, names", MOVED, ids=[m[0] for m in MOVED])
def test_a_name_from_the_old_path_warns_and_is_the_same_object(old: str, new, names: list[str]) -> None:
    module = importlib.import_module(old)
    for name in names:
        with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} moved to {new.__name__}\.{name}") as caught:
            value = getattr(module, name)
        assert value is getattr(new, name)
        assert caught[0].filename == __file__   # points at the line that used the old path
    assert set(module.__all__) == set(new.__all__)


@pytest.mark.parametrize("old, new, names", MOVED, ids=[m[0] for m in MOVED])
def test_from_import_of_the_old_path_warns(old: str, new, names: list[str]) -> None:
    with pytest.warns(DeprecationWarning, match=rf"moved to {new.__name__}\.{names[0]}"):
        got = {}
        exec(f"from {old} import {names[0]}", got)
    assert got[names[0]] is getattr(new, names[0])


@pytest.mark.parametrize("old", [m[0] for m in MOVED])
def test_importing_the_old_module_itself_is_quiet(old: str) -> None:
    module = importlib.import_module(old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(module)
        with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
            module.no_such_name  # noqa: B018


def test_the_engines_traffic_recorder_uses_the_phases_beside_the_messages() -> None:
    from medfl.engine import traffic

    assert traffic.PHASES is medfl.traffic.PHASES and traffic.COLUMNS is medfl.traffic.COLUMNS
    assert list(traffic.Traffic().frame().columns) == medfl.traffic.COLUMNS


def test_the_moved_modules_and_their_users_below_the_engine_do_not_import_it() -> None:
    """The helpers, the hub, the public dataset and the traffic phases sit below the engine:
    importing them, privacy's DP-SGD or the report loads no ``medfl.engine`` (nor Flower)."""
    import subprocess
    import sys

    code = ("import sys, medfl.training, medfl.hub, medfl.public, medfl.traffic, medfl.privacy.dp_sgd, "
            "medfl.report; "
            "bad = sorted(m for m in sys.modules if m.startswith('medfl.engine') or m.startswith('medfl.flower')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
