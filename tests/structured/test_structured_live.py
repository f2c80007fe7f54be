"""Structured outputs with the official ``openai`` client against a real
server (every actor its own process) serving a tiny random Llama on CPU (the
session's ``tiny_chat_server``, see ``tests/live_tiny.py``). The random model
alone writes garbage, so output that parses is the mask at work."""

from __future__ import annotations

import re
from typing import Literal

import pytest

from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PROMPTS = ["Describe a pet.", "Another one, please", "héllo wörld", "The quick brown fox", "system user"]


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


class Order(BaseModel):
    items: list[Literal["tea", "cake", "soup"]] = Field(min_length=1, max_length=3)
    table: int = Field(ge=1, le=9)
    note: str | None = Field(max_length=6)


@pytest.fixture(scope="module")
def client(tiny_chat_server):
    base_url, key = tiny_chat_server
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_parse_with_a_pydantic_model_returns_a_validated_object(client):
    completion = client.chat.completions.parse(model="tiny", messages=chat(PROMPTS[0]), response_format=Pet,
                                               max_tokens=200, temperature=0.0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Pet), choice.message


@pytest.mark.parametrize("model", [Pet, Order])
def test_json_schema_output_validates_for_every_prompt(client, model):
    schema = {"name": model.__name__, "schema": model.model_json_schema(), "strict": True}
    for i, prompt in enumerate(PROMPTS):
        out = client.chat.completions.create(model="tiny", messages=chat(prompt), max_tokens=200, seed=i,
                                             response_format={"type": "json_schema", "json_schema": schema})
        choice = out.choices[0]
        assert choice.finish_reason == "stop", (prompt, choice)
        model.model_validate_json(choice.message.content)


def test_regex_and_choice_outputs_match(client):
    pattern = r"[0-9]{3}-[0-9]{4}"
    for name, body in (("structured_outputs", {"structured_outputs": {"regex": pattern}}), ("guided", {"guided_regex": pattern})):
        out = client.chat.completions.create(model="tiny", messages=chat("A number"), max_tokens=30, extra_body=body)
        assert re.fullmatch(pattern, out.choices[0].message.content), name
        assert out.choices[0].finish_reason == "stop"
    choices = ["yes", "no", "maybe so"]
    for i in range(3):
        out = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=20, seed=i,
                                        extra_body={"structured_outputs": {"choice": choices}})
        assert out.choices[0].text in choices and out.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="tiny", messages=chat("Pick"), max_tokens=20, stream=True,
                                              extra_body={"guided_choice": choices})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) in choices


def test_a_pattern_that_cannot_be_completed_fails_at_that_token(client):
    """Its first tokens are allowed (no 400 up front); past "ab" nothing is,
    not even the end: a 400 naming the field, never a "stop" with output
    that does not match; streamed, the error ends the stream."""
    body = {"structured_outputs": {"regex": r"ab[^\s\S]"}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=chat("x"), max_tokens=10, extra_body=body)
    error = err.value.body
    assert error["param"] == "structured_outputs.regex" and "cannot be continued" in error["message"], error
    with pytest.raises(openai.APIError, match="cannot be continued"):
        for _ in client.chat.completions.create(model="tiny", messages=chat("x"), max_tokens=10, stream=True,
                                                extra_body=body):
            pass
    out = client.chat.completions.create(model="tiny", messages=chat("x"), max_tokens=10,
                                         extra_body={"structured_outputs": {"regex": "ab"}})
    assert out.choices[0].message.content == "ab"  # the server goes on


@pytest.mark.parametrize(("body", "param", "reason"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format.json_schema.schema", "wat"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex", "regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "missing"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format", "guided_regex"),
])
def test_an_invalid_spec_is_a_400_naming_the_field(client, body, param, reason):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=chat("x"), max_tokens=5, extra_body=body)
    assert err.value.status_code == 400
    error = err.value.body
    assert error["param"] == param and param in error["message"] and reason in error["message"], error
