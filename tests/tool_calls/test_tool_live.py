"""Tool calling with the official ``openai`` client against a real server: every
actor in its own process, a tiny random Llama on CPU whose tokenizer has a
hermes-format template. The model is random, so ``auto`` is checked to run;
forced calls are checked valid, which holds once structured outputs apply
``SamplingParams.structured`` (skipped where the grammar engine is absent)."""

from __future__ import annotations

import json
from typing import Literal

import pytest

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


class Weather(__import__("pydantic").BaseModel):
    city: Literal["Paris", "Oslo"]
    unit: Literal["c", "f"]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": Weather.model_json_schema()}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
HISTORY = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


@pytest.fixture(scope="module")
def client(tiny_chat_server):
    """The session's ``tiny_chat_server`` (``tests/live_tiny.py``): the hermes template's model."""
    pytest.importorskip("mstar_actors.launcher")
    base_url, key = tiny_chat_server
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)


def test_auto_runs_full_and_streamed(client):
    out = client.chat.completions.create(model="tiny", messages=HISTORY[:1], tools=TOOLS, tool_choice="auto",
                                         max_tokens=8, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content is not None or choice.message.tool_calls
    chunks = list(client.chat.completions.create(model="tiny", messages=HISTORY[:1], tools=TOOLS, max_tokens=8,
                                                 temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (choice.message.content or "")  # greedy: the same reply, read the same way


def test_a_history_with_tool_results_is_accepted(client):
    out = client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_tool_choice_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=HISTORY[:1], tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice.function.name"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_are_always_valid(client, tool_choice):
    pytest.importorskip("mstar_actors.runner.grammar")  # the engine that applies SamplingParams.structured
    for seed in range(4):
        out = client.chat.completions.create(model="tiny", messages=HISTORY[:1], tools=TOOLS, tool_choice=tool_choice,
                                             max_tokens=256, temperature=1.0, seed=seed)
        choice = out.choices[0]
        if tool_choice == "required" and choice.finish_reason == "length":  # parallel calls, cut in a later one
            assert out.usage.completion_tokens == 256 and choice.message.tool_calls, out
        else:  # as vLLM's: "tool_calls" for required calls, a named function's the engine's reason (OpenAI's too)
            assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop"), choice
        calls = choice.message.tool_calls  # required: one or more (parallel calls); a named function: one
        assert len(calls) == 1 or tool_choice == "required", calls
        assert len({call.id for call in calls}) == len(calls)
        for call in calls:
            assert call.id.startswith("call_") and call.type == "function"
            if isinstance(tool_choice, dict) or call.function.name == "get_weather":
                assert call.function.name == "get_weather"
                Weather.model_validate_json(call.function.arguments)
            else:
                assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}
