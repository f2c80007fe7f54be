"""Reading a config file and the CLI's overrides: every mistake one line
naming the file or the flag, never a traceback."""

from __future__ import annotations

import re

import pytest

from mstar_actors.config import ConfigError, load_config


def test_a_file_that_is_not_utf8_text_or_is_a_folder_is_one_line(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00model")
    with pytest.raises(ConfigError, match=r"binary.yaml: cannot read it as a YAML file \(UnicodeDecodeError"):
        load_config(binary)
    with pytest.raises(ConfigError, match=r"cannot read it as a YAML file \(IsADirectoryError"):
        load_config(tmp_path)


@pytest.mark.parametrize("section", ["5", '"abc"', "[]"])
def test_a_malformed_section_is_refused_with_or_without_a_flag(tmp_path, section):
    """``--port`` merged into ``server: 5`` raised a TypeError; into ``server: []`` it hid the mistake."""
    path = tmp_path / "c.yaml"
    path.write_text(f"server: {section}\n")
    for overrides in ({}, {"server": {"port": 8000}}):
        with pytest.raises(ConfigError, match=r"c.yaml: Expected `object`, got .* at `\$.server`"):
            load_config(path, **overrides)


def test_a_section_of_comments_alone_takes_its_defaults_and_home_folders_expand(tmp_path):
    """``server:`` holding comments alone (YAML's null) was refused unless a flag filled it; ``~`` in the media
    and profile folders reached the actors unexpanded (every file:// URL refused, the profiles lost)."""
    import os

    path = tmp_path / "c.yaml"
    path.write_text("server:\n  # nothing yet\ndebug:\n  profile_dir: ~/prof\n")
    config = load_config(path)
    assert config.server.port == 8000 and config.debug.profile_dir == os.path.expanduser("~/prof")
    path.write_text("server:\n  allowed_media_dir: ~/media\n")
    assert load_config(path).server.allowed_media_dir == os.path.expanduser("~/media")
    path.write_text("scheduler:\n  max_num_seqs: 10000000000000\n")  # (an 80 TB table and a traceback)
    with pytest.raises(ConfigError, match=r"Expected `int` <= 65536 - at `\$.scheduler.max_num_seqs`"):
        load_config(path)


def test_an_actor_to_profile_is_one_of_the_server_s(tmp_path, capsys):
    from mstar_actors.__main__ import main

    path = tmp_path / "c.yaml"
    path.write_text("debug:\n  profile_actors: [conductr]\n")
    assert main(["serve", str(path)]) == 2
    assert "debug.profile_actors: 'conductr' is no actor of this server; its actors: frontend, prepare, conductor" \
        in capsys.readouterr().err


def test_a_flags_bad_value_is_blamed_on_the_flag(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("server: {port: 8000}\n")
    with pytest.raises(ConfigError, match=r"^--port 70000: Expected `int` <= 65535 - at `\$.server.port`"):
        load_config(path, server={"port": 70000})
    path.write_text("server: {port: 70000}\n")
    with pytest.raises(ConfigError, match=r"c.yaml: Expected `int` <= 65535"):
        load_config(path)
    assert load_config(path, server={"port": 8001}).server.port == 8001  # the flag wins


def test_a_server_url_brackets_an_ipv6_host():
    from mstar_actors.config import server_url

    assert server_url("::1", 8000) == "http://[::1]:8000"
    assert server_url("127.0.0.1", 80) == "http://127.0.0.1:80"
    assert server_url("", 8000) == "http://0.0.0.0:8000"


def test_a_yaml_syntax_error_names_the_files_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  path: x\n  name: [oops\nserver:\n  port: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (f"{path}: not valid YAML: line 4, column 7: expected ',' or ']', but got ':' "
                              "(while parsing a flow sequence from line 3, column 9)")
    path.write_text("model:\n\tpath: x\n")
    with pytest.raises(ConfigError, match="line 2, column 1: found character '\\\\t' that cannot start any token$"):
        load_config(path)


def test_a_key_written_twice_is_refused_by_its_line(tmp_path):
    """YAML lets the later copy replace the earlier unseen: a whole section dropped, its wrong value unchecked."""
    path = tmp_path / "twice.yaml"
    for text, where in (("model:\n  path: x\n  quantization: int3\nmodel:\n  dtype: float32\n",
                         "line 4, column 1: duplicate key 'model' (first at line 1)"),
                        ("model:\n  path: x\nserver:\n  port: 1\n  port: 2\n",
                         "line 5, column 3: duplicate key 'port' (first at line 4)")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(f"{path}: not valid YAML: {where}; write it once")):
            load_config(path)
    # a merge key's keys may be written again beside it (the local one rules), as YAML means it
    import yaml

    from mstar_actors.config import _UniqueKeyLoader

    text = "base: &d {host: 127.0.0.1, port: 1}\nserver:\n  <<: *d\n  port: 2\n"
    assert yaml.load(text, Loader=_UniqueKeyLoader)["server"] == {"host": "127.0.0.1", "port": 2}


def test_a_model_folder_the_server_cannot_read_is_one_line_naming_model_path(tmp_path, capsys):
    from mstar_actors.__main__ import main

    (tmp_path / "empty").mkdir()
    path = tmp_path / "c.yaml"
    path.write_text(f"model:\n  path: {tmp_path / 'empty'}\n")
    assert main(["serve", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: model.path: {tmp_path / 'empty' / 'config.json'}: missing")
    assert err.count("\n") == 1


def test_kept_responses_need_one_frontend():
    """A Response is kept in the frontend that answered it; with several, its follow-up may reach another."""
    from mstar_actors.config import parse_config

    assert parse_config({"server": {"responses_store_mib": 64}}).server.responses_store_mib == 64
    with pytest.raises(ConfigError, match=r"server.responses_store_mib with server.api_server_count 2.*"
                                          r"api_server_count: 1"):
        parse_config({"server": {"responses_store_mib": 64, "api_server_count": 2, "port": 8000}})


def test_the_start_says_what_it_serves_and_its_adapters(tmp_path, caplog):
    """One line of the model (folder, architecture, dtype, device, quantization, tp, sequences, context), one of
    the adapters with their folders and whether runtime loads are on."""
    import logging

    from mstar_actors.__main__ import _log_what_is_served
    from mstar_actors.config import parse_config
    from mstar_actors.model_info import ModelInfo

    config = parse_config({"model": {"path": str(tmp_path), "device": "cpu"}, "scheduler": {"max_num_seqs": 8},
                           "lora": {"adapters": {"pirate": str(tmp_path / "p")}, "allow_runtime_updates": True,
                                    "adapter_dirs": [str(tmp_path)]}})
    info = ModelInfo(served_name="tiny", model_dir=str(tmp_path), architecture="LlamaForCausalLM", vocab_size=8,
                     eos_token_ids=(0,), dtype="float32", max_model_len=256)
    with caplog.at_level(logging.INFO):
        _log_what_is_served(logging.getLogger("mstar_actors"), config, info)
    served, lora = caplog.messages
    assert served == (f"serving tiny from {tmp_path}: LlamaForCausalLM, float32 on cpu (model.quantization auto), "
                      "tp 1, up to 8 sequences of 256 tokens")
    assert lora == (f"LoRA: pirate ({tmp_path / 'p'}); 4 slots of rank up to 16; runtime loads and unloads on "
                    f"(from {tmp_path})")


def test_a_kv_block_too_large_for_any_cache_names_kv_block_size():
    """The hint said to raise kv.memory_fraction, which a CPU cache at its cap cannot use; the block's size is
    the cause."""
    import torch

    from mstar_actors.models.spec import ModelSpec, RopeSpec
    from mstar_actors.runner.build import blocks_from_memory

    spec = ModelSpec(architecture="LlamaForCausalLM", vocab_size=300, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                     max_position_embeddings=256, rope=RopeSpec(theta=10000.0), tie_word_embeddings=True)
    with pytest.raises(ConfigError, match=r"\(kv.block_size 10000000 tokens\).*lower kv.block_size \(vLLM's is 16\)"):
        blocks_from_memory(spec, 10_000_000, 0.5, torch.float32, torch.device("cpu"))


def test_flags_a_person_types_are_read_as_meant(tmp_path, capsys):
    """``--log-level debug`` was refused for its case; ``dump-stacks --timeout 0`` waited for nothing, then said
    no actor answered in time."""
    from mstar_actors.__main__ import main

    assert main(["serve", "--log-level", "debug", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no such config file" in capsys.readouterr().err  # past the flags
    for timeout in ("0", "-1", "nan"):
        with pytest.raises(SystemExit) as stop:
            main(["dump-stacks", "--timeout", timeout])
        assert stop.value.code == 2 and "expected a positive number of seconds" in capsys.readouterr().err


def test_tensor_parallel_ranks_past_the_gpus_are_one_line(tmp_path, monkeypatch, capsys):
    """Rank R serves on cuda:R: past the machine's GPUs a rank failed at its start with torch's error."""
    import torch

    from mstar_actors.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  device: cuda\nparallel:\n  tp: 2\n")
    assert main(["serve", str(path)]) == 2
    assert "parallel.tp 2: each rank serves on a GPU of its own and this machine has 1" in capsys.readouterr().err
