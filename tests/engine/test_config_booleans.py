"""Booleans are read one way everywhere (issue 39, item 9): a config file, ``--fl#key value``
through medfl's command line or MONAI's (which hands over the word), the ``fl`` section's own
switches and every plugin's boolean parameter take true/false, yes/no, 1/0 in any case;
anything else is one error naming the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from medfl.bundle import parse_override_value
from medfl.config import ConfigError, build_method, resolve_config
from medfl.filters import configured_filters

__all__: list[str] = []

BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "demo"


def _with(fl: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """``fl`` with one boolean set at ``key`` (a dotted path of the places booleans live)."""
    fl = json.loads(json.dumps(fl))
    places = {
        "plots": lambda: fl.__setitem__("plots", value),
        "progress": lambda: fl.__setitem__("progress", value),
        "overwrite": lambda: fl.__setitem__("overwrite", value),
        "use_official_split": lambda: fl.__setitem__("use_official_split", value),
        "train.channels_last": lambda: fl["train"].__setitem__("channels_last", value),
        "model.no_max_pool": lambda: fl.__setitem__("model", {"name": "resnet10", "width": 4, "no_max_pool": value}),
        "model.dp_compatible": lambda: fl["model"].__setitem__("dp_compatible", value),
        "partition.balance": lambda: fl["partition"].__setitem__("balance", value),
        "methods[0].shuffle": lambda: fl.__setitem__("methods", [{"name": "fedsdc", "shuffle": value}]),
        "methods[0].train.pin_memory": lambda: fl.__setitem__("methods", [{"name": "fedavg",
                                                                           "train": {"pin_memory": value}}]),
        "filters[0].stochastic": lambda: fl.__setitem__("filters", [{"name": "quantize", "stochastic": value}]),
    }
    places[key]()
    return fl


def _read(cfg: dict[str, Any], key: str) -> Any:
    """The value the run uses for ``key``: from the resolved config, or from the method or
    filter it builds."""
    if key == "methods[0].shuffle":
        return build_method(cfg["methods"][0]).shuffle
    if key == "filters[0].stochastic":
        method = build_method(cfg["methods"][0])
        return configured_filters(cfg, cfg["methods"][0], method)[0].filters[0].stochastic
    if key == "methods[0].train.pin_memory":
        return cfg["methods"][0]["train"]["pin_memory"]
    node: Any = cfg
    for part in key.split("."):
        node = node[part]
    return node


KEYS = ("plots", "progress", "overwrite", "use_official_split", "train.channels_last", "model.no_max_pool",
        "model.dp_compatible",
        "partition.balance", "methods[0].shuffle", "methods[0].train.pin_memory", "filters[0].stochastic")


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("word, meaning", [("true", True), ("false", False), ("Yes", True), ("NO", False),
                                           ("1", True), ("0", False), (1, True), (0, False), (True, True),
                                           (False, False), (" False ", False)])
def test_every_boolean_reads_the_same_words(tiny_fl: dict[str, Any], key: str, word: Any, meaning: bool) -> None:
    """On main ``fl.plots`` took "false" but ``model.no_max_pool`` refused "true", FedSDC's
    ``shuffle`` read "false" as True, ``quantize``'s ``stochastic`` refused "true", and
    ``progress``/``overwrite`` took any string as true."""
    cfg = resolve_config(_with(tiny_fl, key, word))
    value = _read(cfg, key)
    assert value is meaning, (key, word, value)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("word", ["maybe", 2, "", 0.5])
def test_anything_else_is_one_error_naming_the_key(tiny_fl: dict[str, Any], key: str, word: Any) -> None:
    with pytest.raises(ValueError) as err:
        resolve_config(_with(tiny_fl, key, word))
    text = str(err.value)
    named = key.split(".")[-1]
    assert isinstance(err.value, ConfigError) and len(text.splitlines()) == 1
    assert f"{named}: expected true or false (or yes/no, 1/0)" in text and repr(word) in text, text


@pytest.mark.parametrize("text, meaning", [("true", True), ("yes", True), ("False", False), ("no", False),
                                           ("0", False)])
def test_an_override_on_medfls_command_line_reads_as_in_a_config(tiny_fl: dict[str, Any], text: str,
                                                                 meaning: bool) -> None:
    cfg = resolve_config(_with(tiny_fl, "model.no_max_pool", parse_override_value(text)))
    assert cfg["model"]["no_max_pool"] is meaning


def test_monai_bundle_cli_takes_the_word_for_a_model_boolean(tmp_path: Path, run_bundle) -> None:
    """The issue's case: ``--fl#model#no_max_pool true`` through MONAI's CLI was refused
    (ValueError: no_max_pool must be a bool, got 'true') while ``--fl#plots false`` was taken."""
    run_bundle(BUNDLE / "configs" / "train.json", "--bundle_root", tmp_path, "--fl#rounds", "1",
               "--fl#dataset#num_samples", "160", "--fl#dataset#image_size", "12", "--fl#partition#min_size", "8",
               "--fl#model#width", "4", "--fl#model#no_max_pool", "true", "--fl#plots", "false",
               "--fl#progress", "no", timeout=600)
    saved = json.loads((tmp_path / "runs" / "demo" / "fedavg" / "config.json").read_text())["fl"]
    assert saved["model"]["no_max_pool"] is True and saved["plots"] is False and saved["progress"] is False
    bad = run_bundle(BUNDLE / "configs" / "train.json", "--bundle_root", tmp_path / "b", "--fl#model#no_max_pool",
                     "perhaps", check=False, timeout=600)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "fl.model.no_max_pool: expected true or false (or yes/no, 1/0), got 'perhaps'" in bad.stderr
    assert not (tmp_path / "b" / "runs").exists()


def test_secure_aggregation_takes_the_words_too(tiny_fl: dict[str, Any]) -> None:
    assert resolve_config({**tiny_fl, "secure_aggregation": "false"})["secure_aggregation"] is None
    assert resolve_config({**tiny_fl, "secure_aggregation": "Yes"})["secure_aggregation"]["num_shares"] == 1.0
    with pytest.raises(ConfigError, match=r"fl.secure_aggregation: expected true, false or a dict like .* got 'some'"):
        resolve_config({**tiny_fl, "secure_aggregation": "some"})
