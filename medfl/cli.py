"""The ``medfl`` command line: plugins, run, resume, report, runs, approve, policy, flower, bundles."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

__all__ = ["main", "build_parser"]

logger = logging.getLogger(__name__)


def _parse_overrides(items: list[str]) -> dict[str, Any]:
    from medfl.bundle import parse_override_value

    out: dict[str, Any] = {}
    i = 0
    while i < len(items):
        item = items[i]
        if item.startswith("--"):
            key = item[2:]
            if "=" in key:
                key, value = key.split("=", 1)
            else:
                if i + 1 >= len(items):
                    raise SystemExit(f"medfl: override {item} has no value")
                value = items[i + 1]
                i += 1
        elif "=" in item:
            key, value = item.split("=", 1)
        else:
            raise SystemExit(f"medfl: cannot read override {item!r}; use --fl#rounds 3 or fl#rounds=3")
        out[key] = parse_override_value(value)
        i += 1
    return out


def _subparser(*names: str) -> argparse.ArgumentParser:
    """The parser of the command ``medfl NAMES...`` (e.g. ``("flower", "site")``)."""
    parser = build_parser()
    for name in names:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _options_after_overrides(args: argparse.Namespace, *names: str) -> list[str]:
    """Parse into ``args`` the options of the command ``medfl NAMES...`` that came after its
    config overrides (its ``overrides`` positional takes everything after the first one:
    ``medfl flower site ... fl#dataset#root=/data --port 9095``); return the overrides left.
    Options win: an override key spelled like an option (``--device cuda``) is the option."""
    import copy

    late = argparse.ArgumentParser(prog="medfl " + " ".join(names), add_help=False, allow_abbrev=False)
    for action in _subparser(*names)._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            again = copy.copy(action)
            again.required, again.default = False, argparse.SUPPRESS   # given earlier or not at all
            late._add_action(again)
    _, rest = late.parse_known_args(list(args.overrides or []), namespace=args)
    return rest


#: help of ``--threads`` (``medfl run``, ``resume``, ``flower site``, ``flower run``)
_THREADS_HELP = ("torch threads of each process that trains: a number, or auto (the default: the cores this "
                 "process may use divided among the processes training on them; Ray actors, sites medfl started "
                 "together, pytest-xdist workers); wins over the config's fl#threads")


def _add_threads_option(sp: argparse.ArgumentParser) -> None:
    """Give the command ``sp`` the ``--threads N|auto`` option (see :func:`_apply_threads`)."""
    sp.add_argument("--threads", default=None, metavar="N|auto", help=_THREADS_HELP)


def _apply_threads(args: argparse.Namespace) -> None:
    """Check ``--threads`` and put it in ``MEDFL_THREADS``, where every process of this command
    reads it (:func:`medfl.config.threads_setting`: before ``fl.threads``; a site's worker and
    Ray actors get the number it gives). Absent: nothing changes."""
    import os

    from medfl.config import THREADS_ENV, check_threads

    value = getattr(args, "threads", None)
    if value is not None:
        os.environ[THREADS_ENV] = str(check_threads(value, "--threads"))


def cmd_plugins(args: argparse.Namespace) -> int:
    """List every plugin and what it registered, or describe one name (``medfl plugins NAME``)."""
    from medfl.plugins import PLUGIN_API_VERSION, plugin_info, registry

    if args.name:
        return _describe_plugin(args.name, args.json)
    if args.json:
        print(json.dumps(plugin_info(), indent=2))
        return 0
    reg = registry()
    print(f"medfl plugin API {PLUGIN_API_VERSION}; `medfl plugins NAME` describes one")
    for kind, table in reg.items():
        print(f"{kind}s:")
        clashes = reg.clashes(kind)
        for name, r in sorted(table.items()):
            doc = getattr(r.obj, "description", "") or (getattr(r.obj, "__doc__", "") or "").strip().split("\n")[0]
            mark = f"  [clash: '{r.name}' is ambiguous, write {name}]" if r.name in clashes else ""
            print(f"  {name:<16} {r.qualified:<24} {r.version:<8} {doc}{mark}")
            for pname, preset in sorted((getattr(r.obj, "presets", None) or {}).items()):
                print(f"  {'':<16}   preset {pname!r}: {preset.description or preset.source}")
    refused = [p for p in plugin_info() if p["refused"]]
    for p in refused:
        print(f"skipped: {p['refused']}")
    return 0


def _describe_plugin(name: str, as_json: bool) -> int:
    """``medfl plugins NAME``: each thing registered as ``NAME`` with its parameters and docstring."""
    from medfl.plugins import describe

    found = describe(name)
    if as_json:
        print(json.dumps(found, indent=2))
        return 0
    for i, d in enumerate(found):
        if i:
            print()
        print(f"{d['kind']} {d['qualified']}  ({d['distribution']} {d['version']}, plugin {d['plugin']!r})")
        if d["clashes_with"]:
            print(f"  clash: '{d['name']}' is also registered as {', '.join(d['clashes_with'])}; "
                  f"configs must write the qualified name")
        if d["description"]:
            print(f"  {d['description']}")
        print("  parameters:" if d["parameters"] else "  parameters: none")
        for p in d["parameters"]:
            default = "required" if p["required"] else f"default {json.dumps(p['default'])}"
            print(f"    {p['name']:<22} {p['type'] or '-':<14} {default}")
        for pname, preset in d["presets"].items():
            _print_preset(pname, preset)
        if d["doc"]:
            print("\n" + "\n".join("  " + line if line else "" for line in d["doc"].splitlines()))
    return 0


def _print_preset(name: str, preset: dict[str, Any]) -> None:
    """One preset of ``medfl plugins NAME``: its description and source, then every value and
    ``train`` setting with where it comes from (kind and citation)."""
    print(f"  preset {name!r}: {preset['description'] or preset['source']}")
    if preset["description"]:
        print(f"    source: {preset['source']}")
    settings = {**preset["values"], **{f"train.{k}": v for k, v in preset["train"].items()}}
    for key, value in settings.items():
        origin = preset["sources"][key]
        print(f"    {key:<22} {json.dumps(value):<14} {origin['from']}: {origin.get('source', '')}")


def cmd_run(args: argparse.Namespace) -> int:
    """Run a bundle config's experiment."""
    from medfl.bundle import load_bundle_config, run

    fl = load_bundle_config(args.config, _parse_overrides(_options_after_overrides(args, "run")))
    _apply_threads(args)
    _configure_logging(args)   # -v/-q may come after the config (medfl run train.json -q)
    if getattr(args, "backend", None):   # keeps the config's backend resources
        backend = fl.get("backend")
        fl["backend"] = {**backend, "name": args.backend} if isinstance(backend, dict) else args.backend
    _add_tracking(fl, getattr(args, "tracking", None))
    run(fl, exit_on_error=False)  # main() reports medfl's errors
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    """Continue a stopped run."""
    from medfl.report import print_result
    from medfl.experiment import resume

    _apply_threads(args)
    from medfl.config import set_threads

    set_threads(None)   # --threads, else "auto"; a number in the saved fl.threads wins over "auto" (resume)
    print_result(resume(args.run_dir, rounds=args.rounds, tracking=args.tracking))
    return 0


def _add_tracking(fl: dict[str, Any], names: list[str] | None) -> None:
    """``--tracking NAME``: add each tracker to the config's ``fl.tracking`` (one the config
    names already keeps its options)."""
    if not names:
        return
    entries = fl.get("tracking") or []
    entries = [entries] if isinstance(entries, (str, dict)) else list(entries)
    have = {e if isinstance(e, str) else e.get("name") for e in entries if isinstance(e, (str, dict))}
    fl["tracking"] = entries + [{"name": n} for n in dict.fromkeys(names) if n not in have]


def _flower_tracking(config: str, overrides: dict[str, Any] | None, names: list[str]) -> list[Any]:
    """``medfl flower run --tracking NAME``: the config's ``fl.tracking`` with each tracker
    added (checked here, before anything starts: an unknown name or a tracker whose package
    is missing is refused now, not in the coordinator), as the override the coordinator gets."""
    from medfl.bundle import load_bundle_config
    from medfl.config import check_tracking

    fl = load_bundle_config(config, overrides or {})
    _add_tracking(fl, names)
    check_tracking(fl["tracking"])
    return fl["tracking"]


def _tracking_option(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--tracking", action="append", default=None, metavar="NAME",
                    help="track the experiment with this tracker too (repeatable): mlflow (an embedded SQLite "
                         "store in the experiment directory unless fl#tracking gives a uri), tensorboard, or one a "
                         "plugin registered (`medfl plugins`); needs pip install \"medfl[tracking]\"")


def cmd_report(args: argparse.Namespace) -> int:
    """Print a run's summary table and (re)write its plots (an experiment's too)."""
    from medfl.report import format_table, summary_table
    from medfl.report_plots import write_experiment_plots, write_plots

    from medfl.runs import missing_folder

    path = Path(args.run_dir)
    if missing_folder(path):
        logger.error(f"medfl: {missing_folder(path)}")
        return 2
    is_run = (path / "metrics.csv").is_file()
    run_dirs = [path] if is_run else sorted(
        p.parent for p in path.rglob("metrics.csv"))  # experiments, and their seed_<s>/ or fold_<k>/
    if not run_dirs:
        logger.error(f"medfl: {path}: no metrics.csv here or in its subdirectories")
        return 2
    for table in ("seeds_table.md", "cv_table.md"):
        if (path / table).is_file():
            print(f"\n== {path / table}")
            print((path / table).read_text())
    for run_dir in run_dirs:
        print(f"\n== {run_dir}")
        print(format_table(summary_table(run_dir)))
        for p in write_plots(run_dir):
            print(f"wrote {p}")
    if not is_run:
        for p in write_experiment_plots(path):
            print(f"wrote {p}")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    """List the runs under a folder as one table (or JSON / CSV), oldest first; say on stderr
    how many folders at ``--depth`` were not searched further, and the commands that reach them."""
    import shlex

    from medfl.runs import DEFAULT_DEPTH, format_runs, list_runs, runs_csv, runs_json

    if args.depth < 0:
        logger.error(f"medfl: error: --depth: expected how many folders deep to look (0: DIR itself), got {args.depth}")
        return 2
    unsearched: list[Path] = []
    try:
        rows = list_runs(args.dir, depth=args.depth, unsearched=unsearched)
    except NotADirectoryError as exc:
        logger.error(f"medfl: error: {exc}")
        return 2
    if unsearched:   # never silent: runs there would be missing from the list
        logger.warning(f"medfl runs: {len(unsearched)} folder(s) {args.depth} level(s) below {args.dir} have subfolders "
                       f"that were not searched (e.g. {unsearched[0]}); to list runs there: medfl runs "
                       f"{shlex.quote(str(args.dir))} --depth {args.depth + DEFAULT_DEPTH}, or medfl runs "
                       f"{shlex.quote(str(unsearched[0]))}")
    if args.json:
        print(runs_json(rows))
    elif args.csv:
        print(runs_csv(rows), end="")
    elif not rows:
        print(f"medfl runs: no runs under {args.dir} (looked {args.depth} folder level(s) deep; --depth looks "
              "deeper)")
    else:
        print(format_runs(rows))
    return 0


def _add_runs(sub: Any) -> None:
    """The ``medfl runs`` command."""
    from medfl.runs import DEFAULT_DEPTH

    sp = sub.add_parser("runs", help="list the runs under a folder: status, method, rounds, headline metric, "
                                     "epsilon, last modified",
                        description="List every run under DIR (searched recursively: experiments, their folds and "
                                    "seeds, each method's run), oldest first: status (finished, running (locked), "
                                    "stopped, interrupted, failed, failed to start, crashed, or corrupt: <why>), method, "
                                    "rounds done/"
                                    "planned, the headline metric (the run's own: fl.early_stopping's metric, else "
                                    "fl.cv.metric under cross-validation, else accuracy; on local_test where "
                                    "evaluated; the value's column is named by it) of the final "
                                    "round (early stopping's best round) or, before the end, of the last round, the "
                                    "epsilon spent by the worst client ('-' without differential privacy) and when "
                                    "the run last wrote a file.")
    sp.add_argument("dir", nargs="?", default=".", help="folder to search (default: the current one)")
    fmt = sp.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    fmt.add_argument("--csv", action="store_true", help="print the rows as CSV")
    sp.add_argument("--depth", type=int, default=DEFAULT_DEPTH,
                    help=f"how many folders deep to look for runs (default {DEFAULT_DEPTH}); stderr says how many "
                         "folders at that depth have subfolders left unsearched")
    sp.set_defaults(func=cmd_runs)


def _code_summary(files: dict[str, str]) -> str:
    """``93 files (medfl/: 80, plugins/: 13)``: what an approval pins, in one line."""
    tops: dict[str, int] = {}
    for f in files:
        top = f.split("/")[0] + ("/" if "/" in f else "")
        tops[top] = tops.get(top, 0) + 1
    return f"{len(files)} files ({', '.join(f'{t}: {n}' for t, n in sorted(tops.items()))})"


def cmd_approve(args: argparse.Namespace) -> int:
    """Record, revoke or list the plugins a site's operator approves (:mod:`medfl.approval`).
    Every name is checked before the file is written or anything is printed: all of them are
    recorded (or revoked), or none, with one ``medfl: error:`` line naming each name refused
    (a name that is another kind of plugin, e.g. a model, names the ``--kind`` that takes it)."""
    from medfl.approval import (APPROVED_KINDS, ApprovalError, Approvals, approval_identities, approvals_path,
                                code_identity)
    from medfl.plugins import registry

    path = Path(args.file) if args.file else (approvals_path() or Path("approvals.json"))
    cache: dict[Any, Any] = {}
    try:
        if args.list:
            approvals = Approvals.load(path)
            print(f"{path}:")
            for (kind, name), entry in sorted(approvals.entries.items()):
                try:
                    status = (approvals.refusal(code_identity(kind, name, cache))
                              or "ok: the installed code is the approved code")
                except ApprovalError as exc:
                    status = str(exc)
                print(f"  {kind} {name!r} ({entry.get('distribution')} {entry.get('version')}, "
                      f"sha256 {entry['sha256'][:12]}..., approved {entry.get('approved_at', '?')}): {status}")
            return 0
        approvals = Approvals.load(path, missing_ok=True)
        if args.update:
            wanted = sorted(approvals.entries)
        elif args.all:
            kinds = [args.kind] if args.kind else list(APPROVED_KINDS)
            wanted = [(k, n) for k in kinds for n in sorted(registry().get(k, {}))]
        elif args.names:
            wanted = [(args.kind or "method", n) for n in args.names]
        else:
            raise SystemExit("medfl approve: name the plugin(s) to approve (or --all, --update, --list)")
        # every name checked before anything is written or said: all of them, or none
        revoked = wanted if args.revoke else []
        try:
            approvals.check_listed(revoked)
            identities = [] if args.revoke else approval_identities(wanted, cache)
        except ApprovalError as exc:
            raise ApprovalError(f"{exc}; nothing was written to {path}") from None
        for kind, name in revoked:
            approvals.revoke(kind, name)
        for identity in identities:
            approvals.approve(identity)
        approvals.save()
        for kind, name in revoked:
            print(f"revoked {kind} {name!r} in {path}")
        for identity in identities:
            print(f"approved {identity.describe()} in {path}; its code: {_code_summary(identity.files)}")
    except ApprovalError as exc:
        logger.error(f"medfl: error: {exc}")
        return 2
    return 0


def _add_approve(sub: Any) -> None:
    sp = sub.add_parser("approve", help="approve plugins to run at this site: name, version, hash of every file "
                                        "that runs with them",
                        description="Record in an approvals file the identity of installed plugins (distribution, "
                                    "version, SHA-256 of every source file that runs with them: their "
                                    "distribution, the modules they import, medfl itself) after reviewing their "
                                    "code; a site started with --approvals FILE runs nothing else (see "
                                    "docs/flower.md). `medfl approve --all` approves the whole install; "
                                    "`medfl approve --update` approves again, as installed now, everything the "
                                    "file lists (after an upgrade). The file's privacy policy: `medfl policy`.")
    sp.add_argument("names", nargs="*", help="registered names, e.g. fedavg fedskd")
    sp.add_argument("--kind", default=None,
                    help="plugin kind: method (default), filter, model, metric, dataset, partitioner")
    sp.add_argument("--file", default=None,
                    help="approvals file (default: $MEDFL_APPROVALS, else approvals.json here)")
    sp.add_argument("--all", action="store_true",
                    help="every installed plugin (of --kind, or of every kind a site runs)")
    sp.add_argument("--update", action="store_true",
                    help="approve again, as installed now, every plugin the file lists")
    sp.add_argument("--revoke", action="store_true", help="remove the approvals of the names instead")
    sp.add_argument("--list", action="store_true", help="list the approvals and whether the installed code matches")
    sp.set_defaults(func=cmd_approve)


def cmd_policy(args: argparse.Namespace) -> int:
    """Write or show the privacy policy of a site's approvals file (:mod:`medfl.policy`)."""
    from medfl.approval import ApprovalError, Approvals, approvals_path
    from medfl.policy import PolicyError, SitePolicy

    path = Path(args.file) if args.file else (approvals_path() or Path("approvals.json"))
    try:
        approvals = Approvals.load(path, missing_ok=True)
        rules: dict[str, Any] = {} if args.clear else dict(approvals.policy or {})
        if args.mechanisms is not None:
            rules["mechanisms"] = [m.strip() for m in args.mechanisms.split(",") if m.strip()]
        total = args.max_epsilon_total
        if args.max_epsilon is not None and total is None and "max_epsilon_total" not in rules:
            raise PolicyError("--max-epsilon caps each run anew: give --max-epsilon-total NUMBER too (the cap over "
                              "every run on this site's data set), or --max-epsilon-total none for no such cap")
        if total is not None and total.strip().lower() == "none":
            rules.pop("max_epsilon_total", None)
        elif total is not None:
            try:
                rules["max_epsilon_total"] = float(total)
            except ValueError:
                raise PolicyError(f"--max-epsilon-total: expected a number or none, got {total!r}") from None
        for key in ("max_epsilon", "max_epsilon_per_release", "max_delta", "min_noise_multiplier"):
            if getattr(args, key) is not None:
                rules[key] = getattr(args, key)
        for text in args.require_filter or []:
            rules.setdefault("required_filters", []).append(_required_filter(text))
        if args.cross_test is not None:
            rules["cross_test"] = args.cross_test == "yes"
        changed = args.clear or rules != (approvals.policy or {})
        policy = SitePolicy.from_dict(rules, f"policy of {path}")
        if changed:
            approvals.policy = policy.to_dict() or None
            approvals.save()
            print(f"wrote the privacy policy of {path}:")
        else:
            print(f"privacy policy of {path}:")
        for line in policy.describe():
            print(f"  {line}")
    except ApprovalError as exc:
        logger.error(f"medfl: error: {exc}")
        return 2
    return 0


def _required_filter(text: str) -> dict[str, Any]:
    """``quantize:bits<=8,bits>=2`` -> ``{"name": "quantize", "max": {"bits": 8}, "min": {"bits": 2}}``."""
    from medfl.policy import PolicyError

    name, _, bounds = text.partition(":")
    out: dict[str, Any] = {"name": name.strip(), "max": {}, "min": {}}
    for part in filter(None, (b.strip() for b in bounds.split(","))):
        for op, key in (("<=", "max"), (">=", "min")):
            if op in part:
                param, _, value = part.partition(op)
                try:
                    out[key][param.strip()] = float(value)
                except ValueError:
                    raise PolicyError(f"--require-filter {text!r}: {value.strip()!r} is not a number") from None
                break
        else:
            raise PolicyError(f"--require-filter {text!r}: expected FILTER[:PARAM<=NUMBER,PARAM>=NUMBER...], "
                              f"e.g. quantize:bits<=8")
    return out


def _add_policy(sub: Any) -> None:
    sp = sub.add_parser("policy", help="write or show the least privacy this site accepts (in its approvals file)",
                        description="A site's privacy policy, kept in its approvals file: every message asking "
                                    "for less is refused at the site, naming the rule, before the method's code "
                                    "runs (see docs/privacy.md). Without options: show it. Options add to the "
                                    "policy in the file (--clear starts from none).")
    sp.add_argument("--file", default=None,
                    help="approvals file (default: $MEDFL_APPROVALS, else approvals.json here)")
    sp.add_argument("--mechanisms", default=None,
                    help="comma-separated DP mechanisms accepted, e.g. dp_gaussian,dp_sgd")
    sp.add_argument("--max-epsilon", dest="max_epsilon", type=float, default=None,
                    help="largest epsilon of one run at this site, each run anew (computed by the site from the noise "
                         "it applies); needs --max-epsilon-total")
    sp.add_argument("--max-epsilon-total", dest="max_epsilon_total", default=None, metavar="NUMBER|none",
                    help="largest epsilon of this site's data set over every run it serves (counted by the site in "
                         "<state-dir>/budget.jsonl; see medfl budget); none: no such cap")
    sp.add_argument("--max-epsilon-per-release", dest="max_epsilon_per_release", type=float, default=None,
                    help="largest epsilon of one release (one noised reply, one DP-SGD update)")
    sp.add_argument("--max-delta", dest="max_delta", type=float, default=None,
                    help="largest delta of any release, and the delta every epsilon is computed at (default 1e-5)")
    sp.add_argument("--min-noise-multiplier", dest="min_noise_multiplier", type=float, default=None,
                    help="smallest noise multiplier of any Gaussian release")
    sp.add_argument("--require-filter", dest="require_filter", action="append", default=None, metavar="SPEC",
                    help="a reply filter every run must apply, with bounds on its parameters: quantize:bits<=8 "
                         "(repeatable)")
    sp.add_argument("--cross-test", dest="cross_test", choices=["yes", "no"], default=None,
                    help="whether this site may send its evaluation model (without noise) for cross_test (default: "
                         "yes without an epsilon cap, no with one)")
    sp.add_argument("--clear", action="store_true", help="start from an empty policy")
    sp.set_defaults(func=cmd_policy)


def cmd_budget(args: argparse.Namespace) -> int:
    """Print what a site released of its data, per run and in all (:mod:`medfl.budget`), at
    the delta of its policy (in its approvals file), with the policy's caps."""
    from medfl.approval import ApprovalError, Approvals, approvals_path
    from medfl.budget import BUDGET_FILE, BudgetRefused, SiteBudget
    from medfl.policy import SitePolicy

    file = Path(args.file) if args.file else (approvals_path() or Path("approvals.json"))
    try:
        rules = Approvals.load(file, missing_ok=True).policy
        policy = SitePolicy.from_dict(rules, f"policy of {file}") if rules else SitePolicy()
        records = SiteBudget(Path(args.state_dir), "", "", "medfl budget", policy).records()
    except (ApprovalError, BudgetRefused) as exc:
        logger.error(f"medfl: error: {exc}")
        return 2
    path = Path(args.state_dir) / BUDGET_FILE
    if not path.is_file():
        logger.error(f"medfl: error: no {BUDGET_FILE} in {args.state_dir}: this site has made no DP release yet "
                     "(or the path is not a site's --state-dir)")
        return 2
    total = policy.max_epsilon_total
    print(f"policy ({file if rules else 'none'}): max_epsilon "
          f"{'none' if policy.max_epsilon is None else f'{policy.max_epsilon:g}'} per run, max_epsilon_total "
          f"{'none' if total is None else f'{total:g}'} over every run on a data set; epsilon at delta "
          f"{policy.delta:g}")
    datas = list(dict.fromkeys(str(r["data"]) for r in records if r["type"] == "spend"))
    if not datas:
        print(f"{path}: no DP release recorded")
    for data in datas:
        client = next(str(r["client"]) for r in records if r["data"] == data)
        rows = SiteBudget(Path(args.state_dir), data, client, "medfl budget", policy).table()
        if args.run:
            rows = [r for r in rows if r["run"] in (args.run, "(all runs)")]
        print(f"data set {data} (client {client}), counted by the site from {path}:")
        width = max(len(str(r["run"])) for r in rows)
        for r in rows:
            print(f"  {str(r['run']):<{width}}  epsilon {r['epsilon']:.4g}  rounds {r['rounds']:>4}  {r['mechanisms']}")
    return 0


def _add_budget(sub: Any) -> None:
    sp = sub.add_parser("budget", help="what this site released of its data, per run and in all",
                        description="A site counts every DP release it makes (medfl flower site keeps it in "
                                    "<state-dir>/budget.jsonl, written before each reply leaves) and composes them "
                                    "with Opacus's accountant, per run and over every run on the same data set, at "
                                    "its policy's delta: what its policy's --max-epsilon (per run) and "
                                    "--max-epsilon-total (over every run) are checked against, printed beside it "
                                    "(docs/privacy.md).")
    sp.add_argument("state_dir", help="the site's --state-dir")
    sp.add_argument("--file", default=None,
                    help="the site's approvals file, with its policy (default: $MEDFL_APPROVALS, else approvals.json "
                         "here; none: no caps, delta 1e-5)")
    sp.add_argument("--run", default=None, help="only this run id (and the total)")
    sp.set_defaults(func=cmd_budget)


def _site_approvals(args: argparse.Namespace) -> None:
    """Enforce ``--approvals FILE`` at this site (through :data:`medfl.approval.APPROVALS_ENV`,
    which the site worker in this process reads), or warn that no approvals are enforced."""
    import os

    from medfl.approval import APPROVALS_ENV, OPT_OUT, ApprovalError, Approvals, approvals_path

    given = getattr(args, "approvals", None)
    path = Path(given).resolve() if given and given != OPT_OUT else None if given else approvals_path()
    who = f"medfl site {args.client_id}"
    if path is None:
        if given:   # opted out by name: the worker in this process must not read an older MEDFL_APPROVALS
            os.environ[APPROVALS_ENV] = OPT_OUT
        logger.warning(f"{who}: WARNING: no --approvals file: this site runs any method installed here that the coordinator "
                       "names; review and approve methods with `medfl approve NAME --file approvals.json` and start the site "
                       "with --approvals approvals.json")
        return
    try:
        approvals = Approvals.load(path)
    except ApprovalError as exc:
        raise SystemExit(f"{who}: {exc}") from None
    os.environ[APPROVALS_ENV] = str(path)
    names = ", ".join(f"{k} {n!r}" for k, n in sorted(approvals.entries)) or "nothing"
    print(f"{who}: runs only what {path} approves: {names}", flush=True)
    if approvals.policy is not None:
        from medfl.policy import SitePolicy

        rules = "; ".join(SitePolicy.from_dict(approvals.policy, f"approvals file {path}: policy").describe())
        print(f"{who}: privacy policy: {rules}", flush=True)


def _tls_args(args: argparse.Namespace, server: bool) -> tuple[bool, list[str]]:
    """``(insecure, extra Flower arguments)`` from ``--insecure`` or the TLS options."""
    if args.insecure:
        return True, []
    if server:
        files = [args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certfile]
        if not all(files):
            raise SystemExit("medfl flower: pass --insecure (no TLS, e.g. on one machine) or all of "
                             "--ssl-certfile, --ssl-keyfile and --ssl-ca-certfile")
        return False, ["--ssl-certfile", files[0], "--ssl-keyfile", files[1], "--ssl-ca-certfile", files[2]]
    if not args.root_certificates:
        raise SystemExit("medfl flower: pass --insecure (no TLS, e.g. on one machine) or --root-certificates CA.pem")
    return False, ["--root-certificates", args.root_certificates]


def _exec(cmd: list[str]) -> int:
    """Replace this process by ``cmd`` (so signals reach the Flower process directly)."""
    import os

    from medfl.flower.deploy import flower_env

    sys.stdout.flush()
    os.execve(cmd[0], cmd, flower_env())
    return 0  # pragma: no cover - execv does not return


def cmd_flower_superlink(args: argparse.Namespace) -> int:
    """Start the SuperLink (step 1) and the SuperExec that starts each run's ServerApp,
    which is started again whenever it exits (:func:`medfl.flower.flwr_launcher.supervise`)."""
    from medfl.flower.deploy import superlink_command

    insecure, extra = _tls_args(args, server=True)
    if args.enable_supernode_auth:
        if insecure:
            raise SystemExit("medfl flower superlink: --enable-supernode-auth needs TLS (Flower signs each "
                             "site's requests over an encrypted connection only): drop --insecure and give "
                             "--ssl-certfile, --ssl-keyfile and --ssl-ca-certfile (`medfl flower certs` makes "
                             "a set for trying it out)")
        extra.append("--enable-supernode-auth")
    return _exec(superlink_command(args.host, args.port, insecure=insecure, database=args.database,
                                   extra=extra, root_certificates=None if insecure else args.ssl_ca_certfile))


@contextmanager
def _auth_errors(who: str) -> Iterator[None]:
    """Turn a key, certificate or registration error (:class:`medfl.flower.auth.AuthError`)
    into one line of ``who``'s, without a traceback."""
    from medfl.flower.auth import AuthError

    try:
        yield
    except AuthError as exc:
        raise SystemExit(f"{who}: {exc}") from None


def cmd_flower_certs(args: argparse.Namespace) -> int:
    """Write a certificate authority and a SuperLink certificate for ``--host``."""
    from medfl.flower.auth import make_certificates

    with _auth_errors("medfl flower certs"):
        paths = make_certificates(args.out, args.host, days=args.days)
    print(f"SuperLink: --ssl-certfile {paths['server']} --ssl-keyfile {paths['server_key']} "
          f"--ssl-ca-certfile {paths['ca']}")
    print(f"sites and `medfl flower run`: --root-certificates {paths['ca']}  (keep {paths['ca_key']} offline)")
    return 0


def cmd_flower_keys(args: argparse.Namespace) -> int:
    """Write one key pair per site name."""
    from medfl.flower.auth import make_site_key

    with _auth_errors("medfl flower keys"):
        for name in args.names:
            private, public = make_site_key(args.out, name)
            print(f"{name}: private {private} (stays at the site: --auth-key), public {public} "
                  "(to register at the SuperLink)")
    return 0


def cmd_flower_register_site(args: argparse.Namespace) -> int:
    """Register site public keys at a SuperLink started with ``--enable-supernode-auth``."""
    from medfl.flower.auth import pin_site, read_site_nodes, register_site

    insecure, _ = _tls_args(args, server=False)
    if args.client_id is not None and (len(args.public_keys) != 1 or not args.nodes_file):
        raise SystemExit("medfl flower register-site: --client-id takes one public key and --nodes-file FILE "
                         "(the sites.json that `medfl flower run --site-nodes` reads)")
    with _auth_errors("medfl flower register-site"):
        if args.nodes_file and Path(args.nodes_file).exists():
            read_site_nodes(args.nodes_file)          # a broken file stops before anything is registered
        for key in args.public_keys:
            node = register_site(key, args.superlink, root_certificates=args.root_certificates,
                                 insecure=insecure, name=args.name)
            print(f"{key}: registered as node {node}")
            if args.client_id is not None:
                pin_site(args.nodes_file, args.client_id, node)
                print(f"{args.nodes_file}: client {args.client_id} is served by node {node} only "
                      "(give it to `medfl flower run --site-nodes`)")
    return 0


def cmd_flower_site(args: argparse.Namespace) -> int:
    """Start one site's SuperNode (step 2)."""
    from medfl.flower.deploy import site_command

    # the same overrides as `medfl run` and `medfl flower run`: any '#' path of the bundle
    # config (fl#dataset#root=/data, bundle_root=/x); options may also follow them
    overrides = _parse_overrides(_options_after_overrides(args, "flower", "site")) or None
    _apply_threads(args)   # the worker that trains is this process
    from medfl.config import local_sites, set_threads

    set_threads(None, local_sites())   # "auto" here; a number in the site's fl.threads wins (its Site)
    insecure, extra = _tls_args(args, server=False)
    if not Path(args.config).is_file():
        raise FileNotFoundError(f"{args.config}: config file not found")
    if args.auth_key:
        from medfl.flower.auth import check_private_key

        if insecure:
            raise SystemExit("medfl flower site: --auth-key needs TLS: drop --insecure and give "
                             "--root-certificates CA.pem")
        with _auth_errors("medfl flower site"):
            extra += ["--auth-supernode-private-key", str(check_private_key(args.auth_key).resolve())]
    _site_approvals(args)
    from medfl.flower.deploy import flower_env
    from medfl.site import SiteSettings
    from medfl.flower.worker import run_site, shutil_rmtree, socket_for

    sock = socket_for()
    try:
        cmd = site_command(str(args.client_id), args.config, args.state_dir, args.superlink, port=args.port,
                           host=args.host, insecure=insecure, overrides=overrides, device=args.device,
                           worker=sock, extra=extra)
        settings = SiteSettings(client_id=str(args.client_id), config=Path(args.config).resolve(),
                                state_dir=Path(args.state_dir).resolve(), overrides=overrides or {},
                                workdir=Path.cwd().resolve(), device=args.device)
    except BaseException:
        shutil_rmtree(Path(sock).parent)   # run_site removes it from here on
        raise
    return run_site(settings, cmd, env=flower_env(),
                    restart=not getattr(args, "no_restart", False))


def cmd_flower_run(args: argparse.Namespace) -> int:
    """Launch a run on a SuperLink with ``flwr run`` and stream its log (step 3).

    It ends with the ServerApp's outcome (1 and one ``medfl flower run: the run failed:``
    line when it failed; 2 and one ``medfl: error:`` line, as ``medfl run``, when the
    coordinator refused the settings before any run started: the config, or a method's
    ``MethodConfigError``) and leaves nothing running: once the ServerApp wrote its result,
    a run that has not ended at the SuperLink within ``--exit-grace`` seconds is stopped
    (``flwr stop``), and so is the run on Ctrl-C or SIGTERM (exit code 130; the coordinator
    saves its finished rounds: continue with ``--resume``). A failed run's line is all it
    says of the failure: Flower's report of the ServerApp's exception (its traceback) is shown
    only with ``--debug``."""
    import tempfile
    import time
    import uuid

    from medfl.flower.deploy import (FlowerDeployError, HeldTraceback, flwr_run, flwr_stop, make_run_config,
                                     read_json, started_run_id, write_app)

    options = argparse.ArgumentParser(prog="medfl flower run", add_help=False)
    _flower_run_options(options)
    args, rest = options.parse_known_args(args.overrides or [], namespace=args)
    args.overrides = rest
    insecure, _ = _tls_args(args, server=False)
    overrides = None
    if not args.resume:
        if not args.config:
            raise SystemExit("medfl flower run: give a bundle config (or --resume RUN_DIR)")
        if not Path(args.config).is_file():
            raise FileNotFoundError(f"{args.config}: config file not found")
        overrides = _parse_overrides(args.overrides)
    threads = None
    if getattr(args, "threads", None) is not None:
        from medfl.config import check_threads

        threads = check_threads(args.threads, "--threads")
        if not args.resume:   # a new run's fl#threads; a resumed one's coordinator, as `medfl resume --threads`
            overrides = {**(overrides or {}), "fl#threads": threads}
    if getattr(args, "tracking", None):
        if args.resume:
            raise SystemExit("medfl flower run: --tracking adds trackers to a new run's fl#tracking; a resumed run "
                             "continues with the trackers it started with")
        overrides = {**(overrides or {}), "fl#tracking": _flower_tracking(args.config, overrides, args.tracking)}
    site_nodes = None
    if args.site_nodes:
        from medfl.flower.auth import read_site_nodes

        with _auth_errors("medfl flower run: --site-nodes"):
            site_nodes = read_site_nodes(args.site_nodes)
    # the app, Flower's home and (by default) the result file live here until the run has ended
    with tempfile.TemporaryDirectory(prefix="medfl-flower-") as tmp_name:
        tmp = Path(tmp_name)
        result_file = (Path(args.result_file).resolve() if args.result_file
                       else tmp / f"result-{uuid.uuid4().hex}.json")
        rc = make_run_config(workdir=Path.cwd(), result_file=result_file, round_timeout=args.round_timeout,
                             connect_timeout=args.connect_timeout, hello_timeout=args.hello_timeout,
                             config=args.config, overrides=overrides, resume=args.resume, rounds=args.rounds,
                             progress_interval=args.progress_interval, site_nodes=site_nodes,
                             max_reply_mb=args.max_reply_mb, launch=_launch_options(args, insecure),
                             threads=threads if args.resume else None)
        app_dir = write_app(tmp / "app")
        seen: dict[str, float] = {}

        def failed() -> bool:   # the ServerApp wrote a failed result, which the line below reports
            result = read_json(result_file)
            return result is not None and not result.get("ok") and not result.get("refused")

        # Flower's traceback of a ServerApp that failed is held back (shown after all if no line says why)
        output = None if args.debug else HeldTraceback(failed)

        def note(line: str) -> None:
            run_id = started_run_id(line)
            if run_id is not None:
                seen["run"] = run_id

        def ended() -> str | None:
            # the SuperLink runs on this machine and the ServerApp wrote its result: the run is over
            if read_json(result_file) is None:
                return None
            since = seen.setdefault("result", time.monotonic())
            if time.monotonic() - since < args.exit_grace:
                return None
            return (f"the ServerApp wrote its result {args.exit_grace:g} s ago but the run has not ended at the "
                    "SuperLink")

        try:
            with _sigterm_as_interrupt():
                code = flwr_run(app_dir, args.superlink, rc, insecure=insecure, flwr_home=tmp / "flwr_home",
                                root_certificates=None if insecure else args.root_certificates,
                                watch=ended, watch_interval=1.0, on_output=note, stream_to=output,
                                done=lambda: read_json(result_file) is not None)
        except (FlowerDeployError, KeyboardInterrupt) as exc:
            run_id = seen.get("run")
            stopped = run_id is not None and flwr_stop(int(run_id), tmp / "flwr_home")
            if isinstance(exc, KeyboardInterrupt):
                how = ("stopped at the SuperLink (its coordinator saves the finished rounds; continue with "
                       "--resume)" if stopped else "not stopped at the SuperLink (see `flwr ls`)")
                logger.warning(f"medfl flower run: interrupted; run {int(run_id) if run_id else '(not started)'} {how}")
                raise
            code = 1
            if read_json(result_file) is None:
                logger.error(f"medfl flower run: {exc}" + ("; the run was stopped" if stopped else ""))
                return 1
        result = read_json(result_file)
        if output is not None and not failed():
            output.release()
        if result is not None:  # the SuperLink runs on this machine: report the ServerApp's outcome
            if result.get("refused"):   # the config or a method refused it before any run started, as `medfl run`
                logger.error(f"medfl: error: {result['refused']}")
                return 2
            if not result.get("ok"):
                logger.error(f"medfl flower run: the run failed: {result.get('error')}")
                return 1
            print(f"medfl flower run: results in {result['dir']}")
            return 0
    return int(code or 0)


def _launch_options(args: argparse.Namespace, insecure: bool) -> str:
    """The options of this ``medfl flower run`` that reach its SuperLink (``--superlink`` and
    TLS, the CA made absolute), which the run's resume hints repeat."""
    import shlex

    tls = ["--insecure"] if insecure else ["--root-certificates", str(Path(args.root_certificates).resolve())]
    return shlex.join(["--superlink", args.superlink, *tls])


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``KeyboardInterrupt`` as Ctrl-C does (in the main
    thread only), so that whoever ends ``medfl flower run`` also stops its run."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _add_flower(sub: Any) -> None:
    fp = sub.add_parser("flower", help="run methods across sites with Flower (SuperLink, sites, runs)",
                        description="The three steps of a Flower deployment; see docs/flower.md.")
    fsub = fp.add_subparsers(dest="flower_command", required=True)

    sp = fsub.add_parser("superlink", help="step 1: start the SuperLink (Fleet, Control and Runtime APIs on one port)",
                         description="Start Flower's SuperLink and, beside it, the SuperExec that starts each run's "
                                     "ServerApp; the SuperExec is started again whenever it exits (an HTTP 500 of a "
                                     "locked --database ends Flower's), the runs it started go on. Ctrl-C or SIGTERM "
                                     "ends both and the runs' ServerApps.")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 to accept other machines)")
    sp.add_argument("--port", type=int, default=9092, help="port of the SuperLink's APIs (default 9092)")
    sp.add_argument("--database", default=None, help="SQLite file for the SuperLink's state (default: in memory)")
    sp.add_argument("--insecure", action="store_true", help="no TLS (one machine, or a trusted network)")
    sp.add_argument("--ssl-certfile")
    sp.add_argument("--ssl-keyfile")
    sp.add_argument("--ssl-ca-certfile")
    sp.add_argument("--enable-supernode-auth", action="store_true",
                    help="accept only SuperNodes whose public key was registered (`medfl flower register-site`); "
                         "needs TLS")
    sp.set_defaults(func=cmd_flower_superlink)

    sp = fsub.add_parser("certs", help="write a CA and a SuperLink certificate (trying TLS out; use your PKI "
                                       "in production)")
    sp.add_argument("--out", required=True, help="folder for ca.pem, ca.key, server.pem, server.key (new files only)")
    sp.add_argument("--host", action="append", required=True,
                    help="name or IP address the sites use for the SuperLink (repeat for several)")
    sp.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    sp.set_defaults(func=cmd_flower_certs)

    sp = fsub.add_parser("keys", help="write a SuperNode key pair per site name (<name>.key stays at the site, "
                                      "<name>.pub is registered at the SuperLink)")
    sp.add_argument("names", nargs="+", help="one name per key pair, e.g. site0 site1")
    sp.add_argument("--out", required=True, help="folder for the key files (new files only)")
    sp.set_defaults(func=cmd_flower_keys)

    sp = fsub.add_parser("register-site", help="register site public keys at a SuperLink started with "
                                               "--enable-supernode-auth; prints each node id")
    sp.add_argument("public_keys", nargs="+", help="<name>.pub files from `medfl flower keys`")
    sp.add_argument("--superlink", default="127.0.0.1:9092", help="the SuperLink's address HOST:PORT")
    sp.add_argument("--insecure", action="store_true", help="no TLS (refused by a SuperLink with authentication)")
    sp.add_argument("--root-certificates", default=None, help="CA certificate of the SuperLink (TLS)")
    sp.add_argument("--name", default=None, help="a name the SuperLink lists the node under")
    sp.add_argument("--client-id", default=None,
                    help="the client this site serves: recorded with its node id in --nodes-file, so that no "
                         "other node may serve it (`medfl flower run --site-nodes`)")
    sp.add_argument("--nodes-file", default=None, help="the sites.json to record --client-id in (created if absent)")
    sp.set_defaults(func=cmd_flower_register_site)

    sp = fsub.add_parser("site", help="step 2: start one site's SuperNode (serves one client id with its data)")
    sp.add_argument("--client-id", required=True, help="the client of the partition this site serves (0, 1, ...)")
    sp.add_argument("--config", required=True, help="bundle config: where this site's data is and how the "
                                                    "partition is drawn (same split settings as the run)")
    sp.add_argument("--state-dir", required=True, help="where this site keeps its persistent client state")
    sp.add_argument("--superlink", default="127.0.0.1:9092", help="the SuperLink's address HOST:PORT")
    sp.add_argument("--host", default="127.0.0.1", help="address of this SuperNode's ClientApp runtime API")
    sp.add_argument("--port", type=int, default=9094, help="port of that API; one per site on a machine")
    sp.add_argument("--device", default=None, help="torch device of this site (default: the config's)")
    sp.add_argument("--insecure", action="store_true", help="no TLS")
    sp.add_argument("--root-certificates", default=None, help="CA certificate of the SuperLink (TLS)")
    sp.add_argument("--auth-key", default=None,
                    help="this site's private key (`medfl flower keys`), for a SuperLink started with "
                         "--enable-supernode-auth; its public key must be registered there")
    sp.add_argument("--approvals", default=None,
                    help="approvals file (`medfl approve`): run only the methods it approves, with the same "
                         "version and code hash; without it, or with 'none', the site runs any installed method "
                         "(and warns)")
    sp.add_argument("--no-restart", action="store_true",
                    help="end the site when its SuperNode exits (default: start it again with a growing wait, "
                         "1 s to 60 s, so a SuperLink restart or an outage never ends the site)")
    sp.add_argument("overrides", nargs=argparse.REMAINDER,
                    help="config overrides after the options, as for `medfl run`: any '#' path of the bundle "
                         "config (fl#dataset#root=/data bundle_root=/x; key=value first, then also --key value)")
    _add_threads_option(sp)
    sp.set_defaults(func=cmd_flower_site)

    sp = fsub.add_parser("run", help="step 3: run a bundle config's experiment over the federation (flwr run)")
    sp.add_argument("config", nargs="?", help="bundle config file, read on the SuperLink's machine")
    sp.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value or key=value overrides")
    _flower_run_options(sp)
    sp.set_defaults(func=cmd_flower_run)


def _flower_run_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--superlink", default="127.0.0.1:9092", help="the SuperLink's address HOST:PORT")
    sp.add_argument("--resume", default=None, help="continue a stopped Flower run directory instead")
    sp.add_argument("--rounds", type=int, default=None, help="with --resume: a new total number of rounds")
    sp.add_argument("--round-timeout", type=float, default=600.0,
                    help="seconds a site has to answer one exchange before it is left out (default 600)")
    sp.add_argument("--connect-timeout", type=float, default=300.0,
                    help="seconds to wait for every site at the start (default 300)")
    sp.add_argument("--hello-timeout", type=float, default=60.0,
                    help="seconds to wait for a site that (re)joins mid-run (default 60)")
    sp.add_argument("--progress-interval", type=float, default=15.0,
                    help="while waiting for the sites at the start, say every so many seconds which clients "
                         "have no site yet (default 15)")
    sp.add_argument("--max-reply-mb", type=float, default=None,
                    help="the largest answer (MiB) taken from a site; a larger one is refused like a bad reply "
                         "(default: four times what the method sends, plus 64 MiB)")
    sp.add_argument("--result-file", default=None, help="where the ServerApp writes its result (JSON)")
    sp.add_argument("--exit-grace", type=float, default=120.0,
                    help="once the ServerApp wrote its result (SuperLink on this machine), seconds to wait for the "
                         "run to end at the SuperLink before it is stopped there (default 120)")
    sp.add_argument("--site-nodes", default=None,
                    help="sites.json from `medfl flower register-site --client-id`: each client is served only "
                         "by the node registered for it (with SuperNode authentication, by the site's key)")
    sp.add_argument("--insecure", action="store_true", help="no TLS")
    sp.add_argument("--root-certificates", default=None, help="CA certificate of the SuperLink (TLS)")
    sp.add_argument("--debug", action="store_true",
                    help="when the run fails, show the ServerApp's traceback too (Flower's report of it, in the "
                         "run's output); without it the failure is one line")
    _add_threads_option(sp)
    _tracking_option(sp)   # only the coordinator tracks (docs/flower.md)


def cmd_export(args: argparse.Namespace) -> int:
    """Export a finished run's models as MONAI bundles and print what was written."""
    from medfl.export import export_run
    from medfl.plugins import registry

    registry()
    summary = export_run(args.run_dir, args.out, args.license)
    for b in summary["bundles"]:
        ts = b["torchscript"] or "no TorchScript (see its metadata.json)"
        print(f"{Path(args.out) / b['folder']}: {b['model']} ({b['network']}; model.ts: {ts})")
    for s in summary["not_exported"]:
        print(f"not exported: {s['model']}: {s['reason']}")
    return 0


def _add_export(sub: Any) -> None:
    sp = sub.add_parser(
        "export", help="write a finished run's models as MONAI bundles (model.pt, model.ts, inference.json)",
        description="Write the final global model of a finished method run, and each client's personalised model "
                    "where the method has one, as MONAI bundles under OUT: OUT/global, OUT/final_<name>, "
                    "OUT/client_<id>, each with models/model.pt (a state dict in MONAI's key names), models/model.ts "
                    "(TorchScript), configs/inference.json (MONAI transforms and a MONAI or TorchScript network: "
                    "runs without medfl), configs/metadata.json, configs/logging.conf, LICENSE and docs/README.md; "
                    "OUT/export.json lists them and every model left out, with the reason. Infer with: python -m "
                    "monai.bundle run --config_file OUT/global/configs/inference.json --bundle_root OUT/global "
                    "[--dataset_dir DIR] [--split test]")
    sp.add_argument("run_dir", help="a finished method run directory (e.g. runs/demo/fedavg)")
    sp.add_argument("--out", required=True, help="folder to write; must not exist or be empty (nothing is overwritten)")
    sp.add_argument("--license", metavar="FILE", default=None,
                    help="licence text written as each bundle's LICENSE (default: medfl's, Apache-2.0); the "
                         "training data's terms may restrict the model further")
    sp.set_defaults(func=cmd_export)


def cmd_bundles(args: argparse.Namespace) -> int:
    """``medfl bundles``: list the shipped bundles; ``medfl bundles init NAME DIR``: copy one."""
    import shlex

    from medfl.shipped import BundleError, bundles_dir, format_bundles, init_bundle, list_bundles

    try:
        if args.bundles_command != "init":
            print(format_bundles(list_bundles(), bundles_dir()))
            return 0
        out = init_bundle(args.name, args.dir)
    except BundleError as exc:
        logger.error(f"medfl: error: {exc}")
        return 2
    where = shlex.quote(str(out))
    print(f"copied bundle {args.name!r} to {out} ({sum(1 for f in out.rglob('*') if f.is_file())} files)\n"
          f"run it:       medfl run {shlex.quote(str(out / 'configs' / 'train.json'))} --bundle_root {where}\n"
          f"what it does: {out / 'docs' / 'README.md'} (its commands are written from medfl's repository root: "
          f"read bundles/{args.name} as {where}, and python data_prep/<dataset>.py as "
          "python -m medfl.prep.<dataset>)")
    return 0


def _add_bundles(sub: Any) -> None:
    sp = sub.add_parser("bundles", help="list the bundles medfl ships; bundles init NAME DIR copies one to edit",
                        description="Without a subcommand: every bundle medfl ships (its name and what it runs) "
                                    "and the folder they are installed in. `medfl bundles init NAME DIR` copies "
                                    "one into DIR (new or empty) to edit and run: medfl run DIR/configs/train.json "
                                    "--bundle_root DIR.")
    sp.set_defaults(func=cmd_bundles, bundles_command=None)
    bsub = sp.add_subparsers(dest="bundles_command")
    ip = bsub.add_parser("init", help="copy a shipped bundle into a new or empty folder to edit",
                         description="Copy bundle NAME (configs, docs, LICENSE, models/README.md) into DIR, which "
                                     "must not exist or be empty: nothing is overwritten.")
    ip.add_argument("name", metavar="NAME", help="a bundle `medfl bundles` lists, e.g. demo")
    ip.add_argument("dir", metavar="DIR", help="the folder to copy it into (new or empty)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``medfl``."""
    from medfl import __version__

    p = argparse.ArgumentParser(prog="medfl", description="Federated learning for medical imaging (MONAI + PyTorch).")
    p.add_argument("--version", action="version", version=f"medfl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("plugins", help="list registered methods, models, partitioners, datasets, metrics, filters, "
                                        "backends; or describe one (medfl plugins fedprox)",
                        description="Without NAME: every registered name, its qualified name (dist:name) and "
                                    "version; a bare name two plugins register is listed once per plugin, "
                                    "qualified, and marked as a clash (configs must then write the qualified "
                                    "name). With NAME (bare or dist:name): its kind, distribution and version, "
                                    "its parameters with their types and defaults, its presets and docstring.")
    sp.add_argument("name", nargs="?", default=None, help="a registered name to describe, e.g. fedprox or medfl:fedprox")
    sp.add_argument("--json", action="store_true",
                    help="as JSON: every plugin (name, distribution, version, hooks, registered, qualified, clashes, "
                         "refused), or with NAME its description")
    sp.set_defaults(func=cmd_plugins)
    sp = sub.add_parser("run", help="run a bundle config (e.g. bundles/demo/configs/train.json)",
                        description="Run the experiment in a bundle config's 'fl' section. Overrides use "
                                    "MONAI's '#' paths: --fl#rounds 3  --fl#methods#0#name fedprox  fl#seed=1")
    sp.add_argument("config", help="bundle config file (JSON or YAML)")
    sp.add_argument("--backend", default=None,
                    help="where the clients run: one after another in this process (inprocess, the default), in "
                         "parallel on Flower's simulation runtime (ray; the config's fl#backend sets its resources, "
                         "e.g. {\"name\": \"ray\", \"client_cpus\": 1, \"client_gpus\": 0.5}) or a backend a "
                         "plugin registered (`medfl plugins` lists them); same as --fl#backend ray")
    _add_threads_option(sp)
    _tracking_option(sp)
    sp.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value or key=value overrides")
    sp.set_defaults(func=cmd_run)
    sp = sub.add_parser("resume", help="continue a stopped run or experiment directory")
    sp.add_argument("run_dir")
    sp.add_argument("--rounds", type=int, default=None, help="new total number of rounds (default: as configured)")
    _add_threads_option(sp)
    _tracking_option(sp)
    sp.set_defaults(func=cmd_resume)
    sp = sub.add_parser("report", help="print the summary table of a run (or of every run of an experiment) "
                                       "and draw its plots again (runs with \"plots\": false or "
                                       "MEDFL_NO_PLOTS drew none)")
    sp.add_argument("run_dir", help="a run directory, or an experiment's (its comparison, seeds and CV "
                                    "figures are drawn too)")
    sp.set_defaults(func=cmd_report)
    _add_runs(sub)
    _add_approve(sub)
    _add_policy(sub)
    _add_budget(sub)
    _add_flower(sub)
    _add_export(sub)
    from medfl.predict import add_parser as _add_predict

    _add_predict(sub)
    from medfl.nvflare.job import add_parser as _add_nvflare

    _add_nvflare(sub)
    _add_bundles(sub)
    _add_verbosity(p)
    return p


def _add_verbosity(parser: argparse.ArgumentParser, top: bool = True) -> None:
    """``-v/--verbose`` and ``-q/--quiet`` on ``parser`` and every subcommand under it (so
    ``medfl -q run ...`` and ``medfl run -q ...`` both work): how much of medfl's log the
    console shows (:func:`medfl.logs.console_level`)."""
    default = 0 if top else argparse.SUPPRESS   # a subcommand's flag adds to none given before it
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", action="count", default=default,
                       help="show details on stderr too (per-epoch progress: DEBUG); the run's log.txt always has them")
    group.add_argument("-q", "--quiet", action="count", default=default,
                       help="show only warnings and errors on stderr (-qq: errors only); the run's log.txt keeps "
                            "everything")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                _add_verbosity(child, top=False)


def _configure_logging(args: argparse.Namespace) -> None:
    """Show medfl's log on stderr at the level ``-v``/``-q`` chose (INFO by default), unless
    the program that called :func:`main` configured logging itself (:mod:`medfl.logs`)."""
    from medfl.logs import configure_console, console_level

    configure_console(console_level(int(getattr(args, "verbose", 0) or 0), int(getattr(args, "quiet", 0) or 0)))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``medfl`` command. Exit codes: 0, 2 for a mistake in the input
    (one ``medfl: error:`` line; a full disk too), 130 for Ctrl-C (after the run's line saying how to resume)."""
    from medfl.bundle import INTERRUPTED_EXIT, user_error_message, user_errors

    args = build_parser().parse_args(argv)
    _configure_logging(args)
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "flwr":
            raise
        logger.error("medfl: error: this needs Flower, which is not installed here: pip install 'medfl[flower]' "
                     "(Flower's simulation runtime, fl.backend 'ray': 'medfl[simulation]')")
        return 2
    except (*user_errors(), KeyError, OSError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else user_error_message(exc)
        if msg is None:   # not a mistake in the input nor a full disk: a bug, with its traceback
            raise
        logger.error(f"medfl: error: {msg}")
        return 2
    except KeyboardInterrupt:   # the run said what was saved and how to resume
        return INTERRUPTED_EXIT


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
