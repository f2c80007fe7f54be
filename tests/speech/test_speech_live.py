"""``POST /v1/audio/speech`` on a live server of a tiny Orpheus (every actor in
its own process, CPU, float32): the audio is SNAC's decode of the codec tokens
transformers generates greedily for the same prompt (peft's, for an adapter),
streamed as whole, and every refused field is a 400 naming it."""

from __future__ import annotations

import base64
import json

import pytest
import torch

from tests.live_tiny import serve_tiny
from tests.speech.speech_factories import (
    ids,
    orpheus_prompt,
    orpheus_tokenizer,
    reference_pcm,
    save_tiny_orpheus,
    save_tiny_snac,
)

openai = pytest.importorskip("openai")
pytest.importorskip("snac")
pytestmark = pytest.mark.slow

TEXT = "Hello world! This is a test."
GREEDY = {"temperature": 0, "repetition_penalty": 1.0}
WAV_HEADER_BYTES = 44


class Served:
    """The server's URL and the same weights in transformers, peft and SNAC."""

    def __init__(self, base_url, tok, model, peft_model, snac):
        self.base_url, self.tok, self.model, self.peft_model, self.snac = base_url, tok, model, peft_model, snac
        self.code_base = tok.convert_tokens_to_ids("<custom_token_10>")

    def greedy(self, model, voice: str = "tara", text: str = TEXT) -> list[int]:
        prompt = orpheus_prompt(self.tok, voice, text)
        stop = ids(self.tok, "<custom_token_2>", "<|im_end|>")
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=120, do_sample=False,
                                 eos_token_id=stop, pad_token_id=stop[0])
        return out[0, len(prompt):].tolist()

    def expected_pcm(self, model, **kw) -> bytes:
        return reference_pcm(self.snac, self.greedy(model, **kw), self.code_base)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    pytest.importorskip("mstar_actors.launcher")
    root = tmp_path_factory.mktemp("orpheus")
    tok = orpheus_tokenizer(root / "tokenizer")
    model = save_tiny_orpheus(root / "model", tok)
    snac = save_tiny_snac(root / "snac")
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
    peft_model = get_peft_model(save_tiny_orpheus(root / "model-copy", tok), lora).eval()
    peft_model.save_pretrained(str(root / "voice-lora"))
    sections = {"speech": {"snac_path": str(root / "snac"), "codec_device": "cpu", "codec_threads": 1},
                "lora": {"adapters": {"tiny-voice": str(root / "voice-lora")}, "max_lora_rank": 8}}
    with serve_tiny(root / "model", sections=sections) as (base_url, _):
        yield Served(base_url, tok, model, peft_model, snac)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=60)


def test_wav_is_snac_decode_of_greedy_codes(client, served):
    wav = client.audio.speech.create(model="tiny", voice="tara", input=TEXT, response_format="wav",
                                     extra_body=GREEDY).content
    expected = served.expected_pcm(served.model)
    assert len(expected) == 9 * 2048 * 2  # every frame of the steered model's output is audio
    assert wav[:4] == b"RIFF" and wav[8:16] == b"WAVEfmt " and len(wav) == WAV_HEADER_BYTES + len(expected)
    assert wav[WAV_HEADER_BYTES:] == expected


def test_streamed_audio_and_sse_carry_the_same_bytes(client, served):
    whole = client.audio.speech.create(model="tiny", voice="tara", input=TEXT, response_format="pcm",
                                       extra_body=GREEDY).content
    with client.audio.speech.with_streaming_response.create(model="tiny", voice="tara", input=TEXT,
                                                            response_format="pcm", extra_body=GREEDY) as r:
        assert r.headers["content-type"] == "audio/pcm"
        chunks = list(r.iter_bytes(chunk_size=None))
    assert b"".join(chunks) == whole == served.expected_pcm(served.model)
    with client.audio.speech.with_streaming_response.create(model="tiny", voice="tara", input=TEXT,
                                                            response_format="pcm", stream_format="sse",
                                                            extra_body=GREEDY) as r:
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 6  # one per frame from the fourth on, then the tail: audio leaves as frames come
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == whole
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    assert done["usage"]["output_tokens"] == len(served.greedy(served.model))
    assert done["usage"]["input_tokens"] == len(orpheus_prompt(served.tok, "tara", TEXT))


def test_adapter_voice_matches_peft_and_differs_from_base(client, served):
    base = client.audio.speech.create(model="tiny", voice="leo", input=TEXT, response_format="pcm",
                                      extra_body=GREEDY).content
    assert base and base == served.expected_pcm(served.model, voice="leo")
    expected = served.expected_pcm(served.peft_model, voice="leo")
    if not expected:  # the random adapter's greedy path holds no whole frame, in peft as here: said, not a silent file
        with pytest.raises(openai.InternalServerError, match="no whole codec frame"):
            client.audio.speech.create(model="tiny-voice", voice="leo", input=TEXT, response_format="pcm",
                                       extra_body=GREEDY)
        return
    voiced = client.audio.speech.create(model="tiny-voice", voice="leo", input=TEXT, response_format="pcm",
                                        extra_body=GREEDY).content
    assert voiced == expected and voiced != base


@pytest.mark.parametrize("body, param, says", [
    ({"voice": "nobody"}, "voice", "accepted voices: tara, leah, jess, leo, dan, mia, zac, zoe"),
    ({"voice": None}, "voice", "accepted voices"),
    ({"response_format": "mp3"}, "response_format", "accepted: wav, pcm"),
    ({"stream_format": "chunks"}, "stream_format", "accepted: audio, sse"),
    ({"speed": 1.5}, "speed", "not supported"),
    ({"instructions": "Speak slowly."}, "instructions", "not supported"),
    ({"input": ""}, "input", "non-empty"),
    ({"input": "ab " * 123}, "input", "at most 249 tokens"),  # past the context with the voice's framing
    ({"input": "ab " * 121}, "input", "less than one frame"),  # room for no audio
    ({"input": "ab " * 122}, "input", "at most 249 tokens"),  # room for none at all: the same advice
    ({"pitch": 2}, "pitch", "unknown field"),
    ({"temperature": 3}, "temperature", "[0.0, 2.0]"),
])
def test_refused_fields_are_400s_naming_them(client, body, param, says):
    request = {"model": "tiny", "voice": "tara", "input": TEXT} | body
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/audio/speech", body=request, cast_to=object)
    assert info.value.body["param"] == param and says in info.value.body["message"], info.value.body


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.audio.speech.create(model="nope", voice="tara", input=TEXT)
