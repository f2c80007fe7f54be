"""The prepare actor: client requests in, model inputs out, in arrival order.

``Preparer`` is the pure core: one ``NewRequest`` becomes a ``Prepared``
(chat template, prompt encoding, or given token ids checked against the
vocabulary) or a ``Failed(400)`` for that request alone. The actor is a thin
loop that hands each request to the core and forwards ``Abort`` in order.

Today preparation runs inline. A pool slots in at ``_prepare``: it would hand
requests to workers and release results in arrival order, so the order of
``Prepared`` / ``Failed`` / ``Abort`` on the conductor channel stays the order
the frontend sent them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from actors.base import Actor
from mstar_actors.messages import Abort, Failed, NewRequest, Prepared


class Preparer:
    """Turns one request into token ids. No I/O after construction.

    ``tokenization`` provides ``encode_prompt(text) -> list[int]`` and
    ``apply_chat_template(messages, add_generation_prompt) -> list[int]``.
    """

    def __init__(self, tokenization: Any, vocab_size: int, max_model_len: int | None = None):
        self.tokenization = tokenization
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def prepare(self, req: NewRequest) -> Prepared | Failed:
        try:
            token_ids, param = self._token_ids(req)
        except Exception as err:  # the client's input broke tokenization: its request alone fails
            return _failed(req, f"could not prepare the request: {type(err).__name__}: {err}", _param_of(req))
        problem = self._check(token_ids)
        if problem:
            return _failed(req, problem, param)
        return Prepared(
            request_id=req.request_id,
            model=req.model,
            prompt_token_ids=token_ids,
            sampling=req.sampling,
            arrival_time=req.arrival_time,
            prompt_param=param,
        )

    def _token_ids(self, req: NewRequest) -> tuple[list[int], str]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids), "prompt"
        if req.messages is not None:
            ids = self.tokenization.apply_chat_template(req.messages, req.add_generation_prompt)
            return list(ids), "messages"
        if req.prompt is not None:
            return list(self.tokenization.encode_prompt(req.prompt)), "prompt"
        raise ValueError("none of prompt, prompt_token_ids or messages is set")

    def _check(self, token_ids: list[int]) -> str | None:
        if not token_ids:
            return "the prompt is empty: send at least one token"
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return f"token id {bad} is outside the vocabulary: ids must be in [0, {self.vocab_size})"
        if self.max_model_len is not None and len(token_ids) >= self.max_model_len:
            return (
                f"the prompt has {len(token_ids)} tokens; this server's context is "
                f"{self.max_model_len} tokens, prompt and output together"
            )
        return None


def _param_of(req: NewRequest) -> str:
    return "messages" if req.messages is not None else "prompt"


def _failed(req: NewRequest, message: str, param: str) -> Failed:
    return Failed(request_id=req.request_id, status=400, message=message, param=param)


def read_vocab_size(model_dir: Path) -> int:
    """The model's vocabulary size from ``config.json`` (VLMs keep it in ``text_config``)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not size:
        raise ValueError(f"{model_dir}/config.json: no vocab_size (nor text_config.vocab_size)")
    return int(size)


def load_preparer(model_dir: Path, max_model_len: int | None) -> Preparer:
    from mstar_actors.tokenization import Tokenization

    return Preparer(Tokenization(model_dir), read_vocab_size(model_dir), max_model_len)


class PrepareActor(Actor):
    """inbox: ``frontend`` (FrontendToPrepare), ``control``; outbox: ``conductor``, ``control``."""

    def __init__(self, *, preparer: Preparer | None = None, **kw: Any):
        super().__init__(**kw)
        self.preparer = preparer  # tests may inject one; otherwise built in start()

    async def start(self) -> None:
        if self.preparer is None:
            from mstar_actors.fetch import resolve_model

            model_dir = resolve_model(self.config.model.path)
            self.preparer = await self.run_blocking(load_preparer, model_dir, self.config.scheduler.max_model_len)

    async def handle(self, channel: str, msg: Any) -> None:
        match msg:
            case NewRequest():
                await self.outbox["conductor"].send(self._prepare(msg))
            case Abort():
                await self.outbox["conductor"].send(msg)
            case _:
                self.unknown(channel, msg)

    def _prepare(self, req: NewRequest) -> Prepared | Failed:
        return self.preparer.prepare(req)
