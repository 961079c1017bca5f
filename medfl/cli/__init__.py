"""The ``medfl`` command line: :func:`main` and the top of its parser; each command group is a
module here (``plugins``; ``run``, ``resume``, ``report``, ``runs``, ``export``, ``bundles``;
``approve``, ``policy``, ``budget``; ``flower``), ``predict`` and ``nvflare`` are
:mod:`medfl.predict`'s and :mod:`medfl.nvflare.job`'s."""

from __future__ import annotations

import argparse
import copy
import logging

from medfl import __version__
from medfl.bundle import INTERRUPTED_EXIT, user_error_message, user_errors
from medfl.cli import flower, plugins, run, site
from medfl.logs import configure_console, console_level
from medfl.nvflare.job import add_parser as add_nvflare_parser
from medfl.predict import add_parser as add_predict_parser

__all__ = ["main", "build_parser"]

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``medfl``."""
    p = argparse.ArgumentParser(prog="medfl", description="Federated learning for medical imaging (MONAI + PyTorch).")
    p.add_argument("--version", action="version", version=f"medfl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (plugins.add_parsers, run.add_parsers, run.add_runs_parser, site.add_parsers, flower.add_parsers,
                run.add_export_parser, add_predict_parser, add_nvflare_parser, run.add_bundles_parser):
        add(sub)
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


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command that ``parser`` parsed into ``args`` (``medfl flower
    site``'s for ``medfl flower site ...``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None):
            return _chosen(action.choices[getattr(args, action.dest)], args)
    return parser


def _options_after_overrides(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Parse into ``args`` the options of the command ``args`` holds that came after its config
    overrides, and leave the overrides in ``args.overrides``: a command whose ``overrides``
    positional takes everything after the first one (``medfl run``, ``medfl flower site ...
    fl#dataset#root=/data --port 9095``, ``medfl flower run``). Options win: an override key
    spelled like an option (``--device cuda``) is the option."""
    command = _chosen(parser, args)
    if not any(a.dest == "overrides" and a.nargs == argparse.REMAINDER for a in command._actions):
        return
    late = argparse.ArgumentParser(prog=command.prog, add_help=False, allow_abbrev=False)
    for action in command._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            again = copy.copy(action)
            again.required, again.default = False, argparse.SUPPRESS   # given earlier or not at all
            late._add_action(again)
    _, args.overrides = late.parse_known_args(list(args.overrides or []), namespace=args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``medfl`` command. Exit codes: 0, 2 for a mistake in the input
    (one ``medfl: error:`` line; a full disk too), 130 for Ctrl-C (after the run's line saying how to resume)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _options_after_overrides(parser, args)   # -v/-q may come after the config (medfl run train.json -q)
    # medfl's log on stderr at the level -v/-q chose, unless the caller configured logging itself
    configure_console(console_level(int(getattr(args, "verbose", 0) or 0), int(getattr(args, "quiet", 0) or 0)))
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
