"""The ``lct`` command: a thin layer over the library (one module per subcommand)."""

from __future__ import annotations

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
    if verbose:
        import logging
        log = logging.getLogger("lct")
        if not any(getattr(h, "lct_cli", False) for h in log.handlers):
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            handler.lct_cli = True
            log.addHandler(handler)
        log.setLevel(logging.INFO if verbose == 1 else logging.DEBUG)


def main():
    """The group as a program (``python -m lct.cli.main``). The ``lct`` console script and
    ``python -m lct`` are ``lct.__main__.main``, which also answers a Ctrl-C before and after
    the group runs and skips the interpreter's slow teardown."""
    cli(prog_name="lct")


if __name__ == "__main__":
    main()
