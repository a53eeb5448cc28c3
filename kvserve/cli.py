"""The ``kvserve`` command line: a registry of subcommands built into argparse.

Each module in ``kvserve.commands`` (and ``benchmarks.commands``, every
``kvserve bench …``) registers its commands by space-separated path ("bench
engine", "store serve"), so groups such as ``store`` collect subcommands from
several modules without an if/elif chain anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import pkgutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import common.process_env  # noqa: F401  (before anything can load torch)
import kvserve.commands
from security.redact import install_log_redaction, redact

Configure = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int | None]


class UsageError(Exception):
    """Bad command-line input: printed without a traceback, exit status 2."""


@dataclass(slots=True)
class _Node:
    help: str = ""
    configure: Configure | None = None
    run: Run | None = None
    children: dict[str, _Node] = field(default_factory=dict)


class CommandRegistry:
    def __init__(self) -> None:
        self._root = _Node()

    def add(self, path: str, *, help: str, configure: Configure | None = None,
            run: Run) -> None:
        node = self._node(path.split())
        if node.run is not None:
            raise ValueError(f"command {path!r} registered twice")
        node.help, node.configure, node.run = help, configure, run

    def has(self, path: str) -> bool:
        """Whether a runnable command is registered at ``path`` ("router serve")."""
        node = self._root
        for part in path.split():
            if part not in node.children:
                return False
            node = node.children[part]
        return node.run is not None

    def group(self, path: str, *, help: str) -> None:
        self._node(path.split()).help = help

    def _node(self, parts: Sequence[str]) -> _Node:
        node = self._root
        for part in parts:
            node = node.children.setdefault(part, _Node())
        return node

    def build_parser(self) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(
            prog="kvserve",
            description="Disaggregated LLM serving with a tiered KV-cache warehouse.")
        parser.add_argument("-v", "--verbose", action="count", default=0,
                            help="more logging (-v info, -vv debug)")
        self._attach(parser, self._root, "command")
        return parser

    def _attach(self, parser: argparse.ArgumentParser, node: _Node, dest: str) -> None:
        if node.configure is not None:
            node.configure(parser)
        if node.run is not None:
            parser.set_defaults(_run=node.run)
        if node.children:
            sub = parser.add_subparsers(dest=dest, metavar="COMMAND",
                                        required=node.run is None)
            for name in sorted(node.children):
                child = node.children[name]
                p = sub.add_parser(name, help=child.help, description=child.help)
                self._attach(p, child, f"{dest}_{name}")


# Modules outside kvserve.commands that register commands. The benchmarks stand
# on the floor above this package (they start stacks through its launcher), so
# they are found by name here, never imported by a statement.
EXTRA_COMMAND_MODULES = ("benchmarks.commands",)


def build_registry() -> CommandRegistry:
    reg = CommandRegistry()
    names = [f"kvserve.commands.{info.name}"
             for info in pkgutil.iter_modules(kvserve.commands.__path__)]
    for name in [*names, *EXTRA_COMMAND_MODULES]:
        register = getattr(importlib.import_module(name), "register", None)
        if register is not None:
            register(reg)
    return reg


def build_parser() -> argparse.ArgumentParser:
    return build_registry().build_parser()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        return _closed_stdout()


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Whatever any command writes (traces of users' prompts, benchmark logs and tool
    # JSON, charts, state) is the user's alone, whichever module opens the file.
    os.umask(0o077)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()        # no secret reaches a log line (security.redact)
    run: Run | None = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return int(run(args) or 0)
    except UsageError as exc:
        print(f"kvserve: error: {redact(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _closed_stdout() -> int:
    """The reader went away (``kvserve ... | head``): exit quietly as a Unix
    tool does. Point stdout at /dev/null so the interpreter's final flush of
    the dead pipe raises nothing either."""
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141                      # 128 + SIGPIPE, what a shell reports for `| head`


if __name__ == "__main__":
    # Run through the importable module: under ``python -m kvserve.cli`` this file is
    # ``__main__``, and commands raise ``kvserve.cli.UsageError``, a different class
    # from ``__main__.UsageError``, which ``main`` here would not catch.
    from kvserve.cli import main as _main

    sys.exit(_main())
