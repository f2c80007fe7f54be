"""Grammar engines compared on one vocabulary: xgrammar against llguidance.

For each engine that imports (llguidance is no dependency of the server:
``pip install llguidance`` to compare), on the model's tokenizer (default:
the embedded SmolLM2, 49,152 tokens), one thread:

- compile: a small JSON schema and a phone-number regex, each distinct
  (median of 5; llguidance compiles lazily, so its first masks pay the rest);
- mask fill: one matcher walks the tokens of a valid answer, filling the
  next-token bitmask before each (median and max over 5 walks, in us);
- 32 at once: 32 matchers filled in one batched call per step (median, us).

    python tools/bench_grammar_engines.py
    python tools/bench_grammar_engines.py --model DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from _common import model_dir_of, run_tool  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
REGEX = r"\d{3}-\d{3}-\d{4}"
CASES = {"json": '{"name": "Alice Smith", "age": 42, "tags": ["red", "green", "blue", "a much longer tag here"]}',
         "regex": "555-123-4567"}
NUM_WALKS, BATCH = 5, 32


def timed_ms(fn, n: int = 5) -> float:
    times = []
    for i in range(n):
        start = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def walk(new_matcher, fill, accept, token_ids: list[int]) -> list[float]:
    """us per mask fill along ``token_ids``, NUM_WALKS times."""
    times = []
    for _ in range(NUM_WALKS):
        matcher = new_matcher()
        for t in token_ids:
            start = time.perf_counter()
            fill(matcher)
            times.append((time.perf_counter() - start) * 1e6)
            if not accept(matcher, t):
                raise SystemExit(f"the engine refused token {t} of a valid answer")
    return times


def batch_walk(matchers: list, fill_all, accept, token_ids: list[int]) -> float:
    times = []
    for t in token_ids:
        start = time.perf_counter()
        fill_all(matchers)
        times.append((time.perf_counter() - start) * 1e6)
        for m in matchers:
            accept(m, t)
    return statistics.median(times)


def xgrammar_row(tokenizer, vocab_size: int) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    schema = json.dumps(SCHEMA)
    row = {"compile json ms": timed_ms(lambda i: compiler.compile_json_schema(schema.replace("name", f"name{i}"))),
           "compile regex ms": timed_ms(lambda i: compiler.compile_regex(REGEX + "x" * i))}
    grammars = {"json": compiler.compile_json_schema(schema), "regex": compiler.compile_regex(REGEX)}
    one, many = xgr.allocate_token_bitmask(1, vocab_size), xgr.allocate_token_bitmask(BATCH, vocab_size)
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    for case, text in CASES.items():
        ids = tokenizer.encode(text, add_special_tokens=False)
        times = walk(lambda: xgr.GrammarMatcher(grammars[case]), lambda m: m.fill_next_token_bitmask(one, 0),
                     lambda m, t: m.accept_token(t), ids)
        row[f"fill {case} us"] = f"{statistics.median(times):.1f} (max {max(times):.0f})"
        row[f"fill {BATCH} {case} us"] = batch_walk([xgr.GrammarMatcher(grammars[case]) for _ in range(BATCH)],
                                                    lambda ms: batch.batch_fill_next_token_bitmask(ms, many),
                                                    lambda m, t: m.accept_token(t), ids)
    return row


def llguidance_row(tokenizer, vocab_size: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def matcher(grammar: str):
        m = llguidance.LLMatcher(info, grammar, log_level=0)
        if m.is_error():
            raise SystemExit(f"llguidance refused the grammar: {m.get_error()}")
        return m

    schema = json.dumps(SCHEMA)
    row = {"compile json ms": timed_ms(lambda i: matcher(llguidance.LLMatcher.grammar_from_json_schema(schema.replace("name", f"name{i}")))),
           "compile regex ms": timed_ms(lambda i: matcher(llguidance.grammar_from("regex", REGEX + "x" * i)))}
    grammars = {"json": llguidance.LLMatcher.grammar_from_json_schema(schema), "regex": llguidance.grammar_from("regex", REGEX)}
    one, many = llt.allocate_token_bitmask(1, vocab_size), llt.allocate_token_bitmask(BATCH, vocab_size)
    executor = llguidance.LLExecutor(num_threads=1)
    for case, text in CASES.items():
        ids = tokenizer.encode(text, add_special_tokens=False)
        times = walk(lambda: matcher(grammars[case]), lambda m: llt.fill_next_token_bitmask(m, one, 0),
                     lambda m, t: m.consume_token(t), ids)
        row[f"fill {case} us"] = f"{statistics.median(times):.1f} (max {max(times):.0f})"
        row[f"fill {BATCH} {case} us"] = batch_walk(
            [matcher(grammars[case]) for _ in range(BATCH)],
            lambda ms: llt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(ms)], many),
            lambda m, t: m.consume_token(t), ids)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face folder (default: the embedded SmolLM2)")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer


    model_dir = model_dir_of(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    print(f"model {model_dir.name}, vocabulary {vocab_size}")
    for name, row_of in (("xgrammar", xgrammar_row), ("llguidance", llguidance_row)):
        try:
            row = row_of(tokenizer, vocab_size)
        except ImportError as err:
            print(f"{name}: not installed ({err})")
            continue
        print(f"{name}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    run_tool(main)
