"""The ``lct`` command: a thin layer over the library (one module per subcommand)."""

from __future__ import annotations

import click

from lct import __version__

from ._util import LCTGroup
from .convert import convert_cmd
from .demo import demo_cmd
from .export import export_cmd
from .info import info_cmd
from .load import load_cmd
from .plan import plan_cmd
from .pull import pull_cmd
from .push import push_cmd
from .verify import verify_cmd


@click.group(cls=LCTGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="lct")
def cli():
    """LCT: convert Hugging Face checkpoints to the Layer-wise Compressed Tensor format, inspect,
    verify, export and load them.

    Start with `lct demo` (no network needed), then `lct convert ORG/NAME -o OUT` and
    `lct load OUT --prompt "Hello"`.
    Set LCT_DEBUG=1 for full tracebacks.
    """


for command in (convert_cmd, info_cmd, verify_cmd, export_cmd, load_cmd, push_cmd, pull_cmd,
                plan_cmd, demo_cmd):
    cli.add_command(command)


def main():
    """Console-script entry point."""
    cli(prog_name="lct")


if __name__ == "__main__":
    main()
