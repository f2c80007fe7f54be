"""The official ``openai`` client against a real server: every actor in its own
process, a tiny random Llama on CPU (the session's ``tiny_chat_server``, see
``tests/live_tiny.py``). Skips until the launcher is importable."""


import pytest

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live_server(tiny_chat_server):
    """``(base_url, api_key)`` of a server started with ``python -m mstar_actors serve``."""
    pytest.importorskip("mstar_actors.launcher")
    return tiny_chat_server


@pytest.fixture
def client(live_server):
    base_url, key = live_server
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)


def test_models_and_auth(client, live_server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live_server[0], api_key="wrong", max_retries=0).models.list()


def test_chat_and_stream_agree_greedily(client):
    messages = [{"role": "user", "content": "Hello"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert full.usage.completion_tokens == 8 and full.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_completions_n_and_seed(client):
    out = client.completions.create(model="tiny", prompt="The quick", max_tokens=5, n=2, seed=3, temperature=1.0)
    again = client.completions.create(model="tiny", prompt="The quick", max_tokens=5, n=2, seed=3, temperature=1.0)
    assert [c.text for c in out.choices] == [c.text for c in again.choices]


def test_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert ok.choices[0].message.content is not None
