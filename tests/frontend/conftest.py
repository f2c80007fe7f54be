"""Frontend test kit: a tiny tokenizer on disk, an engine made of the real
scheduler and a scripted rank, and a harness that runs the real
FrontendActor over in-memory channels."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any, Callable

import aiohttp
import msgspec
import pytest

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world! This is a test of the tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. STOP here.",
    "héllo wörld ünïcode 東京 café naïve — emoji 🙂 too",
    "system user assistant you are a helpful model",
] * 20


def make_tokenizer_dir(folder: Path, vocab_size: int = 400) -> Path:
    """A byte-level BPE tokenizer with a ChatML template, saved like a HF model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None,
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 256,
                                                     "eos_token_id": fast.convert_tokens_to_ids("<|im_end|>")}))
    return folder


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def tiny_info(model_dir: Path, tokenizer, max_model_len: int = 256):
    """What the launcher would hand the frontend for the tiny folder (its config.json
    holds only what a tokenizer-only folder needs, so the facts are stated here)."""
    from mstar_actors.model_info import ModelInfo

    return ModelInfo(served_name="tiny", model_dir=str(model_dir), architecture="LlamaForCausalLM",
                     vocab_size=len(tokenizer), eos_token_ids=(tokenizer.eos_token_id,), dtype="float32",
                     max_model_len=max_model_len)


# --------------------------------------------------------------------------
# The engine: the real Scheduler behind stand-ins for prepare and the ranks
# --------------------------------------------------------------------------

REPLY = "Hello world! This is a test."


class Engine:
    """Reads the frontend's ``prepare`` channel, writes its ``conductor`` channel.

    ``plan(request)`` returns the messages to send back, or None to hold the
    request (a test then answers with ``send``). The default, ``reply``, runs
    the request through the engine's own ``Scheduler`` (so every TokenDelta
    and Finished keeps the engine's contract) with a scripted rank that
    samples ``REPLY`` one token per step, then EOS.
    """

    def __init__(self, tokenizer, inbox, outbox, max_model_len: int):
        self.tokenizer = tokenizer
        self.inbox = inbox
        self.outbox = outbox
        self.max_model_len = max_model_len
        self.requests: dict[str, Any] = {}
        self.started: list[Any] = []  # every SeqStart the scheduler emitted
        self.aborts: list[str] = []
        self.changed = asyncio.Event()
        self.plan: Callable[[Any], list | None] = self.reply
        self.reply_text = REPLY

    async def run(self) -> None:
        from mstar_actors.messages import Abort, NewRequest

        async for msg in self.inbox:
            match msg:
                case NewRequest():
                    self.requests[msg.request_id] = msg
                    for out in self.plan(msg) or []:
                        await self.outbox.send(out)
                case Abort():
                    self.aborts.append(msg.request_id)
            self.changed.set()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            self.changed.clear()
            await self.changed.wait()

    async def send(self, msg: Any) -> None:
        await self.outbox.send(msg)

    def choice_ids(self, req) -> list[str]:
        from mstar_actors.messages import choice_ids

        return choice_ids(req.request_id, req.n)

    def prompt_ids(self, req) -> list[int]:
        """What prepare makes of the request's prompt."""
        if req.prompt_token_ids:
            return list(req.prompt_token_ids)
        if req.prompt:
            return self.tokenizer(req.prompt).input_ids
        text = self.tokenizer.apply_chat_template([msgspec.to_builtins(m) for m in req.messages],
                                                  tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def prompt_len(self, req) -> int:
        return len(self.prompt_ids(req))

    def reply(self, req, text: str | None = None, ids: list[int] | None = None) -> list:
        """Every output of ``req``'s choices, run to their end by a scheduler of
        their own: ``text``'s tokens (or ``ids``), then EOS."""
        from mstar_actors.messages import Prepared, StepDone
        from mstar_actors.sched import Scheduler

        sched = Scheduler(num_blocks=256, block_size=16, max_num_seqs=8, max_num_batched_tokens=2048,
                          max_model_len=self.max_model_len, eos_token_ids=[self.tokenizer.eos_token_id])
        prepared = Prepared(request_id=req.request_id, model=req.model, prompt_token_ids=self.prompt_ids(req),
                            sampling=req.sampling, n=req.n, return_prompt_ids=req.return_prompt_ids)
        out = list(sched.add(prepared, "base"))
        ids = self.tokenizer(text or self.reply_text).input_ids if ids is None else ids
        rank = _ScriptedRank(ids + [self.tokenizer.eos_token_id])
        while (plan := sched.schedule()) is not None:
            self.started += plan.started
            out += sched.update(StepDone(step_id=plan.step_id, rank=0, sampled=rank.run(plan)))
        return out


class _ScriptedRank:
    """Samples ``ids`` in order for every sequence (the scheduler ends it at
    EOS or max_tokens); logprobs made up from the position (``-0.5 - i / 100``,
    alternatives ``k`` lower)."""

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.sampling: dict[str, Any] = {}
        self.num_sampled: dict[str, int] = {}

    def run(self, plan) -> list:
        from mstar_actors.messages import SampledToken, TopLogprob

        for start in plan.started:
            self.sampling[start.request_id] = start.sampling
            self.num_sampled[start.request_id] = len(start.output_token_ids)
        sampled = []
        for chunk in (c for c in plan.scheduled if c.sample):
            rid, i = chunk.request_id, self.num_sampled[chunk.request_id]
            tid = self.ids[i]
            num_top, lp, top = self.sampling[rid].logprobs, None, ()
            if num_top is not None:
                lp = -0.5 - i * 0.01
                top = tuple(TopLogprob(token_id=(tid + k) % 300, logprob=lp - k) for k in range(num_top))
            sampled.append(SampledToken(request_id=rid, token_id=tid, logprob=lp, top_logprobs=top))
            self.num_sampled[rid] = i + 1
        return sampled
# --------------------------------------------------------------------------
# The harness: the real actor, in-memory channels, a real HTTP port
# --------------------------------------------------------------------------


class Harness:
    def __init__(self, model_dir: Path, tokenizer, started: bool = True, model_keys: dict | None = None, **server: Any):
        from mstar_actors.config import Config, parse_config
        from mstar_actors.messages import (ActorToLauncher, ConductorToFrontend, FrontendToPrepare,
                                           LauncherToActor)
        from transport.memory import MemoryChannel

        self.config: Config = parse_config({
            "model": {"path": str(model_dir), "name": "tiny"} | (model_keys or {}),
            "server": {"port": 0} | server,
            "lora": {"adapters": {"tiny-lora": str(model_dir)}},
        })
        self.conductor = MemoryChannel(ConductorToFrontend, "conductor->frontend")
        self.control_in = MemoryChannel(LauncherToActor, "launcher->frontend")
        self.prepare = MemoryChannel(FrontendToPrepare, "frontend->prepare")
        self.control_out = MemoryChannel(ActorToLauncher, "frontend->launcher")
        self.info = tiny_info(model_dir, tokenizer)
        self.engine = Engine(tokenizer, self.prepare, self.conductor, max_model_len=self.info.max_model_len)
        self.started = started

    async def __aenter__(self) -> "Harness":
        from actors.frontend import FrontendActor

        self.actor = FrontendActor(name="frontend", config=self.config, info=self.info,
                                   inbox={"conductor": self.conductor, "control": self.control_in},
                                   outbox={"prepare": self.prepare, "control": self.control_out})
        self.actor_task = asyncio.create_task(self.actor.run())
        self.engine_task = asyncio.create_task(self.engine.run())
        ready = await self.control_out.recv()
        assert type(ready).__name__ == "ActorReady", ready
        if self.started:
            await self.start()
        self.url = f"http://127.0.0.1:{self.actor.port}"
        self.session = aiohttp.ClientSession()
        return self

    async def control(self, msg: Any) -> None:
        """Send a launcher message and wait until the actor has applied it."""
        self.actor.health_changed.clear()
        await self.control_in.send(msg)
        await self.actor.health_changed.wait()

    async def start(self) -> None:
        from mstar_actors.messages import Started

        await self.control(Started())

    async def __aexit__(self, *exc) -> None:
        from mstar_actors.messages import Shutdown

        await self.session.close()
        await self.control_in.send(Shutdown(reason="test over"))
        code = await self.actor_task
        self.engine_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.engine_task
        assert code == 0

    async def post(self, path: str, body: Any, headers: dict | None = None) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.session.post(self.url + path, data=data, headers=headers or {}) as r:
            text = await r.read()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text

    async def metrics(self) -> str:
        """``GET /metrics``' text."""
        async with self.session.get(self.url + "/metrics") as r:
            return await r.text()

    async def stream(self, path: str, body: dict) -> tuple[int, list]:
        """POST with stream: true; the list of SSE data payloads (decoded, or "[DONE]")."""
        async with self.session.post(self.url + path, json=body | {"stream": True}) as r:
            if r.status != 200:
                return r.status, [await r.json()]
            events = []
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
            return r.status, events


@pytest.fixture
def harness(model_dir, tokenizer):
    """A factory: ``async with harness(**server_overrides) as h:``."""
    return lambda **kw: Harness(model_dir, tokenizer, **kw)
