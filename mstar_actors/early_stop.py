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
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each a graceful stop


def catch() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: _requested.set())


def requested() -> bool:
    """A stop signal came since ``catch``."""
    return _requested.is_set()
