"""One HTTP request's state in the frontend: its engine requests (one per
prompt, ``n`` choices each), its choices' outputs, and its bounded inbound
queue.

The frontend actor's mailbox reader only ever ``push``es into an exchange,
never waiting: the queue is bounded by what the exchange can legitimately
receive (every ``TokenDelta`` carries at least one token, so a choice gets at
most ``max_tokens`` deltas plus one ``Finished`` / ``Failed``, plus one
failure from the frontend itself). A message beyond the bound is an engine
bug: the exchange fails, others go on.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from mstar_actors.frontend.openai_api import ApiError, ChoiceOutput, ParsedRequest
from mstar_actors.messages import Failed, choice_ids, new_request_id


class Exchange:
    """One HTTP request's engine requests (one per prompt, of ``n`` choices
    each) and its bounded inbound queue. Outputs name a choice; a failure of
    a whole request (prepare's, the adapter pool's) names the request."""

    def __init__(self, parsed: ParsedRequest, model: str, prefix: str, frontend: int = 0):
        self.parsed = parsed
        self.model = model
        self.id = new_request_id(prefix, frontend)  # the engine's
        # the response's: the client's request_id where it sent one (vLLM's ``chatcmpl-{request_id}``)
        self.response_id = f"{prefix}-{parsed.request_id}" if parsed.request_id else self.id
        self.created = int(time.time())
        self.arrival = time.perf_counter()
        self.requests = parsed.new_requests(self.id, model)
        self.choice_ids = {r.request_id: choice_ids(r.request_id, r.n) for r in self.requests}
        self.choices: dict[str, ChoiceOutput] = {}
        self.max_pending = sum((r.sampling.max_tokens + 2) * r.n for r in self.requests)
        self._pending: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None  # the handler's, while it waits for an output
        self.is_overflowed = False
        self.is_refused = False  # the engine refused it with a 4xx (the client's input): no choice of it ran to an end
        self.prompt_token_ids: list[list[int]] = []  # per request, when echo asks
        self.reasoning: tuple[str, bool, str | None] | None = None  # (parser, opened, call opening): reasoning_parser

    def push(self, msg: Any) -> None:
        """Never blocks (the mailbox reader calls it); see the module docstring."""
        if self.is_overflowed:
            return
        if len(self._pending) >= self.max_pending:
            self.is_overflowed = True
            msg = Failed(request_id=msg.request_id, status=500, error_type="server_error",
                         message=f"request {self.id}: the engine sent more outputs than max_tokens allows")
        self._pending.append(msg)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():  # done: its handler was cancelled
            waiter.set_result(None)

    async def _wait(self) -> None:
        while not self._pending:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    async def pop(self) -> Any:
        """The oldest output, waiting for one."""
        await self._wait()
        return self._pending.popleft()

    async def pop_all(self) -> list[Any]:
        """Every output queued, oldest first, waiting for one if none is."""
        await self._wait()
        out = list(self._pending)
        self._pending.clear()
        return out

    @property
    def num_choices(self) -> int:
        return sum(len(ids) for ids in self.choice_ids.values())

    def abort_ids(self) -> list[str]:
        """What to abort: a request none of whose choices is done (so prepare
        can drop it unsent), else each choice not done."""
        out = []
        for rid, ids in self.choice_ids.items():
            open_ids = [cid for cid in ids if not self.choices[cid].is_done]
            out += [rid] if len(open_ids) == len(ids) else open_ids
        return out

    def is_waiting(self) -> bool:
        """Some choice has output still to come."""
        for choice in self.choices.values():  # a loop, not any(): called once per event
            if choice.finish_reason is None:
                return True
        return False



def failure(exchange: Exchange, msg: Failed) -> ApiError:
    """The engine's refusal as the client's error, the cap named by the field the client sent; a
    server's failure names the response's id, which the server's log names too."""
    param = exchange.parsed.cap_param if msg.param == "max_tokens" else msg.param
    if param == "prompt_logprobs" and exchange.parsed.output.prompt_logprobs is None:  # an echo's, of logprobs
        param = "logprobs"
    message = msg.message if msg.status < 500 else f"request {exchange.response_id}: {msg.message}"
    if msg.param == "max_tokens" and message.startswith("max_tokens "):  # the engine's name for the cap
        message = param + message.removeprefix("max_tokens")
    if msg.param == "max_tokens" and not exchange.parsed.cap_sent:
        message += f" (no max_tokens was sent: a completion's is {exchange.parsed.sampling.max_tokens} then)"
    if msg.status < 500 and len(exchange.requests) > 1:  # a list of prompts: which one
        index = next((i for i, r in enumerate(exchange.requests) if r.request_id == msg.request_id), None)
        message = message if index is None else f"prompt[{index}]: {message}"
    retry = 1 if msg.code == "overloaded" else None  # a line past its bound (prepare's): retry soon, as admission's
    return ApiError(msg.status, message, param=param, code=msg.code, error_type=msg.error_type, retry_after_s=retry)
