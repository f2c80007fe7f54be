"""Tokenization on a tiny trained tokenizer; incremental detokenizer; stop strings."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mstar_actors.messages import ChatMessage, ContentPart
from mstar_actors.tokenization import IncrementalDetokenizer, StopStrings, Tokenization

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world, the cat sat on the mat. It's a sunny day!",
    "你好世界，今天天气很好。 こんにちは世界",
    "emoji 🎉🚀 are fun 😀 and café naïve",
]
MIXED_TEXT = "Hello 🎉 world, 你好世界! café 😀🚀 the cat こんにちは"


def train_tokenizer(model, pre_tokenizer, decoder, trainer) -> Tokenizer:
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def save_model_dir(path, tok: Tokenizer, chat_template=CHATML):
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if chat_template:
        hf.chat_template = chat_template
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def byte_level_dir(tmp_path_factory):
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok = train_tokenizer(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), trainer)
    return save_model_dir(tmp_path_factory.mktemp("bytelevel"), tok)


@pytest.fixture(scope="module")
def tokenization(byte_level_dir):
    return Tokenization(byte_level_dir)


@pytest.fixture(scope="module")
def metaspace_tokenization(tmp_path_factory):
    """SentencePiece-style: words carry a leading '▁' that decodes to a space."""
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS)
    tok = train_tokenizer(models.BPE(unk_token="<|endoftext|>"), pre_tokenizers.Metaspace(), decoders.Metaspace(), trainer)
    return Tokenization(save_model_dir(tmp_path_factory.mktemp("metaspace"), tok))


def stream(detok: IncrementalDetokenizer, token_ids, chunk_size=1) -> list[str]:
    deltas = [detok.add(token_ids[i : i + chunk_size]) for i in range(0, len(token_ids), chunk_size)]
    return deltas + [detok.flush()]


# --------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------


def test_encode_and_decode(tokenization):
    hf = tokenization.tokenizer
    assert tokenization.encode_prompt(MIXED_TEXT) == hf(MIXED_TEXT).input_ids
    assert tokenization.decode(tokenization.encode_prompt(MIXED_TEXT)) == MIXED_TEXT


def test_special_tokens_are_the_tokenizers_own(tokenization, tmp_path):
    """``with_special_tokens``: what the tokenizer's post-processor puts around a text (none for this
    ChatML one, whose ``bos_token`` is no rule of its encoding), never a BOS of our own."""
    from tokenizers import processors

    ids = tokenization.encode_text("Hello world", add_special_tokens=False)
    assert tokenization.with_special_tokens(ids) == ids == tokenization.encode_text("Hello world", True)
    tok = Tokenizer.from_str(tokenization.tokenizer.backend_tokenizer.to_str())
    named = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok.to_str()), bos_token="<|im_start|>")
    named.save_pretrained(tmp_path / "named")  # a bos_token (SmolLM2's) that its encoding never adds
    assert Tokenization(tmp_path / "named").with_special_tokens(ids) == ids
    bos, eos = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A <|endoftext|>",
                                                       special_tokens=[("<|im_start|>", bos), ("<|endoftext|>", eos)])
    framed = Tokenization(save_model_dir(tmp_path / "framed", tok))
    assert framed.encode_text("Hello world", True) == [bos, *ids, eos]
    assert framed.with_special_tokens(ids) == [bos, *ids, eos]
    assert framed.with_special_tokens([bos, *ids]) == [bos, *ids, eos]  # a template's own BOS is not doubled
    # a request's add_special_tokens (vLLM's): a text prompt's by default, a chat template's where asked
    from mstar_actors.frontend import openai_api as api
    from mstar_actors.prepare.preparers import prompt_token_ids

    def served(body: dict) -> list[int]:
        parse = api.parse_chat if "messages" in body else api.parse_completion
        (req,) = parse(json.dumps({"model": "m"} | body).encode(), 256).new_requests("r", "m")
        return prompt_token_ids(framed, req, None)[0]

    assert served({"prompt": "Hello world"}) == [bos, *ids, eos]
    assert served({"prompt": "Hello world", "add_special_tokens": False}) == ids
    assert served({"prompt": ids, "add_special_tokens": True}) == ids  # token ids: as sent
    chat = [{"role": "user", "content": "Hello world"}]
    templated = framed.apply_chat_template([ChatMessage("user", "Hello world")], True)
    assert served({"messages": chat}) == templated
    assert served({"messages": chat, "add_special_tokens": True}) == framed.with_special_tokens(templated) != templated


def test_token_bytes_rebuild_characters_split_across_tokens(tokenization):
    """Chat logprobs' ``bytes``: a token's own bytes, so an emoji split over
    tokens whose texts each read U+FFFD joins back together."""
    ids = tokenization.encode_text(MIXED_TEXT, add_special_tokens=False)
    assert any(tokenization.decode([i]) == "\ufffd" for i in ids)  # the case: pieces of a character
    assert b"".join(tokenization.token_bytes(i) for i in ids).decode() == MIXED_TEXT


def test_chat_template_multi_turn_matches_transformers(tokenization):
    chat = [
        ChatMessage("system", "You are terse."),
        ChatMessage("user", "Hello 🎉"),
        ChatMessage("assistant", "Hi."),
        ChatMessage("user", [ContentPart("text", text="the cat"), ContentPart("text", text="sat")]),
    ]
    as_dicts = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello 🎉"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "the cat\nsat"},
    ]
    hf = tokenization.tokenizer
    for add_generation_prompt in (True, False):
        expected = hf.apply_chat_template(
            as_dicts, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
        )
        assert tokenization.apply_chat_template(chat, add_generation_prompt) == list(expected)
    text = tokenization.decode(tokenization.apply_chat_template(chat), skip_special_tokens=False)
    assert text.count("<|im_start|>") == 5 and text.endswith("<|im_start|>assistant\n")


PARTS_TEMPLATE = (  # Gemma's way: a list's text parts written one after another
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}{{ item['text'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
)


@pytest.mark.parametrize("template,expected_format", [
    (PARTS_TEMPLATE, "openai"),
    ("{% set first = messages[0]['content'] %}{% for p in first %}{{ p.text }}{% endfor %}", "openai"),
    ("{% for m in messages[1:] %}{% set c = m.content %}{% for p in c | list %}{{ p.text }}{% endfor %}{% endfor %}",
     "openai"),
    ("{% for m in messages %}{% for call in m['tool_calls'] %}{{ call.name }}{% endfor %}{{ m.content }}{% endfor %}",
     "string"),
    ("{{ (", "string"),  # not a template: rendering says why
    # transformers' tag around an assistant's turn (the environment it renders templates in reads it)
    (PARTS_TEMPLATE.replace("{% for message in messages %}", "{% for message in messages %}{% generation %}")
     .replace("<|im_end|>\n{% endfor %}", "<|im_end|>\n{% endgeneration %}{% endfor %}"), "openai"),
])
def test_a_template_that_loops_over_its_parts_gets_them_as_a_list(tmp_path, byte_level_dir, template,
                                                                   expected_format):
    """vLLM's content format: a template that loops over a message's parts gets the list (transformers' own
    rendering; joined by newlines, its text differed); one that prints the content gets the parts joined."""
    from mstar_actors.tokenization import content_format

    assert content_format(template) == expected_format
    if template is not PARTS_TEMPLATE:
        return
    tok = Tokenizer.from_file(str(byte_level_dir / "tokenizer.json"))
    tokenization = Tokenization(save_model_dir(tmp_path / "parts", tok, chat_template=PARTS_TEMPLATE))
    chat = [ChatMessage("user", [ContentPart("text", text="Hello"), ContentPart("text", text="world")])]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    expected = tokenization.tokenizer.apply_chat_template(parts, tokenize=True, add_generation_prompt=False,
                                                          return_dict=False)
    ids = tokenization.apply_chat_template(chat, add_generation_prompt=False)
    assert ids == list(expected) and "Helloworld" in tokenization.decode(ids, skip_special_tokens=False)


LOOPING_TEMPLATE = (  # SmolVLM's way: the parts looped over, no branch for a string
    "{% for message in messages %}<|im_start|>{{ message['role'] }}: "
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}{% endif %}{% endfor %}"
    "{% if message.reasoning is defined %}[{{ message.reasoning }}]{% endif %}<|im_end|>\n{% endfor %}"
)


def test_a_string_is_one_text_part_to_a_looping_template_and_a_tool_s_text_one_string(tmp_path, byte_level_dir):
    """As vLLM gives them: a string looped over wrote nothing (the question was dropped with a 200); a tool
    message's text parts are one string, joined by newlines; an assistant's reasoning is ``reasoning`` too."""
    from mstar_actors.messages import ChatMessage, ContentPart

    tok = Tokenizer.from_file(str(byte_level_dir / "tokenizer.json"))
    tokenization = Tokenization(save_model_dir(tmp_path / "looping", tok, chat_template=LOOPING_TEMPLATE))
    assert tokenization.content_format == "openai"
    chat = [ChatMessage("user", "What is the capital?"),
            ChatMessage("assistant", "Paris", reasoning_content="easy"),
            ChatMessage("tool", [ContentPart("text", text="a"), ContentPart("text", text="b")], tool_call_id="c1")]
    text = tokenization.decode(tokenization.apply_chat_template(chat, add_generation_prompt=False), False)
    assert "user: What is the capital?<|im_end|>" in text and "assistant: Paris[easy]<|im_end|>" in text
    as_vllm = [{"role": "user", "content": [{"type": "text", "text": "What is the capital?"}]},
               {"role": "assistant", "content": [{"type": "text", "text": "Paris"}], "reasoning": "easy",
                "reasoning_content": "easy"},
               {"role": "tool", "content": "a\nb", "tool_call_id": "c1"}]
    expected = tokenization.tokenizer.apply_chat_template(as_vllm, tokenize=True, add_generation_prompt=False,
                                                          return_dict=False)
    assert tokenization.apply_chat_template(chat, add_generation_prompt=False) == list(expected)


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them(tmp_path, byte_level_dir):
    """vLLM's ``chat_template_kwargs`` (Qwen3's ``enable_thinking``): the
    same ids as transformers' apply_chat_template with those kwargs, on the
    frontend's path and prepare's."""
    from mstar_actors.messages import NewRequest, SamplingParams
    from mstar_actors.prepare.preparers import Preparer

    tok = Tokenizer.from_file(str(byte_level_dir / "tokenizer.json"))
    tokenization = Tokenization(save_model_dir(tmp_path / "thinking", tok, chat_template=THINKING_TEMPLATE))
    chat = [ChatMessage("user", "the cat")]
    hf = tokenization.tokenizer
    plain = tokenization.apply_chat_template(chat)
    off = tokenization.apply_chat_template(chat, template_kwargs={"enable_thinking": False})
    expected = hf.apply_chat_template([{"role": "user", "content": "the cat"}], add_generation_prompt=True,
                                      enable_thinking=False, tokenize=True, return_dict=False)
    assert off == list(expected) and off != plain and "</think>" in tokenization.decode(off, False)
    req = NewRequest(request_id="r", model="m", sampling=SamplingParams(), messages=chat,
                     chat_template_kwargs={"enable_thinking": False})
    assert list(Preparer(tokenization, 256).prepare(req).prompt_token_ids) == off
    adding = Tokenization(save_model_dir(tmp_path / "adding", tok, chat_template="{{ messages[0]['content'] + offset }}"))
    with pytest.raises(ValueError, match="could not render .*TypeError"):  # a value the template can't use: a 400
        adding.apply_chat_template(chat, template_kwargs={"offset": 1})
    dividing = Tokenization(save_model_dir(tmp_path / "dividing", tok, chat_template="{{ 1 // by }}"))
    with pytest.raises(ValueError, match="could not render .*ZeroDivisionError"):
        dividing.apply_chat_template(chat, template_kwargs={"by": 0})


def test_non_text_content_part_is_refused_by_name(tokenization):
    chat = [ChatMessage("user", "hi"), ChatMessage("user", [ContentPart("image_url", url="http://x/a.png")])]
    with pytest.raises(ValueError, match=r"messages\[1\]\.content\[0\].*'image_url'"):
        tokenization.apply_chat_template(chat)


def test_model_without_chat_template_says_to_use_completions(tmp_path, byte_level_dir):
    tok = Tokenizer.from_file(str(byte_level_dir / "tokenizer.json"))
    plain = Tokenization(save_model_dir(tmp_path, tok, chat_template=None))
    with pytest.raises(ValueError, match="/v1/completions"):
        plain.apply_chat_template([ChatMessage("user", "hi")])


def test_the_processors_chat_template_renders_every_prompt_of_the_model(tmp_path, byte_level_dir):
    """A folder's chat_template.json (a multimodal processor's: Qwen2-Audio's writes the audio placeholders, its
    tokenizer's does not) renders text chats as it renders media ones (the generation prompt too);
    media parts reach it as Qwen's templates read them."""
    import json

    tok = Tokenizer.from_file(str(byte_level_dir / "tokenizer.json"))
    folder = save_model_dir(tmp_path, tok)  # the tokenizer's own: ChatML
    processor = "{% for m in messages %}[{{ m.role }}]{% if m.content is string %}{{ m.content }}{% else %}" \
                "{% for p in m.content %}{{ p.text if p.type == 'text' else '<' ~ p.type ~ '>' }}{% endfor %}" \
                "{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": processor}))
    tokenization = Tokenization(folder)
    text = tokenization.decode(tokenization.apply_chat_template([ChatMessage("user", "hi")]))
    assert text == "[user]hi[assistant]"
    parts = [ContentPart("text", text="hear "), ContentPart("audio_url", url="data:audio/wav;base64,AA")]
    ids = tokenization.apply_chat_template([ChatMessage("user", parts)], media_parts=True)
    assert tokenization.decode(ids) == "[user]hear <audio>[assistant]"
    assert tokenization.generation_prompt() == "[assistant]"


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        Tokenization(tmp_path)


# --------------------------------------------------------------------------
# Incremental detokenizer
# --------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7])
def test_detokenizer_matches_full_decode_and_never_splits_characters(tokenization, chunk_size):
    output_ids = tokenization.encode_prompt(MIXED_TEXT)
    # Multi-byte characters really are split across tokens here.
    assert any("\ufffd" in tokenization.decode([t]) for t in output_ids)
    prompt_ids = tokenization.encode_prompt("the cat 你")
    deltas = stream(tokenization.make_detokenizer(prompt_ids), output_ids, chunk_size)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenization.decode(output_ids) == MIXED_TEXT
    assert deltas[-1] == ""  # nothing left to flush


def test_detokenizer_special_tokens_skipped_or_kept(tokenization):
    hf = tokenization.tokenizer
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    output_ids = tokenization.encode_prompt("Hello 🎉") + [im_end] + tokenization.encode_prompt(" 你好")
    for skip in (True, False):
        detok = IncrementalDetokenizer(hf, [1], skip_special_tokens=skip)
        assert "".join(stream(detok, output_ids)) == hf.decode(output_ids, skip_special_tokens=skip)


def test_detokenizer_holds_back_an_unfinished_character_until_flush(tokenization):
    emoji_ids = tokenization.encode_prompt("🚀")
    assert len(emoji_ids) > 1
    detok = tokenization.make_detokenizer([])
    assert detok.add(emoji_ids[:-1]) == ""
    assert detok.flush() == tokenization.decode(emoji_ids[:-1])  # replacement chars, like a full decode
    detok = tokenization.make_detokenizer([])
    assert detok.add(emoji_ids[:-1]) == "" and detok.add(emoji_ids[-1:]) == "🚀"


def test_detokenizer_sentencepiece_leading_spaces(metaspace_tokenization):
    tok = metaspace_tokenization
    text = "the cat sat on the mat"
    output_ids = tok.encode_prompt(text)
    assert "".join(stream(tok.make_detokenizer([]), output_ids)) == tok.decode(output_ids)
    # Continuing a prompt, the first word keeps its space.
    deltas = stream(tok.make_detokenizer(tok.encode_prompt("Hello world,")), output_ids)
    assert "".join(deltas) == " " + text
    assert deltas[1].startswith(" ")


def reference_deltas(tok, prompt_ids, chunks, skip):
    """The detokenizer's algorithm with two full ``hf.decode`` calls per token
    and no caching: what the fast paths must reproduce delta for delta."""
    def decode(ids):
        return tok.tokenizer.decode(ids, skip_special_tokens=skip) if ids else ""

    window, out = list(prompt_ids[-5:]), []
    num_read = len(window)
    unread = bool(unfinished_bytes(tok, window))  # the prompt's last character, unfinished: out of its text
    whole = decode(window) if unread else None  # ... until the first visible text says whose it is
    for chunk in chunks:
        parts = []
        for token_id in chunk:
            window.append(token_id)
            prefix, text = decode(window[:num_read]), decode(window)
            if unread:
                prefix = prefix[:-1]
            if len(text) > len(prefix) and not text.endswith("\ufffd"):
                if whole is not None and text.startswith(whole):  # not gone on with: the prompt's U+FFFD
                    prefix, unread = whole, False
                whole = None
                if len(text) > len(prefix):
                    parts.append(text[len(prefix):])
                    del window[:num_read]
                    num_read, unread = len(window), False
        out.append("".join(parts))
    prefix = decode(window[:num_read])
    if unread and (whole is None or not decode(window).startswith(whole)):  # the output went on with it
        prefix = prefix[:-1]
    return out + [decode(window)[len(prefix):]]


def still_a_character(data: bytes) -> bool:
    """Whether ``data`` is a character's bytes, or its first ones (some
    continuation bytes would finish it)."""
    for size in range(len(data), 5):
        for extra in range(0x80, 0xC0):  # only a lead's next byte has a narrower range
            try:
                (data + bytes([extra] + [0x80] * 3)[: size - len(data)]).decode("utf-8")
                return True
            except UnicodeDecodeError:
                pass
    return False


def unfinished_bytes(tok, token_ids) -> bytes:
    """The first bytes of a character the ids' bytes end with (b"" where
    they end at a character's end, or with invalid bytes)."""
    data = b"".join(tok.token_bytes(t) for t in token_ids)
    for back in range(1, min(3, len(data)) + 1):
        if data[-back] & 0xC0 != 0x80:  # not a continuation: a lead byte or ASCII
            tail = data[-back:]
            try:
                tail.decode("utf-8")
                return b""  # a whole character
            except UnicodeDecodeError:
                return tail if still_a_character(tail) else b""
    return b""


def ends_inside_a_character(tok, token_ids) -> bool:
    return bool(unfinished_bytes(tok, token_ids))


@pytest.fixture(scope="module")
def byte_fallback_tokenization(tmp_path_factory):
    """SentencePiece-style byte fallback: a character outside the vocabulary
    is its UTF-8 bytes as ``<0xNN>`` tokens, each an unfinished one decoding
    to a U+FFFD of its own."""
    from tokenizers import normalizers

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in ["\u2581", "a", "b", "\u2581a", "x"]:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "a")], byte_fallback=True, unk_token=None))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(SPECIALS)
    return Tokenization(save_model_dir(tmp_path_factory.mktemp("bytefallback"), tok))


def test_a_prompt_of_ids_cut_inside_a_character_leaves_it_to_the_output(tokenization, byte_fallback_tokenization):
    """A prompt of ids may end with a character's first bytes: the output's
    first text is that whole character (as a decode of prompt and output
    together reads), the echoed prompt stops before it. An output that does
    not go on with it leaves the prompt its U+FFFD (a JSON reply stays JSON);
    with an echo (``give_back_tail`` off) the output starts with it whatever
    comes, so echo and output read as the whole decode."""
    text = "日本語のメモ 你好 😀!"
    ids = tokenization.encode_prompt(text)
    cuts = [k for k in range(1, len(ids)) if ends_inside_a_character(tokenization, ids[:k])]
    assert cuts, "the tokenizer splits no character: pick another text"
    for k in cuts:
        prompt, output = ids[:k], ids[k:]
        echoed = tokenization.prompt_text(prompt)
        assert echoed == tokenization.decode(prompt, skip_special_tokens=False)[:-1] and text.startswith(echoed)
        for chunk_size in (1, 2):
            deltas = stream(tokenization.make_detokenizer(prompt), output, chunk_size)
            assert echoed + "".join(deltas) == text, (k, deltas)
        assert tokenization.make_detokenizer(prompt).flush() == ""  # nothing went on with it: the prompt's
        assert tokenization.make_detokenizer(prompt, give_back_tail=False).flush() == "\ufffd"
        other = tokenization.encode_prompt('{"a": 1}')
        for special in ([], [tokenization.tokenizer.eos_token_id]):  # a skipped special token first: not visible
            assert "".join(stream(tokenization.make_detokenizer(prompt), special + other)) == '{"a": 1}'
            echoed_deltas = stream(tokenization.make_detokenizer(prompt, give_back_tail=False), special + other)
            assert echoed + "".join(echoed_deltas) == tokenization.decode(prompt + special + other)
            assert "".join(stream(tokenization.make_detokenizer(prompt), special + output)) == text[len(echoed):]
    fallback = byte_fallback_tokenization
    ids = fallback.tokenizer("a日x a", add_special_tokens=False).input_ids
    assert len(ids) == 6  # a, its three bytes, x, ' a'
    for k in range(1, len(ids)):
        prompt, output = ids[:k], ids[k:]
        for give_back in (True, False):
            deltas = stream(fallback.make_detokenizer(prompt, give_back_tail=give_back), output)
            assert fallback.prompt_text(prompt) + "".join(deltas) == "a日x a", (k, deltas)
        x = fallback.tokenizer("x", add_special_tokens=False).input_ids
        if fallback.prompt_text(prompt) != fallback.decode(prompt):  # cut inside 日: one U+FFFD a byte
            assert "".join(stream(fallback.make_detokenizer(prompt), x)) == "x"
            echoed_deltas = stream(fallback.make_detokenizer(prompt, give_back_tail=False), x)
            assert fallback.prompt_text(prompt) + "".join(echoed_deltas) == fallback.decode(prompt + x)
    hello = tokenization.encode_prompt("Hello \ufffd")  # a U+FFFD sent as such is whole: read
    assert tokenization.prompt_text(hello) == "Hello \ufffd" and tokenization.make_detokenizer(hello).flush() == ""


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_detokenizer_matches_the_plain_algorithm_on_random_ids(kind, tokenization, metaspace_tokenization):
    import random

    tok = tokenization if kind == "byte_level" else metaspace_tokenization
    hf = tok.tokenizer
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(30):  # random ids: split characters, specials anywhere, ids past the vocabulary
        ids = [rng.randrange(len(hf) + 3) for _ in range(rng.randrange(1, 40))]
        prompt = [rng.randrange(len(hf)) for _ in range(rng.randrange(0, 8))]
        size = rng.choice([1, 1, 2, 5])
        chunks = [ids[i:i + size] for i in range(0, len(ids), size)]
        for skip in (True, False):
            detok = tok.make_detokenizer(prompt, skip)  # the shared decoder: its cache fills across requests
            got = [detok.add(c) for c in chunks] + [detok.flush()]
            assert got == reference_deltas(tok, prompt, chunks, skip), f"seed {seed}, ids {ids}, prompt {prompt}"


def test_text_decoder_uses_the_backend_only_where_decode_is_exactly_it(tokenization, tmp_path):
    from transformers import AutoTokenizer

    from mstar_actors.tokenization import TextDecoder

    hf = tokenization.tokenizer
    ids = tokenization.encode_prompt(MIXED_TEXT) + [hf.convert_tokens_to_ids("<|im_end|>")]
    for skip in (True, False):
        fast = TextDecoder(hf, skip)
        assert fast.decode_ids.func == hf.backend_tokenizer.decode
        assert fast.decode(ids) == hf.decode(ids, skip_special_tokens=skip)
        assert fast.decode(ids[-1:]) == fast.decode(ids[-1:]) == hf.decode(ids[-1:], skip_special_tokens=skip)
    cleaning = AutoTokenizer.from_pretrained(str(tokenization.model_dir), clean_up_tokenization_spaces=True)
    assert TextDecoder(cleaning).decode_ids.func == cleaning.decode  # its cleanup runs in the wrapper

    class OwnDecode(type(hf)):
        def _decode(self, token_ids, **kw):
            return super()._decode(token_ids, **kw).upper()

    own = OwnDecode.from_pretrained(str(tokenization.model_dir))
    assert TextDecoder(own).decode(ids) == hf.decode(ids, skip_special_tokens=True).upper()
    with pytest.raises(ValueError, match="skip_special_tokens"):
        IncrementalDetokenizer(hf, [], skip_special_tokens=False, decoder=TextDecoder(hf, True))


# --------------------------------------------------------------------------
# Stop strings
# --------------------------------------------------------------------------


def feed_all(stops: StopStrings, chunks):
    emitted, stopped = [], False
    for chunk in chunks:
        text, stopped = stops.feed(chunk)
        emitted.append(text)
        if stopped:
            break
    if not stopped:
        emitted.append(stops.flush())
    return "".join(emitted), stopped


def test_stop_string_across_chunk_boundaries():
    stops = StopStrings(["STOP"])
    assert stops.feed("hello ST") == ("hello ", False)
    assert stops.feed("O") == ("", False)
    assert stops.feed("P and more") == ("", True)
    assert stops.matched == "STOP"
    assert stops.feed("anything") == ("", True) and stops.flush() == ""


def test_false_start_is_released():
    stops = StopStrings(["STOP"])
    assert stops.feed("a ST") == ("a ", False)
    assert stops.feed("Ox") == ("STOx", False)
    assert stops.feed("S") == ("", False)
    assert stops.flush() == "S"


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 100])
def test_multiple_and_overlapping_stops(chunk_size):
    text = "one two abab abc three"
    chunks = [text[i : i + chunk_size] for i in range(0, len(text), chunk_size)]
    # "abc" overlaps a false start "ab"+"ab"; earliest match in the text wins.
    assert feed_all(StopStrings(["abc", "three"]), chunks) == ("one two abab ", True)
    assert feed_all(StopStrings(["three", "abc"]), chunks) == ("one two abab ", True)
    assert feed_all(StopStrings(["bab", "abc"]), chunks) == ("one two a", True)
    assert feed_all(StopStrings(["nope", "zz"]), chunks) == (text, False)
    assert feed_all(StopStrings([]), chunks) == (text, False)


def test_stop_at_very_start_and_unicode():
    assert StopStrings(["你好"]).feed("你好世界") == ("", True)
    stops = StopStrings(["🎉!"])
    assert stops.feed("party 🎉") == ("party ", False)
    assert stops.feed("!") == ("", True)


def test_holds_only_what_could_still_match():
    stops = StopStrings(["abcd", "cx"])
    assert stops.feed("zzabc") == ("zz", False)  # "abc" could become "abcd", "c" could become "cx"
    assert stops.feed("x") == ("ab", True)  # "cx" matched inside the held text


def test_an_output_cut_anywhere_reads_as_the_whole_decode(tokenization):
    """Every prompt cut and output end over a text of multi-byte characters:
    the output's text is the whole decode past the prompt's, the prompt's
    unfinished character the output's where the output went on with it (one
    finished, then cut inside the next: it reached neither text before)."""
    ids = tokenization.encode_prompt("んん日本語のメモ 🚀x")
    for k in range(1, len(ids)):
        prompt = ids[:k]
        read, full = tokenization.prompt_text(prompt), tokenization.decode(prompt)
        for j in range(k + 1, len(ids) + 1):
            whole = tokenization.decode(ids[:j])
            expected = whole[len(full):] if whole.startswith(full) else whole[len(read):]
            assert "".join(stream(tokenization.make_detokenizer(prompt), ids[k:j])) == expected, (k, j)


def test_a_stop_may_begin_in_unsearched_text_and_end_after_it():
    """vLLM's min_tokens: the text of those tokens is not searched, but a stop
    that begins there and ends in later text matches (its start held back)."""
    stops = StopStrings(["lo wor", "ll"])
    assert stops.feed("Hello", search=False) == ("Hel", False)  # "lo" may begin "lo wor"; "ll" ends in it: no match
    assert stops.feed(" world") == ("", True) and stops.matched == "lo wor"
    stops = StopStrings(["ll", "xyz"])
    assert stops.feed("Hell", search=False) == ("Hel", False)
    assert stops.feed("ll") == ("", True)  # "l" + "l" ends past it: "Hel" as vLLM's
    stops = StopStrings(["abc"], include_stop=True)
    assert stops.feed("xab", search=False) == ("x", False)
    assert stops.feed("c!") == ("abc", True)
