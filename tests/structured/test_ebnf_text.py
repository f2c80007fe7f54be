"""The engine's EBNF as text: classes with characters taken out, literals, rules renamed (pure)."""

import pytest

from mstar_actors.runner import ebnf_text as et

LT = [(ord("<"), ord("<"))]


@pytest.mark.parametrize("text,expected", [
    ("[0-[\\]-}]", "[0-;=-\\[\\]-}]"),  # a range through "<" split around it
    ("[^\\0-\\x1f\\\"\\\\]", "[^\\x00-\\x1f\\\"<\\\\]"),  # a negated class: "<" added
    ("[\\0-\\U0010ffff]", "[\\x00-;=-\\U0010ffff]"),
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
    assert et.map_literals(text, str.upper) == 'root ::= "A\\x0a" "\\"" [x] "\\xc9"'


def test_rules_are_renamed_where_defined_and_used_and_calls_replaced():
    text = 'root ::= root_1 "root"\nroot_1 ::= Regex("a(,)b", json_string=true) other'
    renamed = et.renamed(text, "p_")
    assert renamed == 'p_root ::= p_root_1 "root"\np_root_1 ::= Regex("a(,)b", json_string=true) other'
    calls = []
    replaced = et.map_calls(text, "Regex", lambda args: calls.append(args) or "r")
    assert replaced == 'root ::= root_1 "root"\nroot_1 ::= r other'
    assert calls == [['"a(,)b"', "json_string=true"]]
