"""Tests for medfl.capability: PFedCDP eqs. 1-2, the seeded draw and the measurement."""

from __future__ import annotations

import math
import socket
import time
from pathlib import Path

import pytest

from medfl import capability
from medfl.capability import (
    CLUSTERS,
    SCORES,
    assign_cluster,
    draw_capabilities,
    measure_capabilities,
    overall_score,
)

S = {"cpu": 0.8, "memory": 0.6, "battery": 1.0, "network": 0.2}

# (score, t_high, t_medium, cluster): eq. 2, boundaries included
CLUSTER_CASES = [
    (0.7, 0.7, 0.4, "high"),
    (0.69999, 0.7, 0.4, "medium"),
    (0.4, 0.7, 0.4, "medium"),
    (0.39999, 0.7, 0.4, "low"),
    (1.0, 1.0, 0.0, "high"),
    (0.0, 1.0, 0.0, "medium"),
    (0.5, 0.5, 0.5, "high"),
    (0.49, 0.5, 0.5, "low"),
]

BAD_SCORES = [
    ({"cpu": 0.8, "memory": 0.6, "battery": 1.0}, "network"),
    ({**S, "network": 1.2}, "network"),
    ({**S, "cpu": -0.1}, "cpu"),
    ({**S, "memory": float("nan")}, "memory"),
    ({**S, "battery": "1"}, "battery"),
    ({**S, "battery": True}, "battery"),
    ({**S, "gpu": 0.5}, "gpu"),
]

BAD_WEIGHTS = [
    ((0.5, 0.5, 0.5), "weights"),
    ((0.5, 0.5, 0.5, -0.5), "network"),
    ((0.3, 0.3, 0.3, 0.3), "sum to 1"),
    ((0.25, 0.25, float("inf"), 0.25), "battery"),
]


# --------------------------------------------------------------------------------------------
# eq. 1 and eq. 2
# --------------------------------------------------------------------------------------------


def test_overall_score_by_hand() -> None:
    assert overall_score(S) == pytest.approx((0.8 + 0.6 + 1.0 + 0.2) / 4) == pytest.approx(0.65)
    # the paper's example weights (battery less critical)
    by_hand = 0.3 * 0.8 + 0.3 * 0.6 + 0.1 * 1.0 + 0.3 * 0.2
    assert by_hand == pytest.approx(0.58)
    assert overall_score(S, (0.3, 0.3, 0.1, 0.3)) == pytest.approx(by_hand)
    assert overall_score(S, [0, 0, 1, 0]) == 1.0
    assert overall_score(dict.fromkeys(SCORES, 0.0)) == 0.0
    assert overall_score(dict.fromkeys(SCORES, 1.0), (0.1, 0.2, 0.3, 0.4 + 5e-7)) == 1.0


@pytest.mark.parametrize("scores,key", BAD_SCORES)
def test_bad_scores_name_the_key(scores: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        overall_score(scores)


@pytest.mark.parametrize("weights,match", BAD_WEIGHTS)
def test_bad_weights(weights: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        overall_score(S, weights)


@pytest.mark.parametrize("score,t_high,t_medium,cluster", CLUSTER_CASES)
def test_assign_cluster(score: float, t_high: float, t_medium: float, cluster: str) -> None:
    assert assign_cluster(score, t_high, t_medium) == cluster
    assert cluster in CLUSTERS


@pytest.mark.parametrize("args,name", [
    ((0.5, 0.4, 0.7), "t_medium"),
    ((0.5, 1.1, 0.4), "t_high"),
    ((0.5, 0.7, -0.1), "t_medium"),
    ((1.5, 0.7, 0.4), "score"),
    ((float("nan"), 0.7, 0.4), "score"),
])
def test_assign_cluster_bad_arguments(args: tuple, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        assign_cluster(*args)


# --------------------------------------------------------------------------------------------
# simulation draw
# --------------------------------------------------------------------------------------------


def test_draw_is_seeded_and_per_client_stable() -> None:
    ids = [str(i) for i in range(10)]
    first = draw_capabilities(ids, seed=7)
    assert list(first) == ids
    assert first == draw_capabilities(ids, seed=7)
    assert first != draw_capabilities(ids, seed=8)
    # adding, removing or reordering clients leaves the others' scores alone
    more = draw_capabilities([*reversed(ids), "new"], seed=7)
    assert {k: more[k] for k in ids} == first
    assert draw_capabilities(["3"], seed=7) == {"3": first["3"]}
    for scores in first.values():
        assert list(scores) == list(SCORES)
        for v in scores.values():
            assert 0.0 <= v <= 1.0 and round(v, 4) == v
        overall_score(scores)  # valid input for eq. 1
    # not all the same value: a real draw
    assert len({v for s in first.values() for v in s.values()}) > 30


@pytest.mark.parametrize("ids,seed,match", [
    (["a", "a"], 0, "duplicate"),
    ([1, 2], 0, "strings"),
    ("ab", 0, "client_ids"),
    (["a"], 1.5, "seed"),
])
def test_draw_bad_arguments(ids, seed, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        draw_capabilities(ids, seed)


# --------------------------------------------------------------------------------------------
# measurement on a fake tree
# --------------------------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _fake_tree(root: Path) -> Path:
    cpu = root / "sys/devices/system/cpu"
    _write(cpu / "cpu0/cpufreq/scaling_cur_freq", "1200000\n")
    _write(cpu / "cpu0/cpufreq/cpuinfo_max_freq", "2400000\n")
    _write(cpu / "cpu1/cpufreq/scaling_cur_freq", "2400000\n")
    _write(cpu / "cpu1/cpufreq/cpuinfo_max_freq", "2400000\n")
    _write(cpu / "cpufreq/policy0/scaling_cur_freq", "1\n")  # not a cpuN directory: ignored
    _write(root / "proc/meminfo",
           "MemTotal:       16000000 kB\nMemFree:         1000000 kB\n"
           "MemAvailable:    4000000 kB\nBuffers:          100000 kB\n")
    ps = root / "sys/class/power_supply"
    _write(ps / "BAT0/type", "Battery\n")
    _write(ps / "BAT0/capacity", "40\n")
    _write(ps / "AC/type", "Mains\n")
    _write(ps / "AC/online", "1\n")
    _write(ps / "AC/capacity", "100\n")  # a Mains entry never counts, whatever it holds
    return root


def test_measure_fake_tree_by_hand(tmp_path: Path) -> None:
    scores, notes = measure_capabilities(root=_fake_tree(tmp_path))
    assert scores["cpu"] == pytest.approx((1.2 / 2.4 + 2.4 / 2.4) / 2)  # 0.75
    assert scores["memory"] == pytest.approx(4000000 / 16000000)  # 0.25
    assert scores["battery"] == pytest.approx(0.40)
    assert scores["network"] == 1.0
    assert list(scores) == list(SCORES) == list(notes)
    assert "scaling_cur_freq/cpuinfo_max_freq" in notes["cpu"] and "2 CPUs" in notes["cpu"]
    assert "MemAvailable/MemTotal" in notes["memory"]
    assert "BAT0" in notes["battery"] and "AC" not in notes["battery"]
    assert notes["network"].startswith("no coordinator address known")
    assert overall_score(scores) == pytest.approx((0.75 + 0.25 + 0.4 + 1.0) / 4)


def test_measure_fallbacks_scaling_max_and_several_batteries(tmp_path: Path) -> None:
    root = _fake_tree(tmp_path)
    cpu1 = root / "sys/devices/system/cpu/cpu1/cpufreq"
    (cpu1 / "cpuinfo_max_freq").unlink()
    _write(cpu1 / "scaling_max_freq", "4800000")
    ps = root / "sys/class/power_supply"
    _write(ps / "BAT1/type", "Battery")
    _write(ps / "BAT1/energy_now", "30")
    _write(ps / "BAT1/energy_full", "50")
    _write(ps / "hidpp_battery_0/type", "Battery")  # a wireless mouse: ignored
    _write(ps / "hidpp_battery_0/scope", "Device")
    _write(ps / "hidpp_battery_0/capacity", "5")
    scores, notes = measure_capabilities(root=root)
    assert scores["cpu"] == pytest.approx((0.5 + 0.5) / 2)
    assert "scaling_max_freq" in notes["cpu"]
    assert scores["battery"] == pytest.approx((0.4 + 0.6) / 2)
    assert "hidpp" not in notes["battery"]


def test_measure_missing_tree_gives_fallbacks_with_notes(tmp_path: Path) -> None:
    scores, notes = measure_capabilities(root=tmp_path / "nothing")
    assert scores == dict.fromkeys(SCORES, 1.0)
    assert "no cpufreq" in notes["cpu"]
    assert "unavailable" in notes["memory"] and "meminfo" in notes["memory"]
    assert "unavailable" in notes["battery"] and "power_supply" in notes["battery"]
    assert "no coordinator" in notes["network"]


def test_measure_mains_only_is_full_battery(tmp_path: Path) -> None:
    root = _fake_tree(tmp_path)
    for f in (root / "sys/class/power_supply/BAT0").iterdir():
        f.unlink()
    (root / "sys/class/power_supply/BAT0").rmdir()
    scores, notes = measure_capabilities(root=root)
    assert scores["battery"] == 1.0 and notes["battery"].startswith("no battery: mains powered")


@pytest.mark.parametrize("relpath,text,key", [
    ("sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq", "fast\n", "cpu"),
    ("sys/devices/system/cpu/cpu1/cpufreq/cpuinfo_max_freq", "0\n", "cpu"),
    ("proc/meminfo", "MemTotal: lots kB\nMemAvailable: 5 kB\n", "memory"),
    ("proc/meminfo", "MemTotal: 100 kB\n", "memory"),
    ("sys/class/power_supply/BAT0/capacity", "\n", "battery"),
])
def test_measure_garbled_file_falls_back_naming_it(
    tmp_path: Path, relpath: str, text: str, key: str
) -> None:
    root = _fake_tree(tmp_path)
    _write(root / relpath, text)
    scores, notes = measure_capabilities(root=root)
    assert scores[key] == 1.0
    name = Path(relpath).name if key != "cpu" else "cpu"
    assert "garbled" in notes[key] and name in notes[key]
    others = {"cpu": 0.75, "memory": 0.25, "battery": 0.4}
    for k, v in others.items():
        if k != key:
            assert scores[k] == pytest.approx(v)


def test_sysconf_memory_fallback() -> None:
    value, note = capability._sysconf_memory()
    assert 0.0 <= value <= 1.0 and note


# --------------------------------------------------------------------------------------------
# network
# --------------------------------------------------------------------------------------------


def test_network_listening_socket(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        port = srv.getsockname()[1]
        scores, notes = measure_capabilities(f"127.0.0.1:{port}", root=tmp_path)
    assert 0.0 < scores["network"] <= 1.0
    assert "median TCP connect" in notes["network"] and f"127.0.0.1:{port}" in notes["network"]


def test_network_closed_port_is_zero_and_quick(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again on leaving the block: nobody listens
    t0 = time.perf_counter()
    scores, notes = measure_capabilities(f"127.0.0.1:{port}", root=tmp_path, timeout_s=1.0)
    assert time.perf_counter() - t0 < 1.0
    assert scores["network"] == 0.0
    assert notes["network"].startswith("unreachable") and "Error" in notes["network"]


def test_network_latency_formula(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``1 - median latency / max_latency``, clamped: a fake clock gives 50, 10, 90 ms."""
    ticks = iter([0.0, 0.050, 1.0, 1.010, 2.0, 2.090])

    class Conn:
        def __enter__(self) -> Conn:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(capability.time, "perf_counter", lambda: next(ticks))
    monkeypatch.setattr(capability.socket, "create_connection", lambda addr, timeout: Conn())
    scores, _ = measure_capabilities("127.0.0.1:9", root=tmp_path, max_latency_ms=200.0)
    assert scores["network"] == pytest.approx(1 - 50 / 200)
    ticks = iter([0.0, 0.5] * 3)
    scores, _ = measure_capabilities("127.0.0.1:9", root=tmp_path, max_latency_ms=200.0)
    assert scores["network"] == 0.0
    assert math.isfinite(scores["network"])


@pytest.mark.parametrize("kwargs,name", [
    ({"coordinator": "localhost"}, "coordinator"),
    ({"coordinator": "localhost:http"}, "coordinator"),
    ({"coordinator": ":8080"}, "coordinator"),
    ({"coordinator": "localhost:70000"}, "coordinator"),
    ({"max_latency_ms": 0}, "max_latency_ms"),
    ({"timeout_s": -1.0}, "timeout_s"),
])
def test_measure_bad_arguments(kwargs: dict, name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=name):
        measure_capabilities(root=tmp_path, **kwargs)
