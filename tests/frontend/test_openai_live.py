"""The official ``openai`` client against a real server: every actor in its own
process, a tiny random Llama on CPU. Skips until the launcher is importable."""

import json
import socket
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_llama(folder, tokenizer) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def live_server(tmp_path_factory, tokenizer):
    """``(base_url, api_key)`` of a server started with ``python -m mstar_actors serve``.

    Waits for the launcher's "serving" log line (reading the child's stderr,
    no polling); fails with the log if the server exits first.
    """
    pytest.importorskip("mstar_actors.launcher")
    folder = tmp_path_factory.mktemp("live-model")
    _tiny_llama(folder, tokenizer)
    port, key = _free_port(), "live-key"
    config = folder / "serve.yaml"
    config.write_text(json.dumps({
        "model": {"path": str(folder), "name": "tiny", "dtype": "float32", "device": "cpu"},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 256},
        "kv": {"block_size": 16, "num_blocks": 64},
        "server": {"host": "127.0.0.1", "port": port, "api_key": key},
    }))  # JSON is YAML
    proc = subprocess.Popen([sys.executable, "-m", "mstar_actors", "serve", str(config)],
                            stderr=subprocess.PIPE, text=True)
    log = []
    for line in proc.stderr:
        log.append(line)
        if "serving tiny at" in line:
            break
    else:
        proc.wait()
        pytest.fail(f"the server exited ({proc.returncode}) before serving:\n{''.join(log[-40:])}")
    try:
        yield f"http://127.0.0.1:{port}/v1", key
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stderr.close()


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
