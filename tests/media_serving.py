"""What the multimodal serving tests share: a tiny model folder behind the
real launcher, transformers' model and our preparer for the reference,
chat requests sent at once with the ``openai`` client, and the check that
every served reply is transformers' greedy tokens."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from test_launcher import Server

MAX_TOKENS = 8


def serve(model_dir: Path, tmp_path_factory, extra_config: str = ""):
    """A module fixture's body: the launcher serving ``model_dir`` (its config
    with ``extra_config``'s lines) until the module ends."""
    runtime_dir = tmp_path_factory.mktemp("xdg")
    runtime_dir.chmod(0o700)
    print("seed: 0 (the tiny model's weights and model.seed)")
    with Server(model_dir, runtime_dir, tmp_path_factory.mktemp("cfg"), extra_config).running() as srv:
        yield srv


@functools.cache
def hf_and_preparer(hf_class: type, model_dir: Path):
    """(transformers' ``hf_class`` in float32, greedy without an end, our preparer) of ``model_dir``."""
    from mstar_actors.config import Config, ModelConfig
    from mstar_actors.model_info import load_model_info
    from mstar_actors.prepare.media import MediaLimits
    from mstar_actors.prepare.preparers import load_preparer

    hf = hf_class.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf, load_preparer(load_model_info(Config(model=ModelConfig(path=str(model_dir)))), MediaLimits())


async def ask_all(port: int, bodies: dict[str, list[dict]]) -> dict[str, object]:
    """Every body's greedy reply (or its ``APIStatusError``), requests in flight together."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)

    async def ask(messages):
        try:
            return await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                extra_body={"ignore_eos": True})
        except openai.APIStatusError as err:
            return err

    try:
        results = await asyncio.gather(*(ask(m) for m in bodies.values()))
    finally:
        await client.close()
    return dict(zip(bodies, results))


def assert_replies_are_references(replies: dict[str, object], bodies: dict[str, list[dict]], model_dir: Path,
                                  reference_reply: Callable[[Path, list[dict]], list[int]]) -> None:
    """Each reply's tokens are ``reference_reply`` of its body, ``MAX_TOKENS`` of them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    for name, reply in replies.items():
        assert not isinstance(reply, Exception), f"{name}: {reply}"
        expected = reference_reply(model_dir, bodies[name])
        got = tokenizer.convert_tokens_to_ids([t.token for t in reply.choices[0].logprobs.content])
        assert got == expected, f"{name}: served {got}, transformers {expected}"
        assert reply.usage.completion_tokens == MAX_TOKENS
