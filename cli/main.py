"""The ``lct`` command: a thin layer over the library (one module per subcommand)."""

from __future__ import annotations

import logging
import sys

import click

from lct._version import __version__
from lct.cli._util import LCTGroup

# Each command's module is imported only when that command runs (or when help lists them): a
# `lct load` start-up then pays for click and lct.cli.load alone, which matters in a cold start,
# where every module is a disk read on the critical path.
COMMANDS = {
    "convert": "convert:convert_cmd",
    "info": "info:info_cmd",
    "verify": "verify:verify_cmd",
    "export": "export:export_cmd",
    "load": "load:load_cmd",
    "push": "push:push_cmd",
    "pull": "pull:pull_cmd",
    "plan": "plan:plan_cmd",
    "demo": "demo:demo_cmd",
    "cache": "cache:cache_cmd",
}


@click.group(cls=LCTGroup, lazy_commands=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="lct")
@click.option("-v", "--verbose", count=True,
              help="Log what LCT does on stderr (-v: steps, -vv: details).")
def cli(verbose):
    """LCT: convert Hugging Face checkpoints to the Layer-wise Compressed Tensor format, inspect,
    verify, export and load them.

    Start with `lct demo` (no network needed), then `lct convert ORG/NAME -o OUT` and
    `lct load OUT --prompt "Hello"`.
    Set LCT_DEBUG=1 for full tracebacks.
    """
    # LCT's warnings (a damaged decoded copy, a request being retried) always reach stderr:
    # the library's logger has a NullHandler, so without this a command was silent about them
    # (for this command only: a program that runs it in-process keeps its own logging after)
    log = logging.getLogger("lct")
    level = log.level
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.WARNING if not verbose else
                 logging.INFO if verbose == 1 else logging.DEBUG)

    def restore():
        log.removeHandler(handler)
        log.setLevel(level)
    click.get_current_context().call_on_close(restore)


class _StderrHandler(logging.StreamHandler):
    """A ``logging.StreamHandler`` that writes to whatever ``sys.stderr`` is now (a test runner
    swaps it per command; a handler kept from an earlier command would write to a closed
    stream)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def main():
    """The group as a program (``python -m lct.cli.main``). The ``lct`` console script and
    ``python -m lct`` are ``lct.__main__.main``, which also answers a Ctrl-C before and after
    the group runs and skips the interpreter's slow teardown."""
    cli(prog_name="lct")


if __name__ == "__main__":
    main()
