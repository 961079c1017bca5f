"""A model that refuses its options (``ModelConfigError`` from its factory) or builds an
unknown inner model (``PluginError``) stops ``medfl run`` with one ``medfl: error:`` line and
leaves no run directory, as a method's ``MethodConfigError`` does (issue 51). The config's
checks cannot see a factory's own refusals; before, the models were first built after the run
directory was made (the global model in the method's ``setup``, a client's own model of
``fl.client_models`` in round 1), so each refusal left a run ``medfl runs`` listed as crashed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from torch import nn

from medfl import hookimpl
from medfl.bundle import USER_ERROR_EXIT
from medfl.cli import main
from medfl.models.registry import ModelConfigError, build_model
from medfl.plugins import get_plugin_manager

WRAP = "refusing_wrap"


def refusing_wrap(*, spatial_dims: int, in_channels: int, num_classes: int, inner: str = "small_cnn",
                  width: int = 4, fail: bool = False) -> nn.Module:
    """A wrapper model: the registered model ``inner``, built from its own options;
    ``fail=True`` is an option it refuses."""
    if fail:
        raise ModelConfigError(f"{WRAP}: fail must be false")
    return build_model({"name": inner, "width": width, "spatial_dims": spatial_dims, "in_channels": in_channels,
                        "num_classes": num_classes})


class WrapPlugin:
    """Registers :func:`refusing_wrap`."""

    @hookimpl
    def register_models(self, register: Any) -> None:
        register(refusing_wrap, name=WRAP)


@pytest.fixture(autouse=True)
def wrapper() -> Iterator[None]:
    """:func:`refusing_wrap` registered for each test here."""
    pm = get_plugin_manager()
    pm.register(WrapPlugin(), name="refusing-wrap-test")
    try:
        yield
    finally:
        pm.unregister(name="refusing-wrap-test")


#: ``(what the run changes in the tiny config, the start of its one error line)``
CASES: list[tuple[dict[str, Any], str]] = [
    ({"model": {"name": WRAP, "fail": True}}, f"medfl: error: {WRAP}: fail must be false"),
    ({"model": {"name": WRAP, "inner": "no_such_model"}}, "medfl: error: unknown model 'no_such_model'"),
    # one client's own model (heterogeneous clients), built before only in round 1
    ({"client_models": [{}, {"name": WRAP, "fail": True}, {}], "methods": [{"name": "fedskd"}]},
     f"medfl: error: {WRAP}: fail must be false"),
]


def test_a_model_refusal_is_one_line_and_leaves_no_run(tmp_path: Path, tiny_fl: dict[str, Any],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    for change, line in CASES:
        config = tmp_path / "train.json"
        config.write_text(json.dumps({"fl": {**tiny_fl, "rounds": 1, **change}}))
        assert main(["run", str(config)]) == USER_ERROR_EXIT, change
        errors = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln.lower() or "Traceback" in ln]
        assert len(errors) == 1 and errors[0].startswith(line), (change, errors)
        assert not Path(tiny_fl["output_dir"]).exists(), (change, sorted(Path(tiny_fl["output_dir"]).rglob("*")))
