"""The frontend's admission: a request that finds ``server.max_waiting_requests`` choices waiting is a 503.

A request goes in while fewer wait, its own choices taking the queue past the limit where they must (by at
most what the server holds at once, the 400's bound), so a request of many choices is not held out for as long
as smaller ones keep the queue short of room for all of them (under steady load: for ever).

Pure: the frontend passes the engine's last report (``EngineStats``) and its own count of choices sent with no
output yet. Between two of the engine's reports (a step apart) the frontend estimates: the choices sent that have
no output yet and are not starting (their prefill in flight), less the sequences the engine can still start (a
burst at an idle server runs at once). Each of N frontends estimates its own and counts its share of what the
engine reports for all of them (the free sequences, rounded up, and those starting): between two reports each
lets its share and ``max_waiting`` more in (and one request's choices past them), so the queue stays near N
times ``max_waiting``, one request each past it at most (each taking all the
free sequences as its own, N frontends let N times them in: 14 waiting of a limit of 2 with 3 frontends and 4
seqs). A frontend with nothing on its way takes all of them for one request: one that fits an idle engine is
never refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from mstar_actors.frontend.openai_api import ApiError


@dataclass(frozen=True)
class EngineLoad:
    """The engine's last report, and this frontend's choices sent with no output yet."""

    num_waiting: int = 0
    num_running: int = 0
    num_starting: int = 0
    num_unacked: int = 0
    num_frontends: int = 1  # the frontends the engine's counts are shared by (``server.api_server_count``)


def admission_refusal(num_choices: int, n: int, load: EngineLoad, max_num_seqs: int,
                      max_waiting: int) -> ApiError | None:
    """The refusal of a request of ``num_choices`` choices (prompts x ``n``), or None: it may go in."""
    if num_choices > max_num_seqs + max_waiting:  # it would never fit: no retry helps
        return ApiError(400, f"{num_choices} choices (prompts x n) are more than this server holds at once: "
                             f"scheduler.max_num_seqs ({max_num_seqs}) running and server.max_waiting_requests "
                             f"({max_waiting}) waiting; send fewer", param="n" if n > 1 else "prompt")
    # sequences the engine can still start: none while it has a queue (its own waiting take them first)
    free = 0 if load.num_waiting else max(0, max_num_seqs - load.num_running)
    if load.num_unacked:  # a frontend with choices on their way takes its share; with none, all (one request)
        free = -(-free // load.num_frontends)
    # (running with no token yet: not waiting; a frontend's share of them)
    unstarted = max(0, load.num_unacked - load.num_starting // load.num_frontends)
    num_waiting = max(load.num_waiting, unstarted - free)
    if num_waiting >= max_waiting:  # (free seats mean none waits: max_waiting is at least 1)
        return ApiError(503, f"server overloaded: {num_waiting} sequences waiting, the limit of {max_waiting} "
                             "(server.max_waiting_requests; a sequence is one choice of one prompt); retry later",
                        code="overloaded", retry_after_s=1)
    return None
