"""``python -m snaploader verify|inspect|demo`` (and the ``snaploader`` command), and
``--version``.

- ``verify MODULE:FACTORY``: does your pipeline resume exactly? (``_tools/verify.py``)
- ``inspect CKPT``: what a checkpoint holds about a loader (``_tools/inspect.py``)
- ``demo``: the process-kill demo, as ``python -m snaploader.demo``
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from . import __version__


def _description(module: ModuleType) -> str | None:
    """A module docstring's first paragraph as a command's description, without the
    reStructuredText double backquotes, which a terminal would show literally."""
    return module.__doc__.split("\n\n")[0].replace("``", "") if module.__doc__ else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="snaploader",
        description="Tools for snaploader, the DataLoader whose checkpoints resume exactly.",
    )
    parser.add_argument("--version", action="version", version=f"snaploader {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{verify,inspect,demo}")
    from ._tools import inspect as _inspect, verify as _verify

    _verify.add_arguments(commands.add_parser(
        "verify", help="check that a pipeline resumes exactly, in fresh processes",
        description=_description(_verify),
    ))
    _inspect.add_arguments(commands.add_parser(
        "inspect", help="show the loader state in a checkpoint file",
        description=_description(_inspect),
    ))
    commands.add_parser("demo", help="kill a training process and a worker, resume, compare (about a minute)")
    args = parser.parse_args(argv)
    if args.command == "verify":
        try:
            return _verify.run_parsed(args, sys.stdout, sys.stderr)
        except KeyboardInterrupt:
            print("\nsnaploader verify: interrupted; its runs were stopped", file=sys.stderr)
            return 130
    if args.command == "inspect":
        return _inspect.run_parsed(args, sys.stdout, sys.stderr)
    if args.command == "demo":
        from . import demo

        sys.argv = [f"{sys.argv[0]} demo"]
        demo.main()
        return 0
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
