"""Process measurements for breakdowns and benchmarks: age since start, peak RSS and the memory
available (Linux); the one check of a thread count a caller asks for; and cleanup that a
second Ctrl-C does not cut short."""

from __future__ import annotations

import contextlib
import os
import resource
import threading


def process_age() -> float | None:
    """Seconds since this process started (from /proc), or None where /proc is unavailable."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _status_kb(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status in bytes, or None where it is unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux ``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss() -> int:
    """Peak resident set size of this process in bytes."""
    peak = _status_kb("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def lower_thread_priority(increment: int) -> None:
    """Raise the calling thread's nice value by ``increment`` (Linux: per thread), so that it
    runs on what the other threads of the machine leave; silently nothing where unsupported."""
    if increment <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)
    except (AttributeError, OSError):
        pass


def check_workers(workers) -> int | None:
    """``workers`` if it is a thread count LCT can run (an integer >= 1, or None: all cores),
    else an ``OptionError``: the one check of it, for convert and load alike."""
    from lct.errors import OptionError
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or
                                workers < 1):
        raise OptionError(f"workers must be an integer >= 1 (or None: all cores), got "
                          f"{workers!r}", option="workers")
    return workers


@contextlib.contextmanager
def interrupts_held():
    """Run the block to its end through a Ctrl-C, then raise it: a SIGINT meanwhile is held and
    raised as ``KeyboardInterrupt`` once the block is done. For cleanup that must finish (a
    staging folder removed after an interrupt): a user presses Ctrl-C twice, and ``timeout -s
    INT`` signals both the process and its group, so the second one came while the first one's
    cleanup ran and left the folder behind. Outside the main thread, where no handler can be
    set, the block runs as it is."""
    import signal
    held: list = []
    outside = object()
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    except ValueError:          # not the main thread: signals are the main thread's
        previous = outside
    if previous is outside:
        yield
        return
    try:
        yield
    finally:
        # None: a handler not set from Python (as signal.signal says); the default's then
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
    if held:
        raise KeyboardInterrupt
