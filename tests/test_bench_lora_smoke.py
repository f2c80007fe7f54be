"""Smoke tests of tools/bench_lora.py's pieces, with no engine started (a live
run starts three servers: ``python tools/bench_lora.py --smoke --model DIR``).

The plan and its argument checks, the served configs through the real config
parser, PEFT adapters on a tiny random model of Llama-3.2-1B's architecture
through the launcher's own adapter checks, the load loop against a scripted
OpenAI-style stream, and the final table.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.loopback import serving

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bench = _load("bench_lora", ROOT / "tools" / "bench_lora.py")


def make_plan(*argv: str):
    return bench.make_plan(bench.parse_args(list(argv)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random model of the Llama-3.2-1B setup's architecture (tokenizer from
    the actor tests' kit) and its four rank-4 adapters."""
    kit = _load("actors_test_kit", ROOT / "tests" / "actors" / "conftest.py")
    tmp = tmp_path_factory.mktemp("bench-lora")
    tokenizer_dir = tmp / "tokenizer"
    kit.make_model_dir(tokenizer_dir)
    model_dir = bench.make_random_llama(tmp / "model", tokenizer_dir, "float32", "cpu", tiny=True)
    adapters = bench.make_adapters(model_dir, tmp / "adapters", bench.ADAPTER_NAMES, 4, "float32", "cpu")
    return model_dir, adapters


# ---- plan -------------------------------------------------------------------------


def test_plan_defaults_and_request_counts():
    plan = make_plan("--waves", "2", "--min-requests", "3")
    assert (plan.device, plan.dtype, plan.levels, plan.max_tokens) == ("cpu", "float32", (1, 8, 32), 32)
    assert [plan.num_requests(c) for c in plan.levels] == [3, 16, 64]
    text = "\n".join(plan.describe())
    assert "max_loras 2, adapters lora0, lora1, lora2" in text and "no lora section" in text


def test_plan_for_the_random_llama_defaults_to_cuda_bfloat16():
    plan = make_plan("--model", "llama-3.2-1b-random", "--dry-run")
    assert (plan.device, plan.dtype, plan.max_tokens, plan.served_name) == ("cuda", "bfloat16", 64,
                                                                             "llama-3.2-1b-random")


def test_smoke_shrinks_the_plan():
    plan = make_plan("--smoke")
    assert (plan.levels, plan.num_requests(1), plan.max_tokens) == ((1,), 2, 4)


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "1,x"], "--concurrency '1,x'"),
    (["--concurrency", "0,8"], "--concurrency must be at least 1"),
    (["--rank", "0"], "--rank must be at least 1"),
    (["--model", "no-such-setup"], "expected smollm2, llama-3.2-1b-random, or a folder"),
])
def test_bad_arguments_say_what_is_accepted(argv, message):
    with pytest.raises(SystemExit, match=message.replace("(", r"\(")):
        make_plan(*argv)


def test_cuda_without_a_device_points_at_dry_run():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(SystemExit, match="--dry-run"):
        make_plan("--model", "llama-3.2-1b-random")


def test_llama_1b_config_has_the_published_shape():
    config = bench.llama_1b_config()
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (2048, 8192, 16)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (32, 8, 49152)
    assert config.rope_parameters["rope_type"] == "llama3" and config.tie_word_embeddings
    assert 1.0e9 < bench.estimate_params(config) < 1.1e9


# ---- model, adapters, served configs ------------------------------------------------


def test_adapters_are_random_all_linear_and_pass_the_launcher_checks(tiny):
    from safetensors.torch import load_file

    from mstar_actors.config import parse_config
    from mstar_actors.launcher import validate_adapters
    from mstar_actors.model_info import load_model_info

    model_dir, adapters = tiny
    config = json.loads((model_dir / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3" and config["tie_word_embeddings"]
    tensors = load_file(adapters["lora0"] / "adapter_model.safetensors")
    targets = {k.split(".")[-3] for k in tensors if "lora_B" in k}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(t.abs().sum() > 0 for k, t in tensors.items() if "lora_B" in k)
    other = load_file(adapters["lora1"] / "adapter_model.safetensors")
    assert any(not other[k].equal(t) for k, t in tensors.items())  # each adapter its own weights
    plan = make_plan("--rank", "4")
    for key, spec in bench.SERVERS.items():
        served = parse_config(bench.server_config(plan, model_dir, spec, adapters, 8000), key)
        validate_adapters(served, load_model_info(served))
        assert len(served.lora.adapters) == spec.num_adapters
        assert served.lora.max_loras == (spec.max_loras or served.lora.max_loras)
        assert not served.kv.enable_prefix_caching


def test_adapters_are_made_once(tiny, monkeypatch):
    model_dir, adapters = tiny
    monkeypatch.setattr(bench, "save_random_adapter", lambda *a, **k: pytest.fail("adapter made again"))
    again = bench.make_adapters(model_dir, adapters["lora0"].parent, bench.ADAPTER_NAMES, 4, "float32", "cpu")
    assert again == adapters


# ---- the load loop against a scripted stream ----------------------------------------


def _fake_app(served: list[str], seen: list[str]):
    """/v1/models and a streaming /v1/chat/completions that answers max_tokens chunks."""
    from aiohttp import web

    async def models(request):
        return web.json_response({"data": [{"id": m} for m in served]})

    async def chat(request):
        body = await request.json()
        seen.append(body["model"])
        assert body["ignore_eos"] and body["stream"]
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(body["max_tokens"]):
            await response.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def test_load_round_robins_the_scenario_models_and_counts_tokens():
    scenario = next(s for s in bench.SCENARIOS if s.name == bench.NO_CHURN)
    served = ["base", *bench.ADAPTER_NAMES]
    prompts = bench.make_messages(6)

    async def go():
        seen: list[str] = []
        async with serving(_fake_app(served, seen)) as base:
            url = f"{base}/v1"
            await bench.check_models(url, served)
            with pytest.raises(SystemExit, match="expected"):
                await bench.check_models(url, ["base"])
            await bench.warm_up(url, served, prompts, (1, 2))
            num_warm = len(seen)
            result = await bench.run_load(url, "base", scenario, prompts, 3, 2)
        return num_warm, seen, result

    num_warm, seen, result = asyncio.run(go())
    assert num_warm == len(served) + 1 + 2
    assert sorted(seen[num_warm:]) == sorted(bench.ADAPTER_NAMES + bench.ADAPTER_NAMES[:2])
    assert (result.num_requests, result.num_tokens, len(result.ttft_s)) == (6, 18, 6)


def test_base_scenarios_ask_for_the_served_base_name():
    base_on = next(s for s in bench.SCENARIOS if s.name == "base, lora on")
    assert [bench.model_of(base_on, "smollm2", i) for i in range(2)] == ["smollm2", "smollm2"]


# ---- report -------------------------------------------------------------------------


def test_table_has_retention_churn_ttft_and_labelled_published_figures():
    m = bench.Measurement
    results = [m("lora off", 8, 8, 800, 10.0, [0.1] * 8), m("one adapter", 8, 8, 800, 11.0, [0.1] * 8),
               m(bench.NO_CHURN, 8, 8, 800, 12.5, [0.1] * 8), m(bench.CHURN, 8, 8, 800, 20.0, [0.2] * 7 + [0.5])]
    text = bench.format_table(make_plan(), results, ["header"])
    assert "80.0%" in text and "50.0%" in text  # 64 / 80 and 40 / 80 tokens/s
    assert "p50 200 ms vs 100 ms (2.00x), p90 500 ms vs 100 ms (5.00x)" in text
    assert "NOT measured here" in text and "68-90%" in text and "68-84%" in text
    assert "concurrency 8: no published figure to compare" in text
    results = [m(name, 32, 8, 800, secs, [0.1] * 8) for name, secs in
               (("lora off", 10.0), ("one adapter", 11.0), (bench.CHURN, 20.0))]
    text = bench.format_table(make_plan(), results, ["header"])
    assert "one adapter            c=32  ours  90.9%: vLLM 80.4% (above), SGLang 80.3% (above)" in text
    assert f"{bench.CHURN:<22} c=32  ours  50.0%: vLLM 53.0% (NOT above), SGLang 40.2% (above)" in text


def test_percentile_is_nearest_rank():
    assert [bench.percentile([4, 1, 3, 2], q) for q in (50, 90, 100)] == [2, 4, 4]


def test_rounds_add_up_per_scenario_and_level():
    m = bench.Measurement
    results: dict = {}
    for wall in (1.0, 3.0):
        bench.add_up(results, m("one adapter", 8, 8, 80, wall, [wall]))
    total = results[("one adapter", 8)]
    assert (total.num_requests, total.num_tokens, total.wall_s, total.ttft_s) == (16, 160, 4.0, [1.0, 3.0])
    assert total.tokens_per_s == 40.0
