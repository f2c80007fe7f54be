"""The streaming hot path's shortcuts give what the general path gives: a
choice fed a delta as one group, and a chunk written around a pre-encoded
envelope."""

import asyncio
import json
import random

import msgspec
import pytest

from mstar_actors.frontend import openai_api as api
from mstar_actors.frontend.openai_api import ChoiceOutput
from mstar_actors.messages import SampledToken, TopLogprob
from mstar_actors.tokenization import StopStrings

WORDS = {i: w for i, w in enumerate(["a", "b", "ab", " ", "x", "y", "STOP", "S", "TOP", "<eos>"])}
EOS = 9


class WordDetokenizer:
    """Each id is its word; no text is ever held back."""

    def add(self, ids: list[int]) -> str:
        return "".join(WORDS[i] for i in ids)

    def flush(self) -> str:
        return ""


def reference_add(choice: ChoiceOutput, tokens: list) -> tuple[str, list]:
    """``ChoiceOutput.add`` as it was written before its shortcut: groups of
    one when logprobs are wanted or min_tokens is not reached, else one group."""
    if choice.is_done:
        return "", []
    first_entry = len(choice.logprobs)
    one_by_one = choice.want_logprobs or choice.num_output_tokens < choice.min_tokens
    groups = [[t] for t in tokens] if one_by_one else [tokens]
    emitted = []
    for group in groups:
        choice.num_output_tokens += len(group)
        choice.token_ids += [t.token_id for t in group]
        if choice.want_logprobs:
            choice._add_logprob(group[0])
        ids = [t.token_id for t in group]
        if ids[-1] in choice.hidden_stop_ids and choice.num_output_tokens >= choice.min_tokens:  # it ends the choice
            ids.pop()
        text = choice.detokenizer.add(ids)
        choice.num_decoded_chars += len(text)
        emit, matched = choice.stops.feed(text, search=choice.num_output_tokens > choice.min_tokens)
        choice._append(emit, emitted)
        if matched:
            choice.finish_reason = "stop"
            break
    return "".join(emitted), choice.logprobs[first_entry:]


def make_choice(stops: list[str], want_logprobs: bool, min_tokens: int, include_stop: bool) -> ChoiceOutput:
    choice = ChoiceOutput(0, WordDetokenizer(), StopStrings(stops, include_stop), WORDS.get, want_logprobs,
                          frozenset({EOS}))
    choice.min_tokens = min_tokens
    return choice


def state(choice: ChoiceOutput) -> tuple:
    return (choice.text, choice.token_ids, choice.num_output_tokens, choice.num_decoded_chars, choice.finish_reason,
            choice.logprobs)


def test_choice_add_matches_the_general_path_on_random_deltas():
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(300):
        options = dict(stops=rng.choice([[], ["STOP"], ["ab", "y"], ["x a"]]), want_logprobs=rng.random() < 0.3,
                       min_tokens=rng.choice([0, 0, 2, 5]), include_stop=rng.random() < 0.3)
        fast, reference = make_choice(**options), make_choice(**options)
        for _ in range(rng.randrange(1, 12)):
            ids = [rng.randrange(len(WORDS)) for _ in range(rng.randrange(1, 4))]
            tokens = [SampledToken(request_id="r", token_id=i, logprob=-0.5) for i in ids]
            assert fast.add(tokens) == reference_add(reference, tokens), f"seed {seed}, {options}"
            assert state(fast) == state(reference), f"seed {seed}, {options}"


def test_choice_add_hides_a_final_stop_token_and_keeps_its_id():
    choice = make_choice([], False, 0, False)
    tokens = [SampledToken(request_id="r", token_id=i) for i in (0, 3, 1, EOS)]
    assert choice.add(tokens) == ("a b", [])
    assert choice.token_ids == [0, 3, 1, EOS] and choice.num_output_tokens == 4


def test_a_stop_token_before_min_tokens_ends_nothing_and_keeps_its_text():
    """Only a thinking budget's forced </think> comes before min_tokens (the sampler masks stop tokens there):
    the scheduler ends no choice on it, so its text is the reply's, as vLLM keeps it."""
    choice = make_choice([], False, 3, False)
    tokens = [SampledToken(request_id="r", token_id=i) for i in (EOS, 0, 1, EOS)]
    assert choice.add(tokens) == ("<eos>ab", [])
    assert choice.token_ids == [EOS, 0, 1, EOS]


def test_text_offsets_count_text_held_back_for_a_stop_string():
    """A token's text_offset is where its text starts in the output, whether the
    stop-string matcher let it out yet or not ("x a b" holds back "x ", "a "...)."""
    choice = make_choice(["x a b"], True, 0, False)
    tokens = [SampledToken(request_id="r", token_id=i, logprob=-0.5) for i in (0, 3, 4, 3, 0, 3, 1)]  # "a x a b"
    choice.add(tokens[:4])
    assert choice.text == "a "  # "x " held back
    choice.add(tokens[4:])
    assert [entry[3] for entry in choice.logprobs] == [0, 1, 2, 3, 4, 5, 6]
    assert choice.text == "a " and choice.finish_reason == "stop"


def test_legacy_top_logprobs_always_hold_the_sampled_token():
    """OpenAI's legacy logprobs: up to logprobs + 1 entries, the sampled token's among them."""
    choice = make_choice([], True, 0, False)
    top = (TopLogprob(token_id=1, logprob=-0.1),)
    choice.add([SampledToken(request_id="r", token_id=0, logprob=-3.0, top_logprobs=top),
                SampledToken(request_id="r", token_id=1, logprob=-0.1, top_logprobs=top),
                SampledToken(request_id="r", token_id=4, logprob=-2.0)])
    legacy = choice.legacy_logprobs()
    assert legacy["top_logprobs"] == [{"b": -0.1, "a": -3.0}, {"b": -0.1}, {"x": -2.0}]
    assert all(top[token] == lp for token, lp, top in zip(legacy["tokens"], legacy["token_logprobs"],
                                                         legacy["top_logprobs"]))


def run_stream(parsed, extra=None) -> tuple[bytes, bytes]:
    """(bytes ``_write_choices`` writes, bytes of the general path) for one chunk."""
    from mstar_actors.frontend.exchange import Exchange
    from mstar_actors.frontend.responses import Stream

    async def body():
        exchange = Exchange(parsed, "tiny", "chatcmpl" if parsed.kind == "chat" else "cmpl")
        stream = Stream(None, exchange)
        written = []

        class Response:
            async def write(self, data):
                written.append(data)

        stream.response = Response()
        choices = [api.chat_chunk_choice(0, {"content": "h\u00e9\"\n"}, None, None),
                   api.chat_chunk_choice(1, {}, "stop", None)]
        await stream._write_choices(choices, extra)
        build = api.chat_chunk if parsed.kind == "chat" else api.completion_chunk
        fields = {"usage": None} if parsed.include_usage else {}  # continuous: no choice named, none of its own
        general = build(exchange.id, exchange.model, exchange.created, choices) | fields | (extra or {})
        return written[0], b"data: " + msgspec.json.encode(general) + b"\n\n"

    return asyncio.run(body())


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("options", [{}, {"include_usage": True}, {"include_usage": False},
                                     {"include_usage": True, "continuous_usage_stats": True}])
@pytest.mark.parametrize("extra", [None, {"prompt_token_ids": [1, 2]}])
def test_chunk_bytes_equal_the_general_encoding(kind, options, extra):
    body = {"model": "tiny", "stream": True, "stream_options": options, "n": 2}
    if kind == "chat":
        parsed = api.parse_chat(json.dumps(body | {"messages": [{"role": "user", "content": "hi"}]}).encode())
    else:
        parsed = api.parse_completion(json.dumps(body | {"prompt": "hi"}).encode())
    fast, general = run_stream(parsed, extra)
    assert fast == general
    assert json.loads(fast[len(b"data: "):])["choices"][0]["index"] == 0


def test_chat_logprobs_bytes_are_the_tokens_own():
    """Where the frontend knows a token's bytes (part of a character), ``bytes`` are those, not its text's."""
    choice = ChoiceOutput(0, WordDetokenizer(), StopStrings([], False), WORDS.get, True,
                          token_bytes={0: b"\xf0\x9f", 1: b"\x8d\x95"}.get)
    choice.add([SampledToken(request_id="r", token_id=0, logprob=-1.0, top_logprobs=(TopLogprob(token_id=1, logprob=-2.0),))])
    (entry,) = choice.chat_logprobs()
    assert entry["bytes"] == [0xF0, 0x9F] and entry["top_logprobs"][0]["bytes"] == [0x8D, 0x95]
