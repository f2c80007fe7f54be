"""A stop signal that comes while ``serve`` starts (imports, the model's
checks, the actors' spawn): marked, not raised.

``catch()`` runs first thing in the command, before the slow imports, so a
SIGINT or SIGTERM there is neither a ``KeyboardInterrupt`` traceback nor an
exception some library catches and drops; the launcher asks ``requested()``
at its next step and its loop's own handlers take over from there
("stopped while starting")."""

from __future__ import annotations

import signal
import threading

_requested = threading.Event()


def catch() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: _requested.set())


def requested() -> bool:
    """A stop signal came since ``catch``."""
    return _requested.is_set()
