"""Qwen2-Audio against transformers on a tiny random model: the audio encoder
on clips of several lengths (the kept frames alone against the reference's
padded, masked chunk), the processor's token count, and greedy tokens
through the runner with audio, text and two-clip prompts served together
(chunked prefill splitting an audio run, a preemption that recomputes the
audio rows)."""

from __future__ import annotations

import functools

import pytest
import torch

from mstar_actors import messages
from mstar_actors.models.loader import load_model
from mstar_actors.models.qwen2_audio import audio_frames_kept, audio_num_tokens
from mstar_actors.runner.model_runner import PlanError
from plan_driver import PlanDriver
from runner_factories import make_runner

from .audio_factories import (
    AUDIO_BOS,
    AUDIO_EOS,
    AUDIO_TOKEN,
    MAX_FRAMES,
    audio_item,
    make_frames,
    make_hf_audio_model,
    padded_features,
)
from .vl_factories import FakeArena

BLOCK_SIZE = 4
NUM_NEW = 16
GREEDY = messages.SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_audio")
    return folder, make_hf_audio_model(folder)


# -- the audio encoder -------------------------------------------------------------------


def hf_audio_rows(hf, frames: list[torch.Tensor], num_frames: list[int]) -> torch.Tensor:
    """The reference's projected audio rows for a batch of clips, as its forward computes them."""
    from transformers.masking_utils import create_bidirectional_mask

    pairs = [padded_features(f, n) for f, n in zip(frames, num_frames)]
    features, mask = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    tower = hf.model.audio_tower
    conv_lengths, out_lengths = tower._get_feat_extract_output_lengths(mask.sum(-1))
    valid = (torch.arange(MAX_FRAMES // 2)[None] < conv_lengths[:, None]).long()
    attention = create_bidirectional_mask(config=tower.config, inputs_embeds=torch.zeros(len(frames), MAX_FRAMES // 2, 1),
                                          attention_mask=valid)
    with torch.no_grad():
        rows = hf.model.multi_modal_projector(tower(features, attention_mask=attention).last_hidden_state)
    return torch.cat([r[:n] for r, n in zip(rows, out_lengths.tolist())])


@pytest.mark.parametrize("num_frames", [[3], [57], [MAX_FRAMES - 1], [MAX_FRAMES], [8, 150, MAX_FRAMES]],
                         ids=["shortest", "short", "full-1", "full", "three"])
def test_audio_encoder_matches_transformers(audio, num_frames):
    folder, hf = audio
    model = load_model(folder, torch.float32, "cpu")
    frames = [make_frames(n, seed=i) for i, n in enumerate(num_frames)]
    expected = hf_audio_rows(hf, frames, num_frames)
    with torch.inference_mode():
        ours = model.encode_media(frames, [(1, n, 1) for n in num_frames])
    assert ours.shape == (sum(audio_num_tokens(n) for n in num_frames), 64)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


def test_token_count_and_kept_frames_follow_the_reference_lengths(audio):
    _, hf = audio
    lengths = torch.arange(1, MAX_FRAMES + 1)
    conv, out = hf.model.audio_tower._get_feat_extract_output_lengths(lengths)
    assert [audio_num_tokens(n) for n in lengths.tolist()] == out.tolist()
    # The kept frames reach every frame a valid conv2 position reads, and no further than the chunk.
    assert [audio_frames_kept(n, MAX_FRAMES) for n in lengths.tolist()] == torch.clamp(2 * conv + 1, max=MAX_FRAMES).tolist()


# -- the runner against generate -----------------------------------------------------------


def audio_prompt(parts, arena: FakeArena, seed: int = 0) -> tuple[list[int], list[messages.MediaItem], list[torch.Tensor]]:
    """A prompt from ("text", n) / ("audio", num_frames) parts, the MediaItems
    the prepare side would send, and each clip's kept frames."""
    gen = torch.Generator().manual_seed(seed)
    prompt, media, frames = [], [], []
    for i, (kind, arg) in enumerate(parts):
        if kind == "text":
            prompt += torch.randint(3, AUDIO_TOKEN, (arg,), generator=gen).tolist()
            continue
        clip = make_frames(arg, seed=seed * 100 + i)
        frames.append(clip)
        prompt.append(AUDIO_BOS)
        item = audio_item(arena.store(f"{seed}-{i}", clip), arg, len(prompt))
        media.append(item)
        prompt += [AUDIO_TOKEN] * item.num_tokens + [AUDIO_EOS]
    return prompt, media, frames


def hf_audio_kwargs(media, frames) -> dict:
    """What transformers' processor would return next to input_ids."""
    if not media:
        return {}
    pairs = [padded_features(f, m.grid_thw[1]) for f, m in zip(frames, media)]
    return {"input_features": torch.cat([p[0] for p in pairs]), "feature_attention_mask": torch.cat([p[1] for p in pairs])}


def reference(hf, prompt, media, frames) -> list[int]:
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW, do_sample=False,
                          **hf_audio_kwargs(media, frames))
    return out[0, len(prompt):].tolist()


Driver = functools.partial(PlanDriver, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=GREEDY)


class CountingEncoder:
    """Wraps ``encode_media`` to count how many clips the encoder encoded."""

    def __init__(self, model):
        self.calls: list[int] = []
        self.inner = model.encode_media
        model.encode_media = self

    def __call__(self, frames, grids):
        self.calls.append(len(grids))
        return self.inner(frames, grids)


def test_runner_matches_generate_for_audio_and_text_prompts(audio):
    folder, hf = audio
    arena = FakeArena()
    prompts = {
        "one": audio_prompt([("text", 5), ("audio", 60), ("text", 6)], arena, seed=1),  # 15 audio tokens
        "two": audio_prompt([("text", 2), ("audio", 33), ("text", 3), ("audio", 90), ("text", 3)], arena, seed=2),
        "txt": audio_prompt([("text", 21)], arena, seed=3),
    }
    runner = make_runner(folder, dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=128,
                         resolve_tensor=arena.resolve)
    encoder = CountingEncoder(runner.model)
    d = Driver(runner)
    starts = [d.start(rid, p, m) for rid, (p, m, _) in prompts.items()]
    # one's 15-token run starts at 6: chunks of 10 and 9 split it; two's first
    # run (8 tokens) ends in its first chunk, its second (22) is split twice.
    d.step(starts, [d.chunk("one", 10), d.chunk("two", 20), d.chunk("txt", 8)])
    d.step([], [d.chunk("one", 9), d.chunk("two", 10), d.chunk("txt")])
    d.step([], [d.chunk("one"), d.chunk("two"), *d.decodes("txt")])
    assert encoder.calls == [3]  # one's clip and both of two's, the first step that reaches them
    while len(d.seqs["two"]["outputs"]) < 5:
        d.step([], d.decodes("one", "two", "txt"))
    # Preempt two, then restart it with its outputs; its audio rows are recomputed.
    two_outputs = list(d.seqs["two"]["outputs"])
    d.step([], d.decodes("one", "txt"), finished=[d.finish("two")])
    restart = d.start("two", prompts["two"][0], prompts["two"][1], two_outputs)
    d.step([restart], [d.chunk("two", 20), *d.decodes("one", "txt")])
    d.step([], [d.chunk("two"), *d.decodes("one", "txt")])
    while chunks := d.decodes("one", "two", "txt"):
        d.step([], chunks)
    assert encoder.calls == [3, 2]
    assert runner.media.seqs["one"].rows == {}  # consumed runs keep no audio rows
    for rid, (prompt, media, frames) in prompts.items():
        assert d.seqs[rid]["outputs"] == reference(hf, prompt, media, frames), f"sequence {rid} diverged"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_tokens=14), "num_tokens=14, but 60 frames give 15"),
        (dict(grid_thw=(1, 61, 1)), r"pixel_values has shape \[61, 8\], expected \[63, 8\]"),
        (dict(grid_thw=(2, 60, 1)), r"must be \(1, num_frames, 1\)"),
        (dict(token_offset=5), r"prompt tokens \[5, 20\) must all be the audio token 300"),
        (dict(kind="image"), "kind 'image' is not supported; accepted: audio"),
    ],
)
def test_bad_audio_item_fails_only_its_request(audio, change, message):
    folder, _ = audio
    arena = FakeArena()
    prompt, media, _ = audio_prompt([("text", 5), ("audio", 60)], arena)
    bad = messages.MediaItem(**({f: getattr(media[0], f) for f in media[0].__struct_fields__} | change))
    runner = make_runner(folder, dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=32,
                         resolve_tensor=arena.resolve)
    d = Driver(runner)
    with pytest.raises(PlanError, match=message) as err:
        d.step([d.start("bad", prompt, [bad]), d.start("ok", [5, 6, 7])], [])
    assert err.value.request_ids == ["bad"] and "ok" in runner.seqs


def test_checkpoint_in_transformers5_layout_loads_the_same(audio, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = audio
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")

    def renamed(name: str) -> str:
        if name.startswith("language_model.model."):
            return "model.language_model." + name.removeprefix("language_model.model.")
        if name.startswith("language_model.lm_head"):
            return name.removeprefix("language_model.")
        return "model." + name  # audio_tower., multi_modal_projector.

    save_file({renamed(k): v for k, v in tensors.items()}, tmp_path / "model.safetensors")
    ours, original = load_model(tmp_path, torch.float32, "cpu"), load_model(folder, torch.float32, "cpu")
    for (name, a), (_, b) in zip(ours.state_dict().items(), original.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
