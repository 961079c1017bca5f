"""A site runs no text a coordinator sends: MONAI's config syntax (a ``$`` expression, an ``@``
or ``%`` reference, a ``_target_``-style key) in a Flower run config or in any field of a
message is refused in one line naming the key, before anything else runs; the site's budget
counts its data by the data's own fingerprint, not by config text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from flwr.app import Context, Message, RecordDict  # noqa: E402

from medfl import wire  # noqa: E402
from medfl.budget import data_key  # noqa: E402
from medfl.config_file import PlainDataError, plain_fl, refuse_syntax  # noqa: E402
from medfl.engine import protocol as P  # noqa: E402
from medfl.flower.proxy import app, to_records  # noqa: E402
from medfl.site import Site, SiteError, SiteSettings  # noqa: E402
from medfl.site_messages import handle  # noqa: E402

FL: dict[str, Any] = {
    "seed": 0, "num_clients": 2, "rounds": 1, "progress": False,
    "dataset": {"name": "synthetic2d", "num_samples": 32, "num_classes": 2, "image_size": 8},
    "partition": {"name": "iid"}, "model": {"name": "small_cnn", "width": 4}, "methods": [{"name": "fedavg"}],
}


def expression(marker: Path) -> str:
    """What a hostile coordinator sends: Python that writes ``marker`` when evaluated."""
    return f"$__import__('pathlib').Path({str(marker)!r}).write_text('ran') and False"


@pytest.mark.parametrize("data, key", [
    ({"fl": {"progress": "$print('x')"}}, "fl#progress"),
    ({"fl": {"dataset": {"root": "@dataset_dir"}}}, "fl#dataset#root"),
    ({"fl": {"name": "%other.json#fl#name"}}, "fl#name"),
    ({"fl": {"methods": [{"_target_": "os.system", "command": "true"}]}}, "fl#methods#0#_target_"),
    ({"fl": {"train": {"_requires_": "@x"}}}, "fl#train#_requires_"),
    ({"imports": ["$import os"]}, "imports#0"),
])
def test_monai_syntax_anywhere_is_refused_naming_its_key(data: dict[str, Any], key: str) -> None:
    with pytest.raises(PlainDataError, match=rf"^the job: key '{key}'") as info:
        refuse_syntax(data, "the job")
    assert "\n" not in str(info.value)


def test_plain_data_passes_and_overrides_are_set_as_data() -> None:
    """Strings that merely hold the characters (a label with '@', a '#' in a name) are data."""
    bundle = {"fl": {**FL, "name": "run #3 @ site", "methods": [{"name": "fedavg", "label": "a%b"}]}}
    fl = plain_fl(bundle, {"fl#rounds": 4, "fl::train": {"lr": 0.1}}, "the job")
    assert fl["rounds"] == 4 and fl["train"] == {"lr": 0.1} and fl["name"] == "run #3 @ site"
    assert bundle["fl"]["rounds"] == 1, "the job's bundle itself is not changed"
    with pytest.raises(PlainDataError, match=r"overrides: key 'fl#nowhere#x': no such place"):
        plain_fl(bundle, {"fl#nowhere#x": 1}, "the job")
    with pytest.raises(PlainDataError, match=r"overrides: key 'fl#progress' holds"):
        plain_fl(bundle, {"fl#progress": "$True"}, "the job")


def _context(run_config: dict[str, Any], node_config: dict[str, Any]) -> Context:
    return Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config=run_config)


def test_a_flower_run_config_with_an_expression_is_refused_by_the_site_and_runs_nothing(tmp_path: Path) -> None:
    """The ClientApp of a site (Flower calls it with the run's config in its context) refuses a
    run config holding MONAI syntax, in its overrides' JSON too, before the site reads its
    config or anything else: the marker the expression would write stays absent."""
    marker = tmp_path / "MARKER"
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"fl": FL}))
    node = {"client-id": "0", "config": str(config), "state-dir": str(tmp_path / "state")}
    content = wire.Content()
    wire.put_json(content, P.CONTROL, {"protocol": P.PROTOCOL})
    for rc, key in (({"overrides": json.dumps({"fl#progress": expression(marker)})}, "overrides#fl#progress"),
                    ({"workdir": expression(marker)}, "workdir")):
        # Flower's runtime turns the ClientApp's exception into the error reply the coordinator reads
        with pytest.raises(PlainDataError, match=rf"^medfl site 0: the Flower run config: key '{key}' holds .*refused"):
            app(Message(content=to_records(content), dst_node_id=1, message_type=P.HELLO), _context(rc, node))
    assert not marker.exists() and not (tmp_path / "state").exists()


def test_a_message_field_with_monai_syntax_is_refused_before_the_site_checks_it(tmp_path: Path) -> None:
    """Every field of a message is plain data: a control record or an instruction config with
    MONAI syntax is refused naming the key, before the site's approvals, data or method."""
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"fl": FL}))
    site = Site(SiteSettings(client_id="0", config=config, state_dir=tmp_path / "state"))
    content = wire.Content()
    wire.put_json(content, P.CONTROL, {"protocol": P.PROTOCOL, "method": {"name": "fedavg", "mu": "$1"}})
    with pytest.raises(SiteError, match=r"query.hello message's control record: key 'method#mu' holds '\$1'"):
        handle(site, P.HELLO, wire.encode(content))
    content = wire.Content()
    wire.put_json(content, P.CONTROL, {"protocol": P.PROTOCOL, "run": "r1", "round": 1})
    wire.put(content, "ins.payload", {}, "test")
    wire.put(content, "ins.config", {"schedule": {"_target_": "builtins.exec"}}, "test")
    content["padding"] = wire.Config({})
    with pytest.raises(SiteError, match=r"\(config\): key 'schedule#_target_'"):
        handle(site, P.VALIDATE, wire.encode(content))
    assert not list((tmp_path / "state").rglob("clients")), "no client state was touched"


def test_the_budget_counts_the_data_by_its_fingerprint_not_by_config_text(tmp_path: Path) -> None:
    """``data/manifest.csv`` and ``data/./manifest.csv`` name the same data: one budget key (a
    digest of config text gave two, and a coordinator that could reword the path reset the
    site's budget); other data, another key."""
    import numpy as np

    data = tmp_path / "data"
    data.mkdir()
    rows = ["path,label"]
    for i in range(8):
        np.save(data / f"s{i}.npy", np.full((1, 4, 4), i, dtype=np.float32))
        rows.append(f"s{i}.npy,{i % 2}")
    (data / "manifest.csv").write_text("\n".join(rows) + "\n")

    def key(manifest: str) -> str:
        fl = {**FL, "dataset": {"name": "manifest", "path": manifest}}
        return Site(SiteSettings(client_id="0", config=Path("-"), state_dir=tmp_path, resolved=fl)).budget().data

    same = {key(str(data / "manifest.csv")), key(f"{data}/./manifest.csv"), key(f"{tmp_path}//data/../data/manifest.csv")}
    assert len(same) == 1, same
    (data / "manifest.csv").write_text("\n".join(rows[:-1]) + "\n")
    assert key(str(data / "manifest.csv")) not in same


def test_spends_keyed_by_config_text_before_count_for_every_data_set(tmp_path: Path) -> None:
    """A budget written before the fingerprint key (its spends keyed by a digest of config text)
    cannot tell which data set a spend was of: it counts for each, never for none."""
    from medfl.budget import BUDGET_FILE, KEY_PREFIX, SiteBudget

    rec = {"type": "spend", "run": "old", "round": 1, "step": 0, "client": "0", "kind": "train",
           "mechanism": "dp_gaussian", "unit": "client", "noise_multiplier": 1.0, "sample_rate": 1.0, "steps": 1,
           "delta": 1e-5, "accountant": "rdp"}
    (tmp_path / BUDGET_FILE).write_text("\n".join(json.dumps({**rec, "data": d, "run": d})
                                                  for d in ("0123456789abcdef", f"{KEY_PREFIX}other")) + "\n")
    budget = SiteBudget(tmp_path, f"{KEY_PREFIX}mine", "0", "medfl site 0")
    assert [r["run"] for r in budget.spends()] == ["0123456789abcdef"] and budget.spent() > 0
