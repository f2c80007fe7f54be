"""A stop signal that comes while ``serve`` starts (imports, the model's
checks, the actors' spawn): marked, not raised.

``catch()`` runs first thing in the command, before the slow imports, so a
stop signal there (SIGINT, SIGTERM, or SIGHUP: the terminal or session that
started the server went away) is neither a ``KeyboardInterrupt`` traceback nor an
exception some library catches and drops; the launcher asks ``requested()``
at its next step and its loop's own handlers take over from there
("stopped while starting")."""

from __future__ import annotations

import signal
import threading

_requested = threading.Event()
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each a graceful stop, SIGHUP unless ignored
# ``nohup`` (or a service manager) started the server with SIGHUP ignored: it outlives the terminal, as it did.
_HUP_IGNORED = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop this server gracefully: SIGHUP only where it was not ignored at start."""
    return tuple(s for s in STOP_SIGNALS if not (s == signal.SIGHUP and _HUP_IGNORED))


def catch() -> None:
    for sig in stop_signals():
        signal.signal(sig, lambda signum, frame: _requested.set())


def requested() -> bool:
    """A stop signal came since ``catch``."""
    return _requested.is_set()
