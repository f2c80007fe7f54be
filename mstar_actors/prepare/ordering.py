"""Which prepared requests may go, and which may start: the prepare pool's state.

Pure: no asyncio, no threads, no I/O, no clock. The prepare actor owns one
``PendingRequests`` a lane and calls them from its loop's thread only; the actor runs
the preparations (tasks, a thread pool) and reports how each ends.

A request's life::

    start --hand_over--> in the pool --finish(result)--> done --pop_releasable--> released
      |  before hand_over: may be dropped (cancelled)
      \\-- abandon, any time before its release: out of the order, its result dropped

(A request with http(s) media starts once its bytes are fetched: the actor
fetches outside this order, so a slow server holds no request behind it.)

Invariants:

- **Done, then gone.** A request leaves through ``pop_releasable`` once it is
  done, the oldest of those done first: none waits for a slower one started
  before it (a small image never waits for a long video, as each request of
  vLLM's awaits its own media), and among requests done together the older
  goes first.
- **Two bounds.** ``can_start`` holds while fewer than ``max_preparing`` are
  preparing (abandoned ones included: they still hold a thread or its queue)
  and fewer than ``max_unreleased`` are in the order (preparing or done, not
  yet released: done ones wait only while the conductor's ring is full).
- **Abandon is final.** An abandoned request leaves the order at once and is
  never released; it still counts as preparing until its
  preparation ends (``finish`` or ``drop``), and then its result is dropped.
  ``is_abandoned`` is the one field another thread reads: a pool thread that
  has not begun the draft skips it.
- **Failures are results.** A ``Failed`` is finished and released like any
  result, once done; it affects no other request.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from mstar_actors.messages import NewRequest


@dataclass(eq=False)  # identity: an abandoned request may share its id with a later one
class PendingRequest:
    """One request between its start and its release."""

    req: NewRequest
    is_in_pool: bool = False  # handed to a pool thread: it can no longer be cancelled
    is_abandoned: bool = False  # read by the pool thread before it drafts
    is_done: bool = False
    result: Any = None  # Draft | Failed, once done

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def is_cancellable(self) -> bool:
        """Not yet handed to a pool thread: its task may be cancelled."""
        return not self.is_in_pool and not self.is_done


class PendingRequests:
    """The requests started and not yet released, and the bounds on them."""

    def __init__(self, max_preparing: int, max_unreleased: int):
        if max_preparing < 1 or max_unreleased < 1:
            raise ValueError(f"max_preparing ({max_preparing}) and max_unreleased ({max_unreleased}) must be >= 1")
        self.max_preparing = max_preparing
        self.max_unreleased = max_unreleased
        self._order: collections.OrderedDict[str, PendingRequest] = collections.OrderedDict()  # by start
        self._preparing: set[PendingRequest] = set()  # abandoned ones included

    def __contains__(self, request_id: str) -> bool:
        """Whether the request is in the release order (an ``Abort`` for it abandons it)."""
        return request_id in self._order

    def __len__(self) -> int:
        return len(self._order)

    @property
    def num_preparing(self) -> int:
        return len(self._preparing)

    def request_ids(self) -> list[str]:
        """The requests not yet released, oldest first."""
        return list(self._order)

    # ---- start / finish -------------------------------------------------------

    def can_start(self) -> bool:
        return self.num_preparing < self.max_preparing and len(self._order) < self.max_unreleased

    def start(self, req: NewRequest) -> PendingRequest:
        if not self.can_start():
            raise RuntimeError(f"request {req.request_id} started past the bounds ({self._describe()})")
        if req.request_id in self._order:
            raise ValueError(f"request {req.request_id} is already pending; request ids must be unique")
        pending = PendingRequest(req)
        self._order[req.request_id] = pending
        self._preparing.add(pending)
        return pending

    def hand_over(self, pending: PendingRequest) -> None:
        """Its preparation moved to a pool thread: from here it runs to its end."""
        self._check_preparing(pending, "handed over")
        pending.is_in_pool = True

    def finish(self, pending: PendingRequest, result: Any) -> None:
        """Its preparation ended with ``result``: released in its turn, or dropped if abandoned."""
        self._check_preparing(pending, "finished")
        self._preparing.discard(pending)
        pending.is_done = True
        pending.result = None if pending.is_abandoned else result

    def drop(self, pending: PendingRequest) -> None:
        """Its preparation ended without a result (cancelled): it leaves the order unsent."""
        self._check_preparing(pending, "dropped")
        self._preparing.discard(pending)
        if self._order.get(pending.request_id) is pending:
            del self._order[pending.request_id]
        pending.is_abandoned = True

    # ---- abandon / release ----------------------------------------------------

    def abandon(self, request_id: str) -> PendingRequest:
        """Take a request out of the order; its result will be dropped. The
        caller cancels its preparation if it ``is_cancellable``."""
        pending = self._order.pop(request_id)
        pending.is_abandoned = True
        pending.result = None
        return pending

    def pop_releasable(self) -> PendingRequest | None:
        """The oldest request that is done (its ``result`` to send), else None."""
        done = next((p for p in self._order.values() if p.is_done), None)  # (at most max_unreleased to look at)
        if done is not None:
            del self._order[done.request_id]
        return done

    # ---- checks ---------------------------------------------------------------

    def _check_preparing(self, pending: PendingRequest, verb: str) -> None:
        if pending not in self._preparing:
            raise RuntimeError(f"request {pending.request_id} {verb} but it is not preparing ({self._describe()})")

    def _describe(self) -> str:
        return (f"{self.num_preparing} of {self.max_preparing} preparing, "
                f"{len(self._order)} of {self.max_unreleased} unreleased")
