"""Device capability scores and capability clusters (PFedCDP, section III.B, eqs. 1-2).

Each client has four normalised scores in ``[0, 1]``:

* ``cpu``: current over maximum CPU frequency, ``f_current / f_max``;
* ``memory``: available over total memory, ``M_available / M_total``;
* ``battery``: battery level over 100;
* ``network``: ``1 - latency / max_acceptable_latency`` (clamped to ``[0, 1]``).

:func:`overall_score` combines them with weights (eq. 1) and :func:`assign_cluster` places
the result in the ``"high"``, ``"medium"`` or ``"low"`` cluster by two thresholds (eq. 2).
The scores come either from a seeded simulation draw (:func:`draw_capabilities`), or from
measuring the machine the code runs on (:func:`measure_capabilities`).

Example:
    >>> s = overall_score({"cpu": 0.8, "memory": 0.6, "battery": 1.0, "network": 0.2})
    >>> round(s, 6), assign_cluster(s, t_high=0.7, t_medium=0.4)
    (0.65, 'medium')
"""

from __future__ import annotations

import glob
import math
import os
import socket
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from medfl.seeding import derive_seed

__all__ = ["SCORES", "CLUSTERS", "overall_score", "assign_cluster", "draw_capabilities", "measure_capabilities"]

#: The four capability scores, in the order of eq. 1's weights ``w_1..w_4``.
SCORES: tuple[str, ...] = ("cpu", "memory", "battery", "network")
#: The capability clusters, most capable first.
CLUSTERS: tuple[str, ...] = ("high", "medium", "low")

_EQUAL_WEIGHTS: tuple[float, ...] = (0.25, 0.25, 0.25, 0.25)
_NETWORK_TRIES = 3


def _is_number(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float, np.integer, np.floating))


def _check_unit(name: str, x: Any) -> float:
    if not _is_number(x) or not math.isfinite(float(x)) or not 0.0 <= float(x) <= 1.0:
        raise ValueError(f"{name} must be a finite number in [0, 1], got {x!r}")
    return float(x)


# -- eqs. 1 and 2 -----------------------------------------------------------------------------


def overall_score(scores: Mapping[str, float], weights: Sequence[float] = _EQUAL_WEIGHTS) -> float:
    """The overall capability score ``C_O = w1 C_CPU + w2 C_Mem + w3 C_Battery + w4 C_Net``.

    PFedCDP eq. 1. The paper says the weights "can add up to 1"; we require that they do
    (within 1e-6), so ``C_O`` stays in ``[0, 1]`` and the thresholds of eq. 2 keep their
    meaning.

    Args:
        scores: Exactly the keys of :data:`SCORES`, each a finite number in ``[0, 1]``.
        weights: ``(w_cpu, w_memory, w_battery, w_network)``, non-negative, summing to 1.
            Default equal weights ``(0.25, 0.25, 0.25, 0.25)``.

    Returns:
        The weighted score, in ``[0, 1]``.

    Raises:
        ValueError: A missing, unknown or out-of-range score (the message names the key), or
            weights that are not four non-negative finite numbers summing to 1.
    """
    if not isinstance(scores, Mapping):
        raise ValueError(f"scores must be a mapping of {', '.join(SCORES)}, got {scores!r}")
    missing = [k for k in SCORES if k not in scores]
    if missing:
        raise ValueError(f"scores lack {', '.join(missing)} (need {', '.join(SCORES)})")
    unknown = sorted(str(k) for k in scores if k not in SCORES)
    if unknown:
        raise ValueError(f"unknown score(s) {', '.join(unknown)} (valid: {', '.join(SCORES)})")
    values = [_check_unit(f"scores[{k!r}]", scores[k]) for k in SCORES]
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence) or len(weights) != 4:
        raise ValueError(f"weights must be 4 numbers (one per {', '.join(SCORES)}), got {weights!r}")
    w = []
    for k, wk in zip(SCORES, weights):
        if not _is_number(wk) or not math.isfinite(float(wk)) or float(wk) < 0:
            raise ValueError(f"weight of {k!r} must be a finite number >= 0, got {wk!r}")
        w.append(float(wk))
    if abs(sum(w) - 1.0) > 1e-6:
        raise ValueError(f"weights must sum to 1, got {w!r} (sum {sum(w)!r})")
    return min(1.0, max(0.0, sum(wk * v for wk, v in zip(w, values))))


def assign_cluster(score: float, t_high: float, t_medium: float) -> str:
    """The capability cluster of an overall score (PFedCDP eq. 2).

    ``"high"`` when ``score >= t_high``, ``"medium"`` when ``t_medium <= score < t_high``,
    ``"low"`` when ``score < t_medium``.

    Args:
        score: Overall score from :func:`overall_score`, a finite number in ``[0, 1]``.
        t_high: Threshold ``T_H``.
        t_medium: Threshold ``T_M``; ``0 <= t_medium <= t_high <= 1``.

    Returns:
        One of :data:`CLUSTERS`.

    Raises:
        ValueError: An argument out of range (the message names it).
    """
    s = _check_unit("score", score)
    th = _check_unit("t_high", t_high)
    tm = _check_unit("t_medium", t_medium)
    if tm > th:
        raise ValueError(f"t_medium must be <= t_high, got t_medium={tm!r}, t_high={th!r}")
    if s >= th:
        return "high"
    if s >= tm:
        return "medium"
    return "low"


# -- simulation -------------------------------------------------------------------------------


def draw_capabilities(client_ids: Sequence[str], seed: int) -> dict[str, dict[str, float]]:
    """Simulated capability scores: each score uniform in ``[0, 1]``, rounded to 4 decimals.

    Client ``cid``'s scores come from ``numpy.random.default_rng(derive_seed(seed,
    "capability", cid))``, drawn in the order of :data:`SCORES`, so they depend only on
    ``(seed, cid)``: not on the other clients, their number or their order.

    Args:
        client_ids: Distinct client ids (strings).
        seed: The run seed (an integer).

    Returns:
        ``{cid: {"cpu": ..., "memory": ..., "battery": ..., "network": ...}}`` in the order of
        ``client_ids``.

    Raises:
        ValueError: A non-integer seed, a non-string or duplicate client id.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if isinstance(client_ids, (str, bytes)):
        raise ValueError(f"client_ids must be a list of strings, got {client_ids!r}")
    out: dict[str, dict[str, float]] = {}
    for cid in client_ids:
        if not isinstance(cid, str):
            raise ValueError(f"client ids must be strings, got {cid!r}")
        if cid in out:
            raise ValueError(f"duplicate client id {cid!r} in client_ids")
        rng = np.random.default_rng(derive_seed(int(seed), "capability", cid))
        out[cid] = {k: round(float(rng.uniform(0.0, 1.0)), 4) for k in SCORES}
    return out


# -- measurement ------------------------------------------------------------------------------


def _clamp(x: float) -> float:
    return min(1.0, max(0.0, x))


def _read_number(path: Path) -> float:
    """The single number in ``path``; ValueError naming the file if it is not one.

    OSError (which names the file) if it cannot be read.
    """
    text = path.read_text().strip()
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"{path} holds {text[:40]!r}, not a finite number")
    return value


def _is_real_root(root: Path) -> bool:
    try:
        return root.resolve() == Path(os.sep).resolve()
    except OSError:
        return False


def _cpu_score(root: Path) -> tuple[float, str]:
    cpu_dirs = sorted(glob.glob(str(root / "sys/devices/system/cpu/cpu[0-9]*/cpufreq")))
    ratios: list[float] = []
    max_names: set[str] = set()
    for d in map(Path, cpu_dirs):
        cur = d / "scaling_cur_freq"
        mx = next((d / n for n in ("cpuinfo_max_freq", "scaling_max_freq") if (d / n).is_file()), None)
        if not cur.is_file() or mx is None:
            continue
        try:
            f_cur, f_max = _read_number(cur), _read_number(mx)
        except (OSError, ValueError) as e:
            return 1.0, f"unavailable: garbled cpufreq file ({e}); 1.0"
        if f_max <= 0 or f_cur < 0:
            return 1.0, f"unavailable: garbled {cur} / {mx} ({f_cur:g} / {f_max:g}); 1.0"
        ratios.append(_clamp(f_cur / f_max))
        max_names.add(mx.name)
    if not ratios:
        return 1.0, "unavailable: no cpufreq in sysfs (container or VM?); 1.0"
    return (sum(ratios) / len(ratios),
            f"sysfs scaling_cur_freq/{'+'.join(sorted(max_names))}, mean of {len(ratios)} CPUs")


def _sysconf_memory() -> tuple[float, str]:
    try:
        avail, total = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError) as e:
        return 1.0, f"unavailable: no /proc/meminfo and no os.sysconf page counts ({e}); 1.0"
    if total <= 0 or avail < 0:
        return 1.0, f"unavailable: os.sysconf page counts {avail}/{total}; 1.0"
    return _clamp(avail / total), "os.sysconf SC_AVPHYS_PAGES/SC_PHYS_PAGES"


def _memory_score(root: Path) -> tuple[float, str]:
    meminfo = root / "proc/meminfo"
    if not meminfo.is_file():
        if _is_real_root(root):
            return _sysconf_memory()
        return 1.0, f"unavailable: no {meminfo}; 1.0"
    try:
        fields: dict[str, float] = {}
        for line in meminfo.read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if key in ("MemTotal", "MemAvailable") and parts:
                fields[key] = float(parts[0])
        total, avail = fields["MemTotal"], fields["MemAvailable"]
        if not (math.isfinite(total) and math.isfinite(avail)) or total <= 0 or avail < 0:
            raise ValueError(f"MemAvailable {avail}, MemTotal {total}")
    except (OSError, ValueError, KeyError) as e:
        return 1.0, f"unavailable: garbled {meminfo} ({type(e).__name__}: {e}); 1.0"
    return _clamp(avail / total), "/proc/meminfo MemAvailable/MemTotal"


def _battery_level(d: Path) -> float:
    """Charge fraction of one power-supply entry: capacity, else energy or charge now/full."""
    if (d / "capacity").is_file():
        return _read_number(d / "capacity") / 100.0
    for now, full in (("energy_now", "energy_full"), ("charge_now", "charge_full")):
        if (d / now).is_file() and (d / full).is_file():
            f = _read_number(d / full)
            if f <= 0:
                raise ValueError(f"{d / full} is {f}")
            return _read_number(d / now) / f
    raise ValueError(f"no capacity, energy_now/energy_full or charge_now/charge_full in {d}")


def _battery_score(root: Path) -> tuple[float, str]:
    supplies = root / "sys/class/power_supply"
    if not supplies.is_dir():
        return 1.0, f"unavailable: no {supplies}; 1.0"
    levels: list[float] = []
    names: list[str] = []
    for d in sorted(supplies.iterdir()):
        try:
            if (d / "type").read_text().strip() != "Battery":
                continue
            # peripherals (wireless mice, headsets) report scope "Device": not this machine's
            if (d / "scope").is_file() and (d / "scope").read_text().strip() == "Device":
                continue
        except OSError:
            continue
        try:
            level = _battery_level(d)
        except (OSError, ValueError) as e:
            return 1.0, f"unavailable: garbled battery {d.name} ({e}); 1.0"
        levels.append(_clamp(level))
        names.append(d.name)
    if not levels:
        return 1.0, "no battery: mains powered; 1.0"
    return sum(levels) / len(levels), f"sysfs power_supply {'+'.join(names)} capacity/100"


def _parse_address(coordinator: str) -> tuple[str, int]:
    host, sep, port_s = coordinator.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_s)
    except ValueError:
        port = -1
    if not sep or not host or not 0 < port < 65536:
        raise ValueError(f"coordinator must be 'host:port', got {coordinator!r}")
    return host, port


def _network_score(coordinator: str | None, max_latency_ms: float, timeout_s: float) -> tuple[float, str]:
    if coordinator is None:
        return 1.0, "no coordinator address known; 1.0"
    host, port = _parse_address(coordinator)
    try:
        addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4]
    except OSError as e:
        return 0.0, f"unreachable {coordinator}: cannot resolve {host!r} ({e}); 0.0"
    times_ms: list[float] = []
    for _ in range(_NETWORK_TRIES):
        t0 = time.perf_counter()
        try:
            with socket.create_connection((addr[0], addr[1]), timeout=timeout_s):
                times_ms.append((time.perf_counter() - t0) * 1000.0)
        except OSError as e:
            return 0.0, f"unreachable {coordinator}: {type(e).__name__}: {e}; 0.0"
    latency = statistics.median(times_ms)
    return (_clamp(1.0 - latency / max_latency_ms),
            f"median TCP connect time to {coordinator} over {_NETWORK_TRIES} tries: "
            f"{latency:.2f} ms (max acceptable {max_latency_ms:g} ms)")


def measure_capabilities(coordinator: str | None = None, *, max_latency_ms: float = 200.0, root: str | Path = "/",
                         timeout_s: float = 2.0) -> tuple[dict[str, float], dict[str, str]]:
    """Measure this machine's four capability scores, noting where each came from.

    Sources (Linux files are read under ``root``, so tests can point at a fake tree):

    * cpu: mean over CPUs of ``sys/devices/system/cpu/cpu*/cpufreq/scaling_cur_freq`` over
      ``cpuinfo_max_freq`` (else ``scaling_max_freq``); no cpufreq (containers, VMs): 1.0.
    * memory: ``proc/meminfo`` ``MemAvailable / MemTotal``; without ``proc/meminfo``
      (non-Linux), and only when ``root`` is the real ``/``,
      ``os.sysconf("SC_AVPHYS_PAGES") / os.sysconf("SC_PHYS_PAGES")``; otherwise 1.0.
    * battery: mean of ``capacity / 100`` (else ``energy_now/energy_full`` or
      ``charge_now/charge_full``) over ``sys/class/power_supply/*`` whose ``type`` is
      ``Battery``, skipping peripherals (``scope`` ``Device``); no battery: 1.0 (mains).
    * network: ``1 - latency / max_latency_ms`` clamped to ``[0, 1]``, latency the median of 3
      TCP connect times to ``coordinator`` (the host is resolved once, outside the timing);
      unreachable: 0.0 (after the first failure); no ``coordinator``: 1.0.

    A missing or garbled file never raises: the score takes its fallback and the note says
    why, naming the file.

    Args:
        coordinator: ``"host:port"`` of the coordinator (``"[::1]:8080"`` for IPv6), or None.
        max_latency_ms: Maximum acceptable latency, > 0. Default 200.
        root: Filesystem root for the Linux sources. Default ``"/"``.
        timeout_s: Timeout of each TCP connect, > 0. Default 2.

    Returns:
        ``(scores, notes)``: the four scores keyed by :data:`SCORES`, each in ``[0, 1]``, and a
        note per score, e.g. ``"/proc/meminfo MemAvailable/MemTotal"`` or
        ``"unavailable: no cpufreq in sysfs (container or VM?); 1.0"``.

    Raises:
        ValueError: A malformed ``coordinator`` or a non-positive ``max_latency_ms`` or
            ``timeout_s`` (the message names it).
    """
    for name, value in (("max_latency_ms", max_latency_ms), ("timeout_s", timeout_s)):
        if not _is_number(value) or not math.isfinite(float(value)) or float(value) <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if coordinator is not None and not isinstance(coordinator, str):
        raise ValueError(f"coordinator must be 'host:port' or None, got {coordinator!r}")
    if coordinator is not None:
        _parse_address(coordinator)  # fail on a malformed address before measuring
    base = Path(root)
    results = {"cpu": _cpu_score(base), "memory": _memory_score(base), "battery": _battery_score(base),
               "network": _network_score(coordinator, float(max_latency_ms), float(timeout_s))}
    scores = {k: float(results[k][0]) for k in SCORES}
    notes = {k: results[k][1] for k in SCORES}
    return scores, notes
