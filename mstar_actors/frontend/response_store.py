"""Stored Responses (``server.responses_store_mib``), as OpenAI's ``store`` and vLLM's store keep them:
each answered Response beside its conversation's input items, so a later request continues it by
``previous_response_id`` and ``GET /v1/responses/{id}`` (and its ``input_items``) read it back. In the
memory of the frontend that answered (one frontend: ``config`` refuses the store with several), kept as
their JSON (what the store's bytes count), the least recently used dropped past them. An id is never
taken twice: a client's ``request_id`` names its response, and another's may not replace it. Pure, no I/O.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from mstar_actors.frontend.openai_api import ApiError

MAX_LISTED = 100  # input items a page lists at most (OpenAI's limit)


@dataclass
class Stored:
    response_json: bytes  # the Response as answered (its ``output`` items the conversation's last turn)
    items_json: bytes  # the input items of its whole conversation, each with its id

    @property
    def nbytes(self) -> int:
        return len(self.response_json) + len(self.items_json)

    @property
    def response(self) -> dict:
        return msgspec.json.decode(self.response_json)

    @property
    def items(self) -> list[dict]:
        return msgspec.json.decode(self.items_json)


class ResponseStore:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: collections.OrderedDict[str, Stored] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, response: dict, items: list[dict]) -> bool:
        """Keep ``response`` and its conversation's ``items``; False where it alone is past the store, or
        its id is taken."""
        stored = Stored(msgspec.json.encode(response), msgspec.json.encode(items))
        if stored.nbytes > self.max_bytes or response["id"] in self._entries:
            return False
        while self.nbytes + stored.nbytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.nbytes -= dropped.nbytes
        self._entries[response["id"]] = stored
        self.nbytes += stored.nbytes
        return True

    def get(self, response_id: str) -> Stored | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def pop(self, response_id: str) -> bool:
        stored = self._entries.pop(response_id, None)
        if stored is not None:
            self.nbytes -= stored.nbytes
        return stored is not None

    def conversation(self, response_id: str) -> list[dict] | None:
        """The items a continuation of ``response_id`` follows: its input, then its output."""
        stored = self.get(response_id)
        return None if stored is None else [*stored.items, *stored.response["output"]]


def input_items_page(items: list[dict], query: Mapping[str, str]) -> dict:
    """``GET /v1/responses/{id}/input_items``'s list, as its ``query`` asks: ``limit`` items (20) in
    ``order`` ("desc", the newest first, or "asc") past the item ``after``; ApiError naming a bad one."""
    limit = query.get("limit", "20")
    if not (limit.isdigit() and 1 <= int(limit) <= MAX_LISTED):
        raise ApiError(400, f"limit: expected an integer in [1, {MAX_LISTED}], got {limit!r}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order: expected 'asc' or 'desc', got {order!r}", param="order")
    ordered = items if order == "asc" else items[::-1]
    start, after = 0, query.get("after")
    if after is not None:
        start = next((i + 1 for i, item in enumerate(ordered) if item.get("id") == after), -1)
        if start < 0:
            raise ApiError(400, f"after: no input item of this response has the id {after!r}", param="after")
    limit = int(limit)
    page = ordered[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(ordered)}
