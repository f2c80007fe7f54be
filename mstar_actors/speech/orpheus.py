"""Orpheus's speech format: the prompt it was trained on and its codec tokens.

Pure (no torch, no I/O). Orpheus is a Llama whose vocabulary adds
``<custom_token_N>`` tokens: a few frame the turn, the rest are SNAC codes.
A prompt is ``<custom_token_3>`` (start of human), the tokenizer's ids of
``"{voice}: {text}"`` (with its BOS), then ``<|eot_id|>``,
``<custom_token_4>`` (end of human), ``<custom_token_5>`` (start of AI),
``<custom_token_1>`` (start of speech). The model answers with codec tokens
and ends with ``<custom_token_2>`` (end of speech).

Codec tokens come 7 to a frame, one per slot; slot ``s`` of a frame holds
code ``id - base - s * K`` (``base`` the id of ``<custom_token_10>``, ``K``
the codebook size) and the slots feed SNAC's three codebooks as
``[c0] [c1, c4] [c2, c3, c5, c6]``: one frame is 4 latent steps of the
codec, ``4 * hop`` samples.

Audio leaves frame by frame through a sliding window, as Orpheus's own
server decodes it: each window is 4 frames, decoded alone, and frame ``m``
is cut from the window ``[m-1, m+2]`` (its second frame), so its samples see
one frame of context before and two after. The first window also gives
frame 0 and the last one the final two frames (the reference server drops
those three), so the audio is ``4 * hop`` samples per frame, every frame
kept. A window decodes as soon as its last frame is complete: the first
audio leaves after 4 frames (28 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

FRAME_TOKENS = 7
WINDOW_FRAMES = 4
CODEBOOK_SLOTS = ((0,), (1, 4), (2, 3, 5, 6))  # SNAC codebook -> the frame's slots it takes, in time order

START_OF_HUMAN = "<custom_token_3>"
END_OF_HUMAN = "<custom_token_4>"
START_OF_AI = "<custom_token_5>"
START_OF_SPEECH = "<custom_token_1>"
END_OF_SPEECH = "<custom_token_2>"
END_OF_TEXT = "<|eot_id|>"
FIRST_CODE = 10  # <custom_token_10> is code 0 of slot 0


def custom_token(n: int) -> str:
    return f"<custom_token_{n}>"


class OrpheusFormatError(ValueError):
    """The tokenizer lacks a token of Orpheus's format; the message names it."""


@dataclass(frozen=True)
class OrpheusTokens:
    """The ids of Orpheus's format in one tokenizer."""

    start_of_human: int
    end_of_text: int
    end_of_human: int
    start_of_ai: int
    start_of_speech: int
    end_of_speech: int
    code_base: int  # id of code 0 of slot 0; slot s, code c is code_base + s * codebook_size + c
    codebook_size: int

    @classmethod
    def from_vocab(cls, vocab: dict[str, int], codebook_size: int) -> OrpheusTokens:
        """Look every token up by name; the codes must be consecutive ids."""
        def find(name: str) -> int:
            if name not in vocab:
                raise OrpheusFormatError(f"the tokenizer has no {name} token: not an Orpheus model "
                                         "(its tokenizer adds <custom_token_0> ... to Llama 3's)")
            return vocab[name]

        base = find(custom_token(FIRST_CODE))
        num_codes = FRAME_TOKENS * codebook_size
        for i in range(num_codes):
            if vocab.get(custom_token(FIRST_CODE + i)) != base + i:
                raise OrpheusFormatError(
                    f"{custom_token(FIRST_CODE + i)} is not id {base + i}: Orpheus's {num_codes} codec tokens "
                    f"(7 slots of the codec's {codebook_size} codes) must be consecutive ids from "
                    f"{custom_token(FIRST_CODE)}")
        return cls(start_of_human=find(START_OF_HUMAN), end_of_text=find(END_OF_TEXT),
                   end_of_human=find(END_OF_HUMAN), start_of_ai=find(START_OF_AI),
                   start_of_speech=find(START_OF_SPEECH), end_of_speech=find(END_OF_SPEECH),
                   code_base=base, codebook_size=codebook_size)

    @property
    def code_end(self) -> int:
        """One past the last codec token id."""
        return self.code_base + FRAME_TOKENS * self.codebook_size

    def prompt_ids(self, text_ids: list[int]) -> list[int]:
        """The prompt around the tokenizer's ids of ``"{voice}: {text}"`` (BOS included)."""
        return [self.start_of_human, *text_ids, self.end_of_text, self.end_of_human, self.start_of_ai,
                self.start_of_speech]


def speech_text(voice: str, text: str) -> str:
    return f"{voice}: {text}"


class FrameReader:
    """Generated token ids -> complete frames of 7 codes, in order.

    Tokens outside the codec range (framing tokens) are skipped; each codec
    token takes the next slot. A frame with a code outside its slot's range
    (the model lost the frame's alignment) is dropped whole, as the reference
    server drops the windows that hold one.
    """

    def __init__(self, tokens: OrpheusTokens):
        self.tokens = tokens
        self._slots: list[int] = []
        self.num_dropped_frames = 0

    def feed(self, token_ids: list[int]) -> list[tuple[int, ...]]:
        t = self.tokens
        frames = []
        for token_id in token_ids:
            if not t.code_base <= token_id < t.code_end:
                continue
            self._slots.append(token_id - t.code_base - len(self._slots) * t.codebook_size)
            if len(self._slots) == FRAME_TOKENS:
                if all(0 <= c < t.codebook_size for c in self._slots):
                    frames.append(tuple(self._slots))
                else:
                    self.num_dropped_frames += 1
                self._slots = []
        return frames


def codebook_rows(frames: list[tuple[int, ...]]) -> list[list[int]]:
    """SNAC's three code rows for consecutive frames (see the module docstring)."""
    return [[frame[s] for frame in frames for s in slots] for slots in CODEBOOK_SLOTS]


@dataclass(frozen=True)
class Window:
    """Decode frames ``[first, first + num_frames)`` and send the frames at
    positions ``[emit_from, emit_to)`` of the window."""

    first: int
    num_frames: int
    emit_from: int
    emit_to: int


class WindowPlan:
    """Which windows to decode as frames arrive, and which of their frames to send.

    ``add(num_frames)`` after new frames: the windows they complete (one per
    frame from the fourth on). ``finish()``: what is left, the last window's
    held-back frames, or one window of every frame when there are fewer than
    four. The frames a plan sends are every frame once, in order.
    """

    def __init__(self) -> None:
        self.num_frames = 0

    def add(self, num_new: int) -> list[Window]:
        windows = []
        for _ in range(num_new):
            self.num_frames += 1
            n = self.num_frames
            if n >= WINDOW_FRAMES:
                windows.append(Window(n - WINDOW_FRAMES, WINDOW_FRAMES, 0 if n == WINDOW_FRAMES else 1, 2))
        return windows

    def finish(self) -> Window | None:
        """The last window (held-back frames; decoded again only when short), or None."""
        n = self.num_frames
        if n == 0:
            return None
        if n < WINDOW_FRAMES:
            return Window(0, n, 0, n)
        return Window(n - WINDOW_FRAMES, WINDOW_FRAMES, 2, WINDOW_FRAMES)
