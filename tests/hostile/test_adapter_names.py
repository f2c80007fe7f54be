"""Adapter names: one rule for runtime loads, unloads and configured adapters."""

import pytest

from mstar_actors.lora.names import MAX_NAME_CHARS, name_problem
from tests.hostile.conftest import run

BAD = ["a/../b\nc", "\x00", "../../etc/passwd", "evil\u202etxt", "x" * 100_000, "", "a//b", "/a", "a/", "..", ".", "a/./b",
       "a b", "naïve", "tiny", "x" * (MAX_NAME_CHARS + 1)]
GOOD = ["org/name", "my-lora_v1.2", "a", "x" * MAX_NAME_CHARS, "a/b/c", "v.1", "org/name.v2"]


@pytest.mark.parametrize("name", BAD)
def test_bad_names_are_refused_naming_the_rule(name):
    problem = name_problem(name, "tiny")
    assert problem and "A-Z a-z 0-9" in problem and "\n" not in problem and len(problem) < 400


@pytest.mark.parametrize("name", GOOD)
def test_hub_style_names_are_accepted(name):
    assert name_problem(name, "tiny") is None


def test_runtime_routes_refuse_bad_names(hostile, tmp_path):
    async def go():
        async with hostile() as h:
            for name in ["a/../b\nc", "\x00", "../../etc/passwd", "evil\u202etxt", "x" * 100_000, "tiny"]:
                for route, body in [("/v1/load_lora_adapter", {"lora_name": name, "lora_path": f"{tmp_path}/ok"}),
                                    ("/v1/unload_lora_adapter", {"lora_name": name})]:
                    status, out = await h.post(route, body)
                    assert status == 400, (route, name[:20], status, out)
                    assert out["error"]["param"] == "lora_name" and "A-Z a-z 0-9" in out["error"]["message"], out
            (tmp_path / "ok").mkdir()
            body = {"lora_name": "org/name", "lora_path": f"{tmp_path}/ok"}
            status, out = await h.post("/v1/load_lora_adapter", body)
            assert status == 200, out
    run(go)


def test_a_bad_configured_name_stops_the_server_with_one_line(model_dir, tokenizer, capsys):
    from mstar_actors import launcher
    from mstar_actors.config import parse_config
    from tests.frontend.conftest import tiny_info

    config = parse_config({"model": {"path": str(model_dir), "name": "tiny"},
                           "lora": {"adapters": {"../../etc/passwd": str(model_dir)}}})
    assert launcher.serve(config, tiny_info(model_dir, tokenizer)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'../../etc/passwd'" in err and "lora.adapters" in err, err
