"""docs/nvflare.md as written: each of its fenced commands runs, in a folder holding a tiny
``train.json``, through NVFlare's simulator without its deprecated CLI; and what it says of
NVFlare's MONAI integration (monai-nvflare's version limits, its install command beside NVFlare
2.9, which of its modules import) is what the package's own metadata and an install of it into a
temporary folder show."""

from __future__ import annotations

import email
import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("nvflare", reason="NVIDIA FLARE is medfl's optional extra: pip install -e '.[nvflare]'")

from packaging.specifiers import SpecifierSet  # noqa: E402
from test_nvflare import DEPRECATED, FL, SIM_TIMEOUT, run_bounded  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "nvflare.md"
#: a fenced block of the page: its info string and its text
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
#: the longest the registry may take to answer one pip command here
PIP_TIMEOUT = 300


def _section(title: str) -> str:
    """The text of the page's ``## title`` section (up to the next ``## ``)."""
    text = DOC.read_text()
    start = text.find(f"\n## {title}\n")
    assert start >= 0, f"docs/nvflare.md has no section '## {title}'"
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def test_every_fenced_command_of_docs_nvflare_runs_as_written(tmp_path: Path) -> None:
    """Each fenced block of docs/nvflare.md, run by bash as written (stopping at the first
    failing command) in a folder holding a tiny ``train.json`` (2 sites, 1 round of FedAvg,
    relative paths): the run ends with its metrics in that folder (the page's ``--workdir .``),
    and nothing says NVFlare's simulator CLI was used (its deprecation warning)."""
    blocks = FENCE.findall(DOC.read_text())
    assert blocks, "docs/nvflare.md has no fenced command"
    fl = {**json.loads(json.dumps(FL)), "name": "docs", "rounds": 1, "methods": [{"name": "fedavg"}]}
    fl["dataset"]["root"], fl["output_dir"] = "data", "runs"
    (tmp_path / "train.json").write_text(json.dumps({"fl": fl}))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for lang, block in blocks:
        assert lang.strip() in ("", "sh", "bash"), f"a fenced block that is not commands ({lang!r}): {block}"
        assert "nvflare simulator" not in block, block
        code, said = run_bounded(["bash", "-e", "-c", block], SIM_TIMEOUT + PIP_TIMEOUT, cwd=tmp_path, env=env)
        assert code == 0, f"{block}\nexited {code}:\n{said[-4000:]}"
        assert DEPRECATED.split(".")[0] not in said, said[-3000:]
    metrics = tmp_path / "runs" / "docs" / "fedavg" / "metrics.csv"
    assert metrics.is_file(), sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())[:50]
    assert (tmp_path / "ws" / "medfl" / "server" / "simulate_job").is_dir()


def test_the_monai_nvflare_route_is_documented_with_its_limits(tmp_path: Path) -> None:
    """docs/nvflare.md's monai-nvflare section: each ``Requires-...`` line it quotes is in the
    package's metadata (pulled from the registry with ``MEDFL_NETWORK_TESTS=1`` only; skipped where it does not answer), which
    excludes this NVFlare and Python 3.12; its install command, run into a temporary folder
    (``--target``, so that this environment is left as it is), installs it beside this
    NVFlare; ``pip check`` then says what the page quotes; and each of its modules imports, or
    not, as the page says."""
    import nvflare

    section = _section("NVFlare's MONAI integration (monai-nvflare)")
    commands = re.findall(r"`(pip install --no-deps monai-nvflare==([\w.]+))`", section)
    assert len(commands) == 1, commands
    command, version = commands[0]
    quoted = re.findall(r"`(Requires-(?:Dist|Python): [^`]+)`", section)
    assert any(q.startswith("Requires-Dist: nvflare") for q in quoted) and any(
        q.startswith("Requires-Python") for q in quoted), quoted
    said_check = re.search(r"`pip check` then reports\s+`([^`]+)`", section)
    assert said_check, "the page says what `pip check` reports"
    claimed = set(re.findall(r"`(monai_nvflare\.\w+)`", section))
    failing = set(re.findall(r"`(monai_nvflare\.\w+)` does not", section))

    if os.environ.get("MEDFL_NETWORK_TESTS") != "1":   # the page's claims above hold; the suite downloads nothing
        pytest.skip("checking the page against monai-nvflare itself downloads it from the package registry: "
                    "MEDFL_NETWORK_TESTS=1 runs that part")
    wheels = tmp_path / "wheels"
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels),
                           f"monai-nvflare=={version}"], capture_output=True, text=True, timeout=PIP_TIMEOUT)
    if proc.returncode != 0:
        pytest.skip(f"the package registry did not give monai-nvflare {version}: {proc.stderr.strip()[-300:]}")
    wheel = next(wheels.glob("monai_nvflare-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        meta = email.message_from_string(zf.read(f"monai_nvflare-{version}.dist-info/METADATA").decode())
        modules = {f"monai_nvflare.{Path(n).stem}" for n in zf.namelist()
                   if re.fullmatch(r"monai_nvflare/\w+\.py", n) and not n.endswith("__init__.py")}
    lines = [f"Requires-Dist: {r}" for r in meta.get_all("Requires-Dist") or []]
    lines.append(f"Requires-Python: {meta['Requires-Python']}")
    assert set(quoted) <= set(lines), (quoted, lines)
    nvflare_spec = next(r.split("nvflare", 1)[1] for r in meta.get_all("Requires-Dist") if r.startswith("nvflare"))
    assert not SpecifierSet(nvflare_spec).contains(nvflare.__version__, prereleases=True), nvflare_spec
    python = SpecifierSet(meta["Requires-Python"])
    assert python.contains("3.10") and python.contains("3.11") and not python.contains("3.12"), python
    assert claimed == modules, f"the page names {sorted(claimed)}; the package has {sorted(modules)}"

    target = tmp_path / "target"
    proc = subprocess.run([sys.executable, "-m", *shlex.split(command), "--target", str(target)],
                          capture_output=True, text=True, timeout=PIP_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(target)}
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, env=env,
                           timeout=PIP_TIMEOUT).stdout
    assert said_check.group(1).split(" but you have")[0] in check, check
    probe = ("import importlib, json, sys\nout = {}\nfor m in sys.argv[1:]:\n    try:\n"
             "        importlib.import_module(m)\n        out[m] = True\n    except ImportError:\n"
             "        out[m] = False\nprint(json.dumps(out))")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", probe, *sorted(modules)], capture_output=True,
                          text=True, env=env, timeout=PIP_TIMEOUT)
    imported = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {m for m, ok in imported.items() if not ok} == failing, (imported, proc.stderr[-2000:])
