"""Before/after check of medfl's own cost: the same engine_overhead job on two commits, on one
machine, interleaved (issue 50, item 3).

    python benchmarks/compare.py BASE [HEAD] [--pairs 2] [--steps] [-- ENGINE_OVERHEAD ARGS...]

``BASE`` and ``HEAD`` are git revisions of this repository (``HEAD`` left out: the working tree
as it is, uncommitted changes included) or folders holding an unpacked tree (where there is no
``.git``, as on a lent GPU machine: ``bash benchmarks/gpu_session.sh base REV`` makes one). A revision is unpacked with ``git archive`` into a
folder of its own (with a ``medfl_plugins`` link to its ``plugins/``, as an install makes) and
run with that folder first on ``PYTHONPATH``; before timing, each side checks that it imports
medfl and its plugins from its own folder. Then ``benchmarks/engine_overhead.py`` of each side
runs ``--pairs`` times, base and head in turn (ABAB...), with ``--skip-flower --skip-memory``
and the arguments after ``--`` (``--workload resnet2d --device cuda``, ``--repeats 3``...),
each run its own process; with ``--steps`` each side also runs the ``--steps`` job once per
pair.

It prints, per side, the median over the pairs of:

- medfl's own work a round (ms; what medfl does besides the training loop that the plain loop
  does not) and the per-round ratio at equal training speed (engine_overhead's steadier
  figures), and the medfl/plain wall ratio;
- with ``--steps``, each of medfl's steps in ms per client update (the guard, the type walks,
  the wire sizes...);

and head/base for each. ``--json OUT`` writes every run's figures. The machine's speed drifts
between runs (up to 1.8x on a shared VM): read the ratios next to the spread of the pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["prepare", "side_env", "check_imports", "figures", "step_figures", "summarize", "main"]

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str, cwd: Path = ROOT) -> str:
    """The output of ``git ARGS`` in ``cwd``.

    Raises:
        SystemExit: git failed (an unknown revision, not a git checkout), with its message.
    """
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"compare.py: git {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()


def prepare(rev: str | None, work: Path, root: Path = ROOT) -> tuple[Path, str]:
    """The folder to run revision ``rev`` from, and its name for the tables: ``git archive``
    into ``work/<commit>`` (once) with a ``.shim/medfl_plugins`` link to its ``plugins/``;
    ``None``: the working tree ``root`` (a shim made under ``work``); a folder holding
    ``medfl/`` and ``plugins/``: that unpacked tree (its ``COMMIT`` file names it)."""
    if rev is None:
        tree, label = root, "working tree"
        shim = work / "worktree-shim"
    elif (Path(rev) / "medfl").is_dir() and (Path(rev) / "plugins").is_dir():
        # an unpacked tree (a lent GPU machine has no .git: gpu_session.sh base REV carries one)
        tree = Path(rev).resolve()
        named = (tree / "COMMIT").read_text().split() if (tree / "COMMIT").is_file() else []
        label = f"{named[0]} ({named[-1][:10]})" if named else tree.name
        shim = tree / ".shim"
    else:
        commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}", cwd=root)
        tree, label = work / commit[:12], f"{rev} ({commit[:10]})"
        if not (tree / "medfl").is_dir():
            tree.mkdir(parents=True, exist_ok=True)
            archive = subprocess.Popen(["git", "archive", commit], cwd=root, stdout=subprocess.PIPE)
            subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
            if archive.wait():
                raise SystemExit(f"compare.py: git archive {commit} failed")
        shim = tree / ".shim"
    shim.mkdir(parents=True, exist_ok=True)
    link = shim / "medfl_plugins"
    if not link.exists():
        link.symlink_to(tree / "plugins", target_is_directory=True)
    return tree, label


def side_env(tree: Path, work: Path, root: Path = ROOT) -> dict[str, str]:
    """The environment that imports medfl and its plugins from ``tree``."""
    shim = work / "worktree-shim" if tree == root else tree / ".shim"   # (prepare made it)
    old = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tree), str(shim), old) if p)}


def check_imports(tree: Path, env: dict[str, str]) -> None:
    """Make sure a process with ``env`` imports medfl and medfl_plugins from ``tree``.

    Raises:
        SystemExit: it imports them from elsewhere (an install that wins over ``PYTHONPATH``).
    """
    code = "import medfl, medfl_plugins; print(medfl.__file__); print(list(medfl_plugins.__path__)[0])"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tempfile.gettempdir(), capture_output=True,
                          text=True, check=False)
    paths = done.stdout.split()
    if done.returncode or len(paths) != 2 or not all(Path(p).resolve().is_relative_to(tree.resolve()) for p in paths):
        raise SystemExit(f"compare.py: a process meant to run {tree} imports medfl from elsewhere: "
                         f"{done.stdout.strip() or done.stderr.strip()[-500:]}")


def figures(report: dict[str, Any]) -> dict[str, float]:
    """What one engine_overhead ``--json`` report says of medfl's own cost: ``own_ms`` (its own
    work a round), ``per_round_equal`` (per round at equal training speed) and
    ``wall_ratio`` (medfl/plain, median wall).

    Raises:
        ValueError: the report lacks one of them (not an engine_overhead timing report).
    """
    try:
        timing = report["timing"]
        besides = timing["besides_training"]
        return {"own_ms": 1000.0 * float(besides["medfl_own_s"]),
                "per_round_equal": float(besides["per_round_equal_training"]),
                "wall_ratio": float(timing["targets"]["medfl_vs_plain"]["ratio"])}
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not an engine_overhead timing report (no {exc})") from None


def step_figures(report: dict[str, Any]) -> dict[str, float]:
    """Each step's ms per client update from an engine_overhead ``--steps --json`` report.

    Raises:
        ValueError: the report has no steps.
    """
    steps = report.get("steps_ms_per_client_update")
    if not isinstance(steps, dict):
        raise ValueError("not an engine_overhead --steps report (no steps_ms_per_client_update)")
    return {str(k): float(v) for k, v in steps.items()}


def summarize(base: list[dict[str, float]], head: list[dict[str, float]]) -> list[tuple[str, float, float, float]]:
    """``(figure, base median, head median, head/base)`` for every figure both sides have,
    in base's order (a ratio of ``nan`` where base's median is 0)."""
    rows = []
    for key in base[0] if base else []:
        b = [r[key] for r in base if key in r]
        h = [r[key] for r in head if key in r]
        if not b or not h:
            continue
        mb, mh = statistics.median(b), statistics.median(h)
        rows.append((key, mb, mh, mh / mb if mb else float("nan")))
    return rows


def _run(tree: Path, env: dict[str, str], args: list[str], out: Path) -> dict[str, Any]:
    """One engine_overhead run of ``tree`` (its own script) writing ``out``; its report."""
    cmd = [sys.executable, str(tree / "benchmarks" / "engine_overhead.py"), *args, "--json", str(out)]
    print(f"  $ {' '.join(cmd[1:])}", flush=True)
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode or not out.is_file():
        raise SystemExit(f"compare.py: engine_overhead failed in {tree} (exit {done.returncode}):\n"
                         f"{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(out.read_text())


def _table(title: str, rows: list[tuple[str, float, float, float]], base: str, head: str, unit: str) -> None:
    print(f"\n{title}")
    print(f"  {'':<46s} {base[:22]:>22s} {head[:22]:>22s} {'head/base':>10s}")
    for key, b, h, ratio in rows:
        print(f"  {key:<46s} {b:>20.3f}{unit:2s} {h:>20.3f}{unit:2s} {ratio:>10.3f}")


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run both sides interleaved, print (and with ``--json`` write) the figures."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    p = argparse.ArgumentParser(prog="compare.py", description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- go to engine_overhead.py (e.g. -- --workload resnet2d "
                                       "--device cuda --repeats 3).")
    p.add_argument("base", help="the revision to compare against (a commit, tag or branch)")
    p.add_argument("head", nargs="?", default=None, help="the revision to compare (default: the working tree)")
    p.add_argument("--pairs", type=int, default=2, help="base/head runs in turn (default 2)")
    p.add_argument("--steps", action="store_true", help="also time each of medfl's steps a client update (--steps)")
    p.add_argument("--workdir", default=None, help="where the revisions are unpacked (default: a temporary folder)")
    p.add_argument("--json", default=None, help="write every run's figures and the summary here")
    a = p.parse_args(argv)
    if a.pairs < 1:
        p.error("--pairs: expected a number of at least 1")
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="medfl-compare-"))
    sides = []
    for rev in (a.base, a.head):
        tree, label = prepare(rev, work)
        env = side_env(tree, work)
        check_imports(tree, env)
        sides.append((tree, label, env))
    timing = ["--skip-flower", "--skip-memory", *extra]
    runs: dict[str, dict[str, list[dict[str, float]]]] = {"base": {"timing": [], "steps": []},
                                                            "head": {"timing": [], "steps": []}}
    for i in range(a.pairs):
        for name, (tree, label, env) in zip(("base", "head"), sides):
            print(f"pair {i + 1}/{a.pairs}, {name}: {label}", flush=True)
            runs[name]["timing"].append(figures(_run(tree, env, timing, work / f"{name}-{i}.json")))
            if a.steps:
                report = _run(tree, env, [*extra, "--steps"], work / f"{name}-{i}-steps.json")
                runs[name]["steps"].append(step_figures(report))
    base_label, head_label = sides[0][1], sides[1][1]
    summary = {"timing": summarize(runs["base"]["timing"], runs["head"]["timing"]),
               "steps": summarize(runs["base"]["steps"], runs["head"]["steps"]) if a.steps else []}
    print(f"\nbase: {base_label}; head: {head_label}; {a.pairs} pair(s), medians; engine_overhead "
          f"{' '.join(timing)}")
    _table("medfl's own cost (own_ms: its own work a round; per_round_equal: per round at equal training speed; "
           "wall_ratio: medfl/plain)", summary["timing"], base_label, head_label, "")
    for name in ("base", "head"):
        spread = [round(r["own_ms"], 1) for r in runs[name]["timing"]]
        print(f"  own_ms per pair, {name}: {spread}")
    if a.steps:
        _table("medfl's steps, ms per client update", summary["steps"], base_label, head_label, "")
    if a.json:
        Path(a.json).write_text(json.dumps({"base": base_label, "head": head_label, "engine_overhead_args": timing,
                                            "runs": runs, "summary": summary}, indent=2) + "\n")
        print(f"\nFigures written to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
