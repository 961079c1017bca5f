"""What medfl takes from Flower, checked against the Flower installed here: the one module to
read (and run) when Flower is upgraded (issue 65).

medfl pins flwr to one minor release (``flwr>=1.42,<1.43`` in the ``flower`` and
``simulation`` extras) and uses Flower's commands, flags, documented environment variables and
its ``flwr.app``/``clientapp``/``serverapp`` API. Besides that API it relies on a few facts
about the release, each checked here without starting a process:

- the installed release is inside the pin;
- the error codes a reply carries (:data:`medfl.flower.transport._DROPOUT_CODES`: a node gone
  or a message lost is a dropout, anything else the site's error);
- an ``Array`` made from a NumPy array is ``numpy.ndarray`` bytes, which
  :func:`medfl.flower.proxy.from_records` reads;
- the ClientApp's message types (``query.hello``, ``evaluate.validate``...) are ones a Flower
  ``ClientApp`` registers and a ``Message`` accepts;
- SecAgg+'s client mod and its configs record (:func:`medfl.flower.proxy.secure_aggregation_mod`);
  its server side (:mod:`medfl.flower.secagg`) imports Flower's SecAgg+ modules, the one
  place that uses Flower's internals, lazily, and only with ``fl.secure_aggregation``;
- the Flower settings medfl sets in the processes it starts are defaults a site can change.

What only a running Flower shows is checked by the real-process tests: the SuperNode's
``SuperNode ID: N`` line (:data:`medfl.flower.deploy.NODE_ID_LINE`, test_flower.py), the
``Server error '5..`` line of a SuperNode whose work loop ended
(:func:`medfl.flower.worker._loop_ended`, test_superlink_database.py), the ServerApp's
``ServerApp raised an exception`` (:data:`medfl.flower.deploy.SERVERAPP_RAISED`,
test_failed_run.py), ``flwr ls --format json`` (:func:`medfl.flower.deploy.run_status`,
test_superlink_database.py), and a SuperLink that resumes a run after its SuperExec died
(test_superlink_lock.py).
"""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from packaging.requirements import Requirement  # noqa: E402

from medfl.engine import protocol as P  # noqa: E402
from medfl.flower import deploy, proxy, transport  # noqa: E402


def test_the_installed_flower_is_the_pinned_release() -> None:
    pins = [Requirement(r) for r in importlib.metadata.requires("medfl") or [] if r.startswith("flwr")]
    assert {str(p.marker) for p in pins} == {'extra == "flower"', 'extra == "simulation"'}, pins
    installed = importlib.metadata.version("flwr")
    for pin in pins:
        assert pin.specifier.contains(installed), f"flwr {installed} is outside medfl's pin {pin}"
        assert {s.operator for s in pin.specifier} == {">=", "<"}, f"pin one minor release: {pin}"


def test_error_codes_that_medfl_counts_as_dropouts() -> None:
    from flwr.common.constant import ErrorCode

    dropouts = {"MESSAGE_UNAVAILABLE", "REPLY_MESSAGE_UNAVAILABLE", "NODE_UNAVAILABLE", "CLIENT_APP_CRASHED"}
    assert {getattr(ErrorCode, name) for name in dropouts} == transport._DROPOUT_CODES
    assert ErrorCode.CLIENT_APP_RAISED_EXCEPTION not in transport._DROPOUT_CODES   # the site's own error


def test_a_numpy_array_travels_as_npy_bytes() -> None:
    from flwr.app import Array, ArrayRecord, RecordDict

    a = np.arange(6, dtype="<f4").reshape(2, 3)
    assert Array(a).stype == "numpy.ndarray"
    back = proxy.from_records(RecordDict({"x": ArrayRecord({"w": Array(a)})}))
    assert back["x"]["w"].dtype == a.dtype and (back["x"]["w"] == a).all()


def test_the_clientapp_answers_every_medfl_message_type() -> None:
    from flwr.app import Message, RecordDict

    kinds = [getattr(P, name) for name in ("HELLO", "TRAIN", "EVALUATE", "VALIDATE", "SCORE")]
    assert kinds == ["query.hello", "train", "evaluate", "evaluate.validate", "evaluate.score"]
    for kind in kinds:
        Message(RecordDict(), dst_node_id=1, message_type=kind)   # Flower accepts the type
    assert proxy.app is not None and callable(proxy.secure_aggregation_mod)


def test_secaggplus_s_client_mod_and_configs_record() -> None:
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    assert callable(secaggplus_mod) and RECORD_KEY_CONFIGS == "secaggplus_configs"
    from medfl.flower import secagg

    assert secagg.RECORD_KEY_CONFIGS == RECORD_KEY_CONFIGS


def test_the_flower_settings_medfl_sets_are_defaults_a_site_can_change() -> None:
    """Flower's documented variables (docs/flower.md, *Round latency*): medfl's defaults in the
    processes it starts, a site's own value kept."""
    env = deploy.flower_env({})
    assert (env["FLWR_TELEMETRY_ENABLED"], env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"]) == ("0", "0.1")
    mine = deploy.flower_env({"FLWR_TELEMETRY_ENABLED": "1", "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "1"})
    assert (mine["FLWR_TELEMETRY_ENABLED"], mine["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"]) == ("1", "1")
