"""End to end: the embedded SmolLM2 served by every actor in its own process
answers a chat question with the model's own greedy reply, token for token
what ``transformers`` ``generate`` says on the same converted weights and the
same chat template."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France? Tell me a little about it."}]
MAX_TOKENS = 32


def _post(server, path: str, body: dict) -> dict:
    request = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {server.api_key}"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _reference(model_dir, tokenizer) -> tuple[str, list[int], int]:
    """transformers' greedy reply: (text, its token ids incl. a final EOS, number of prompt tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
    new = out[0, prompt.shape[1]:].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), new, prompt.shape[1]


def test_chat_reply_equals_transformers_generate(smollm2_server, smollm2_tokenizer):
    reply = _post(smollm2_server, "/chat/completions",
                  {"model": smollm2_server.model, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0})
    text, token_ids, num_prompt = _reference(smollm2_server.model_dir, smollm2_tokenizer)
    assert reply["choices"][0]["message"]["content"] == text
    assert reply["usage"]["completion_tokens"] == len(token_ids)
    assert reply["usage"]["prompt_tokens"] == num_prompt
    ended_by_eos = token_ids[-1] == smollm2_tokenizer.eos_token_id
    assert reply["choices"][0]["finish_reason"] == ("stop" if ended_by_eos else "length")
    assert "France" in text and len(token_ids) == MAX_TOKENS  # the real model, and a long reply
