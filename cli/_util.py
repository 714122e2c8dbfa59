"""Shared CLI plumbing: one-line errors, progress bars, size formatting."""

from __future__ import annotations

import os
import sys
import traceback

import click

from lct.errors import INTERRUPTED, INTERRUPTED_STATUS, LCTError

# ``ctx.meta`` key of the arguments the ``lct`` group was given (after the program's name), for
# a command that runs itself again in other processes (``lct load --tp N``).
ARGV = "lct.argv"


class LCTGroup(click.Group):
    """A click group that turns library errors into one-line messages and a non-zero exit.

    Set ``LCT_DEBUG=1`` to see the full traceback. ``lazy_commands`` maps command names to
    ``"module:attribute"`` in ``lct.cli``, imported on first use.
    """

    def __init__(self, *args, lazy_commands: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy_commands = dict(lazy_commands or {})

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.lazy_commands))

    def get_command(self, ctx, name):
        if name not in self.commands and name in self.lazy_commands:
            import importlib
            module, attr = self.lazy_commands[name].split(":")
            self.add_command(getattr(importlib.import_module(f"lct.cli.{module}"), attr), name)
        return super().get_command(ctx, name)

    def parse_args(self, ctx, args):
        ctx.meta[ARGV] = list(args)
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx, args):
        """click's, with a "did you mean" for a mistyped command (click suggests close option
        names, not command names)."""
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as e:
            import difflib
            name = click.utils.make_str(args[0]) if args else ""
            close = difflib.get_close_matches(name, self.list_commands(ctx), n=3)
            if close and self.get_command(ctx, name) is None:
                e.message += " Did you mean " + " or ".join(repr(c) for c in close) + "?"
            raise

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except LCTError as e:
            if os.environ.get("LCT_DEBUG"):
                traceback.print_exc()
            command = self.get_command(ctx, ctx.invoked_subcommand or "")
            click.echo(error_line(e, command), err=True)
            sys.exit(1)
        except click.UsageError as e:
            # One line like every other error (click's own is three), exit status 2 as click's.
            where = e.ctx.command_path if e.ctx is not None else "lct"
            click.echo(f"error: {e.format_message()} (see {where} --help)", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            if os.environ.get("LCT_DEBUG"):
                traceback.print_exc()
            cache = sys.modules.get("lct.io.cache")
            if cache is not None:   # a copy being kept in the background: Ctrl-C stops it too
                cache.cancel_fills()
            click.echo(INTERRUPTED, err=True)
            sys.exit(INTERRUPTED_STATUS)


def parse_parts(ctx, param, value):
    """An encoding option's ``PARTS``: None (not given), ``none`` (no part: ``()``), or parts of
    ``embed``, ``head`` separated by commas."""
    from lct.format import constants as C
    if value is None:
        return None
    if value.strip().lower() in ("none", ""):
        return ()
    parts = tuple(p.strip() for p in value.split(",") if p.strip())
    bad = [p for p in parts if p not in C.LOSSY_ROLES]
    if bad:
        raise click.BadParameter(f"{bad[0]!r}: use none, embed, head or embed,head")
    return parts


class EncodingCommand(click.Command):
    """A command with an option ``--ENCODING PARTS`` for each lossy encoding registered
    (``lct.format.encodings``) when it is asked for its options, in registry order, right after
    its own option ``after``; ``encoding_help(encoding)`` says what each does. The callback gets
    their values as one keyword, ``lossy``: ``{encoding: parts}`` of the options given.

    Example:
        >>> @click.command("plan", cls=EncodingCommand, after="fmt",
        ...                encoding_help=lambda e: f"the parts in {e.label}")
    """

    def __init__(self, *args, after: str, encoding_help, **kwargs):
        self._after, self._encoding_help = after, encoding_help
        self._options: dict = {}        # {encoding: its click.Option}, made once each
        super().__init__(*args, **kwargs)

    @property
    def params(self) -> list:
        """The command's own parameters with an option of each lossy encoding registered now
        after ``after`` (one list, brought up to date in place: click adds to it)."""
        from lct.format.encodings import get_encoding, lossy_encodings
        made = [id(o) for o in self._options.values()]
        own = [p for p in self._params if id(p) not in made]
        for e in lossy_encodings():
            if any(p.name == e for p in own):
                raise click.ClickException(f"encoding {e!r} has the name of an option of "
                                           f"lct {self.name}")
            if e not in self._options:
                self._options[e] = click.Option(
                    [f"--{e}", e], default=None, callback=parse_parts, metavar="PARTS",
                    help=self._encoding_help(get_encoding(e)))
        at = next(i for i, p in enumerate(own) if p.name == self._after) + 1
        self._params[:] = own[:at] + [self._options[e] for e in lossy_encodings()] + own[at:]
        return self._params

    @params.setter
    def params(self, value: list) -> None:
        self._params = list(value)

    def invoke(self, ctx):
        from lct.format.encodings import lossy_encodings
        given = {e: ctx.params.pop(e, None) for e in lossy_encodings()}
        ctx.params["lossy"] = {e: parts for e, parts in given.items() if parts is not None}
        return super().invoke(ctx)


# Said in a help text (a command's or an option's of the classes below), the lossy encodings
# registered when the help is shown, in registry order: "nf4, int8, ...".
LOSSY = "{lossy}"


class _LossyHelp:
    """A help text that may say ``LOSSY``, read from the encoding registry each time it is
    shown (an encoding registered after import is listed)."""

    @property
    def help(self):
        text = self._help_text
        if text is None or LOSSY not in text:
            return text
        from lct.format.encodings import lossy_encodings
        return text.replace(LOSSY, ", ".join(lossy_encodings()))

    @help.setter
    def help(self, value) -> None:
        self._help_text = value


class LossyHelpCommand(_LossyHelp, click.Command):
    """A command whose help (its docstring) lists the lossy encodings where it says
    ``{lossy}``.

    Example:
        >>> @click.command("export", cls=LossyHelpCommand)
        ... def export_cmd(...):
        ...     \"\"\"A lossy table ({lossy}) comes out dequantized.\"\"\"
    """


class LossyHelpOption(_LossyHelp, click.Option):
    """An option whose help lists the lossy encodings where it says ``{lossy}``
    (``click.option(..., cls=LossyHelpOption)``)."""


# What to do about a library error that names a parameter (``LCTError.option``), in the CLI's
# words; any other parameter is shown as its flag.
OPTION_HINTS = {
    "overwrite": "pass --force to replace it",
    "ids": "pass token ids with --ids 1,5,9",
    "maximus_shards": "lct convert --maximus-shards N",
    "stream": "drop --stream",
    "tp": "lct load ARTIFACT --tp N starts N ranks here; or torchrun --nproc_per_node N -m lct "
          "load ARTIFACT --tp",
    "convert": "lct convert FOLDER -o OUT.lct",
}


def error_line(e: BaseException, command: click.Command | None = None) -> str:
    """The one line the CLI prints for a library error: its message, and the CLI's hint when
    the error names a parameter (as ``command``, the one that ran, spells its flag)."""
    option = getattr(e, "option", None)
    return f"error: {e}" + (f" ({hint_for(option, command)})" if option else "")


def hint_for(option: str, command: click.Command | None = None) -> str:
    """The CLI's hint for a library error about parameter ``option``: ``OPTION_HINTS``', else
    the flag ``command`` (or a subcommand of it) declares for it, else ``--option-name``."""
    if option in OPTION_HINTS:
        return OPTION_HINTS[option]
    commands = [command] if command is not None else []
    while commands:
        cmd = commands.pop()
        for param in cmd.params:
            longs = [o for o in param.opts if o.startswith("--")]
            if param.name == option and longs:
                return longs[0]
        commands.extend(getattr(cmd, "commands", {}).values())
    return "--" + option.replace("_", "-")


def as_flags(text: str) -> str:
    """A planner label that leads with ``name=value`` (``kv_dtype=fp8 ...``), as the flag that
    sets it (``--kv-dtype fp8 ...``)."""
    import re
    return re.sub(r"^(\w+)=(\S+)", lambda m: f"--{m[1].replace('_', '-')} {m[2]}", text)


def bars_disabled() -> bool:
    """Whether progress bars are switched off for the whole environment, as huggingface_hub and
    tqdm read it: ``HF_HUB_DISABLE_PROGRESS_BARS`` or ``TQDM_DISABLE`` set to a true value."""
    import os
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"))


def quiet_option(result: str):
    """The ``-q/--quiet`` option every command shares: print only ``result`` on stdout, as
    ``hf download --quiet`` prints only the path. Errors still go to stderr."""
    return click.option("-q", "--quiet", is_flag=True, callback=_quiet,
                        help=f"Print only {result}: no progress bars, tables, notes or library "
                             f"logs (errors still go to stderr).")


def _quiet(ctx, param, value):
    """``--quiet``'s callback: silence the libraries for the command as soon as it is given."""
    if value:
        go_quiet()
    return value


def go_quiet() -> None:
    """Silence what other libraries draw or log for the rest of this command (huggingface_hub's
    and tqdm's bars, transformers' logs, Python warnings such as torch's), restored when the
    command ends."""
    import logging
    import warnings

    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )
    saved = {k: os.environ.get(k) for k in _QUIET_ENV}
    os.environ.update(_QUIET_ENV)
    bars_were_off = are_progress_bars_disabled()
    disable_progress_bars()
    tf_logger = logging.getLogger("transformers")
    tf_level = tf_logger.level
    tf_logger.setLevel(logging.ERROR)
    lct_logger = logging.getLogger("lct")
    lct_level = lct_logger.level
    lct_logger.setLevel(logging.ERROR)
    caught = warnings.catch_warnings()      # torch's and transformers' UserWarnings too
    caught.__enter__()
    warnings.simplefilter("ignore")

    def restore():
        caught.__exit__(None, None, None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if not bars_were_off:
            enable_progress_bars()
        if tf_level != logging.NOTSET:   # a transformers imported meanwhile keeps its own
            tf_logger.setLevel(tf_level)
        lct_logger.setLevel(lct_level)
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.call_on_close(restore)


# TQDM_DISABLE reaches every tqdm bar (transformers' and the tokenizer's included);
# TRANSFORMERS_VERBOSITY a transformers imported later.
_QUIET_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
              "TRANSFORMERS_VERBOSITY": "error"}


class GroupProgress:
    """A tqdm bar fed by the library's ``progress(group, done, total)`` callback (``count``:
    show how many groups were reported, not just the last one's name; a total that changes,
    as a measurement's that leaves passes out, is followed). Off with ``enabled=False``
    (``--quiet``) or when ``bars_disabled()``."""

    def __init__(self, desc: str, unit: str = "B", enabled: bool = True, count: bool = True):
        enabled = enabled and not bars_disabled()
        self.desc, self.unit, self.enabled, self.count = desc, unit, enabled, count
        self.bar = None
        self.groups = 0

    def __call__(self, group: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm
            scale = self.unit == "B"
            self.bar = tqdm(total=total, desc=self.desc, unit=self.unit, unit_scale=scale,
                            unit_divisor=1000, file=sys.stderr, leave=True, dynamic_ncols=True)
        self.groups += 1
        if total != self.bar.total:
            self.bar.total = total
        self.bar.set_postfix_str(f"{self.groups} groups, {group}" if self.count else group,
                                 refresh=False)
        self.bar.update(done - self.bar.n)

    def stage(self, text: str) -> None:
        """A status line on stderr (``desc: text``) for a stage the bar does not measure, fed
        by the library's ``stage(text)`` callback; it ends a bar still drawn, so that the lines
        follow the order of the work."""
        if not self.enabled:
            return
        from tqdm import tqdm
        self.close()
        self.bar, self.groups = None, 0
        tqdm.write(f"{self.desc}: {text}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def table(rows: list, headers: list) -> str:
    """Format rows as an aligned plain-text table (first column left, others right)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                               for i, c in enumerate(r)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
