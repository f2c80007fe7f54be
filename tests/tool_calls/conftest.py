"""Tool-call test kit: tiny tokenizer folders with tool-format templates, and
the frontend tests' harness over the hermes one."""

from __future__ import annotations

import pytest

from tests.tool_calls.templates import (
    HERMES_TEMPLATE,
    LLAMA3_JSON_TEMPLATE,
    PLAIN_TEMPLATE,
    QWEN3_CODER_TEMPLATE,
    make_tool_model_dir,
)


@pytest.fixture(scope="session")
def hermes_dir(tmp_path_factory):
    return make_tool_model_dir(tmp_path_factory.mktemp("hermes-model"), HERMES_TEMPLATE)


@pytest.fixture(scope="session")
def llama3_dir(tmp_path_factory):
    return make_tool_model_dir(tmp_path_factory.mktemp("llama3-model"), LLAMA3_JSON_TEMPLATE)


@pytest.fixture(scope="session")
def qwen3_coder_dir(tmp_path_factory):
    return make_tool_model_dir(tmp_path_factory.mktemp("qwen3-coder-model"), QWEN3_CODER_TEMPLATE)


@pytest.fixture(scope="session")
def plain_dir(tmp_path_factory):
    return make_tool_model_dir(tmp_path_factory.mktemp("plain-model"), PLAIN_TEMPLATE)


@pytest.fixture(scope="session")
def hermes_tokenizer(hermes_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hermes_dir), local_files_only=True)


@pytest.fixture
def tool_harness(hermes_dir, hermes_tokenizer):
    """``async with tool_harness() as h:``: the real frontend serving the hermes-template model."""
    from tests.frontend.conftest import Harness

    return lambda **kw: Harness(hermes_dir, hermes_tokenizer, **kw)


@pytest.fixture(scope="session")
def chars():
    """A grammar compiler over a vocabulary of one token a printable character (and EOS): any text is spelled."""
    pytest.importorskip("xgrammar")
    from mstar_actors.runner.grammar import GrammarCompiler, raw_tokenizer_info

    return GrammarCompiler(raw_tokenizer_info(["<eos>"] + [chr(c) for c in range(10, 127)], [0]))


def accepter(compiler, spec):
    """Whether a whole reply, then EOS, is one ``spec``'s grammar takes."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiler.compile(spec))

    def accepted(text: str) -> bool:
        matcher.reset()
        return matcher.accept_string(text) and matcher.accept_token(0)

    return accepted
