"""The engine's EBNF as text: classes with characters taken out, literals, rules renamed (pure)."""

import functools

import pytest

from mstar_actors.runner import ebnf_text as et

LT = [(ord("<"), ord("<"))]


@pytest.mark.parametrize("text,expected", [
    ("[0-[\\]-}]", "[0-;=-\\[\\]-}]"),  # a range through "<" split around it
    ("[^\\0-\\x1f\\\"\\\\]", "[^\\u0000-\\u001f\\\"<\\\\]"),  # a negated class: "<" added
    ("[\\0-\\U0010ffff]", "[\\u0000-;=-\\U0010ffff]"),
    ("[a-z<]", "[a-z]"),
    ("[\\-a]", "[\\-a]"),  # an escaped "-" is a character, not a range
    ('"[<]" [<b]', '"[<]" [b]'),  # a literal's text is its own
])
def test_taking_a_character_out_of_every_class(text, expected):
    assert et.without_chars(text, LT) == expected


def test_a_class_left_with_nothing_is_named():
    with pytest.raises(et.ClassEmptied):
        et.without_chars('root ::= "a" [<]', LT)


def test_literals_are_read_and_rewritten_with_their_escapes():
    text = 'root ::= "a\\n" "\\"" [x] "\\xe9"'
    assert et.literals(text) == ["a\n", '"', "é"]
    assert et.map_literals(text, str.upper) == 'root ::= "A\\u000a" "\\"" [x] "\\u00c9"'


def test_rules_are_renamed_where_defined_and_used_and_calls_replaced():
    text = 'root ::= root_1 "root"\nroot_1 ::= Regex("a(,)b", json_string=true) other'
    renamed = et.renamed(text, "p_")
    assert renamed == 'p_root ::= p_root_1 "root"\np_root_1 ::= Regex("a(,)b", json_string=true) other'
    calls = []
    replaced = et.map_calls(text, "Regex", lambda args: calls.append(args) or "r")
    assert replaced == 'root ::= root_1 "root"\nroot_1 ::= r other'
    assert calls == [['"a(,)b"', "json_string=true"]]


@functools.cache
def _compiler():
    xgr = pytest.importorskip("xgrammar")
    from mstar_actors.runner.grammar import raw_tokenizer_info
    return xgr.GrammarCompiler(raw_tokenizer_info(["<eos>"] + [chr(c) for c in range(1, 256)], [0]))


def _engine_takes(text: str, value: str) -> bool:
    """Whether the engine's grammar of ``text`` takes ``value`` whole (its characters, then the end)."""
    xgr = pytest.importorskip("xgrammar")
    matcher = xgr.GrammarMatcher(_compiler().compile_grammar(xgr.Grammar.from_ebnf(text)))
    return matcher.accept_string(value) and matcher.accept_token(0)


@pytest.mark.parametrize("ranges,takes,refuses", [
    ([(ord("a"), ord("z")), (ord("^"), ord("^"))], ["abc", "a^b"], ["123", "A"]),  # "^" first would negate
    ([(ord("^"), ord("^"))], ["^^"], ["a"]),
    ([(ord("^"), ord("b"))], ["^_a", "b"], ["c", "]"]),  # a range from "^"
    ([(9, 9), (ord("a"), ord("a"))], ["\ta", "a"], ["\x9a", "b"]),  # an escape before a hex digit
    ([(0x7F, 0x7F), (ord("a"), ord("f"))], ["\x7fa"], ["g"]),
])
def test_a_class_reads_back_as_its_characters(ranges, takes, refuses):
    text = "root ::= " + et.class_text(False, ranges) + "+"
    assert all(_engine_takes(text, v) for v in takes), text
    assert not any(_engine_takes(text, v) for v in refuses), text
    negated = "root ::= " + et.class_text(True, ranges) + "+"
    assert not any(_engine_takes(negated, v) for v in takes), negated


def test_a_literal_reads_back_as_its_text():
    for text in ("\ta", "a\tb\n1"):  # (an escape before a hex digit)
        assert _engine_takes("root ::= " + et.literal(text), text)
