"""``python -m lct`` and the ``lct`` console script: the command's process, around the click
group (``lct.cli.main.cli``, which tests call in-process).

A Ctrl-C must end the process with one line and exit status 130 whenever it comes. Inside the
group, ``LCTGroup.invoke`` turns the ``KeyboardInterrupt`` into that line once the library's
cleanup has run. Outside it nothing would: during the imports before the group (a traceback),
and after the result is printed, in the interpreter's teardown (torch's atexit callbacks and
the collection of its objects take a second or more: a traceback and exit status 0, or a
silent death). So this module, which imports nothing heavy, answers SIGINT itself before the
imports and after the command, and ends the process with ``os._exit`` as soon as the command
is done: every file the command wrote is closed (and fsynced) before it printed its result, and
a fill of the decoded cache that a load started in the background (``lct.io.cache``), which no
atexit handler would see through ``os._exit``, is waited for first.
"""

import os
import signal
import sys

from lct.errors import INTERRUPTED, INTERRUPTED_STATUS


def _interrupted(signum, frame):
    """SIGINT outside the command: nothing is being written; one line, exit status 130."""
    os.write(2, f"{INTERRUPTED}\n".encode())
    os._exit(INTERRUPTED_STATUS)


def main():
    """Run the ``lct`` command and end the process with its exit status."""
    signal.signal(signal.SIGINT, _interrupted)
    from lct.cli.main import cli
    try:
        code = _run(cli)
    except KeyboardInterrupt:   # the instant after the command, before _interrupted is back
        signal.signal(signal.SIGINT, _interrupted)
        sys.stderr.write(f"{INTERRUPTED}\n")
        code = INTERRUPTED_STATUS
    code = _wait_for_cache_fills(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):       # a closed pipe (lct info | head -1): nothing to do
            pass
    os._exit(code)


def _wait_for_cache_fills(code: int) -> int:
    """Let the decoded cache's background fills end (a Ctrl-C cancels them: status 130)."""
    cache = sys.modules.get("lct.io.cache")
    if cache is None:
        return code
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cache.say_running()
        cache.wait_fills()
        return code
    except KeyboardInterrupt:
        sys.stderr.write(f"{INTERRUPTED}\n")
        return INTERRUPTED_STATUS
    finally:
        signal.signal(signal.SIGINT, _interrupted)


def _run(cli) -> int:
    """The click group's exit status, run under Python's SIGINT handler: a Ctrl-C in the
    command raises ``KeyboardInterrupt``, and the library cleans up as it unwinds."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cli.main(prog_name="lct")           # click ends with SystemExit, also on success
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        sys.stderr.write(f"{e.code}\n")    # sys.exit("message"), as Python shows it
        return 1
    except Exception:                       # a bug: its traceback, as Python would show it
        sys.excepthook(*sys.exc_info())
        return 1
    finally:
        signal.signal(signal.SIGINT, _interrupted)


if __name__ == "__main__":
    main()
