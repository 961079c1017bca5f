"""``medfl approve``, ``medfl policy`` and ``medfl budget``: what a site's operator approves
(:mod:`medfl.approval`), the least privacy the site accepts (:mod:`medfl.policy`) and what it
has released of its data (:mod:`medfl.budget`); and the approvals a site enforces when it
starts (``medfl flower site --approvals``)."""

from __future__ import annotations

import argparse
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

from medfl.approval import (APPROVALS_ENV, APPROVED_KINDS, OPT_OUT, ApprovalError, Approvals, approval_identities,
                            approvals_path, code_identity)
from medfl.budget import BUDGET_FILE, BudgetRefused, SiteBudget
from medfl.plugins import registry
from medfl.policy import PolicyError, SitePolicy

__all__ = ["add_parsers", "cmd_approve", "cmd_policy", "cmd_budget", "site_approvals"]

logger = logging.getLogger(__name__)


def _approvals_file(args: argparse.Namespace) -> Path:
    """The approvals file ``--file`` names, else ``$MEDFL_APPROVALS``, else ``approvals.json`` here."""
    return Path(args.file) if args.file else (approvals_path() or Path("approvals.json"))


def _code_summary(files: dict[str, str]) -> str:
    """``93 files (medfl/: 80, plugins/: 13)``: what an approval pins, in one line."""
    tops = Counter(f.split("/")[0] + ("/" if "/" in f else "") for f in files)
    return f"{len(files)} files ({', '.join(f'{t}: {n}' for t, n in sorted(tops.items()))})"


def cmd_approve(args: argparse.Namespace) -> int:
    """Record, revoke or list the plugins a site's operator approves (:mod:`medfl.approval`).
    Every name is checked before the file is written or anything is printed: all of them are
    recorded (or revoked), or none, with one ``medfl: error:`` line naming each name refused
    (a name that is another kind of plugin, e.g. a model, names the ``--kind`` that takes it)."""
    path = _approvals_file(args)
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


def cmd_policy(args: argparse.Namespace) -> int:
    """Write or show the privacy policy of a site's approvals file (:mod:`medfl.policy`)."""
    path = _approvals_file(args)
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


def cmd_budget(args: argparse.Namespace) -> int:
    """Print what a site released of its data, per run and in all (:mod:`medfl.budget`), at
    the delta of its policy (in its approvals file), with the policy's caps."""
    file = _approvals_file(args)
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


def site_approvals(args: argparse.Namespace) -> None:
    """Enforce ``--approvals FILE`` at this site (through :data:`medfl.approval.APPROVALS_ENV`,
    which the site worker in this process reads), or warn that no approvals are enforced."""
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
        rules = "; ".join(SitePolicy.from_dict(approvals.policy, f"approvals file {path}: policy").describe())
        print(f"{who}: privacy policy: {rules}", flush=True)


def add_parsers(sub: Any) -> None:
    """Add the ``medfl approve``, ``policy`` and ``budget`` commands to ``sub`` (the subparsers of ``medfl``)."""
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
    sp.add_argument("--file", default=None, help="approvals file (default: $MEDFL_APPROVALS, else approvals.json here)")
    sp.add_argument("--all", action="store_true",
                    help="every installed plugin (of --kind, or of every kind a site runs)")
    sp.add_argument("--update", action="store_true",
                    help="approve again, as installed now, every plugin the file lists")
    sp.add_argument("--revoke", action="store_true", help="remove the approvals of the names instead")
    sp.add_argument("--list", action="store_true", help="list the approvals and whether the installed code matches")
    sp.set_defaults(func=cmd_approve)
    sp = sub.add_parser("policy", help="write or show the least privacy this site accepts (in its approvals file)",
                        description="A site's privacy policy, kept in its approvals file: every message asking "
                                    "for less is refused at the site, naming the rule, before the method's code "
                                    "runs (see docs/privacy.md). Without options: show it. Options add to the "
                                    "policy in the file (--clear starts from none).")
    sp.add_argument("--file", default=None, help="approvals file (default: $MEDFL_APPROVALS, else approvals.json here)")
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
