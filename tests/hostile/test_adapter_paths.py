"""Runtime adapter loads read only files that really lie inside
``lora.adapter_dirs``: links out of the folders (made by the test), a file
swapped for a link after the folder was checked, a FIFO. Refusals are 403s
that name the file, never where it led nor what it holds. Configured
adapters are the operator's and are read where their links lead."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lora"))  # the LoRA tests' factories and harness

from lora_factories import base_shapes, make_adapter, make_base  # noqa: E402
from test_lora_agreement import Cluster, adapters, run_async  # noqa: E402,F401 (fixture)
from test_lora_serving import Served, error  # noqa: E402

from mstar_actors.lora import AdapterError, read_adapter  # noqa: E402
from mstar_actors.lora.adapter_file import CONFIG_FILE, WEIGHTS_FILE, AdapterFileOutside  # noqa: E402
from mstar_actors.lora.paths import resolve_runtime_path  # noqa: E402
from mstar_actors.messages import AdapterRead, AdapterReadFailed, ReadAdapter  # noqa: E402

pytestmark = pytest.mark.timeout(60)
SECRET = "peft-secret-7731"


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """``allowed/`` (the adapter folder), an adapter ``outside/good`` and a
    secret JSON file outside; the base model's shapes."""
    tmp = tmp_path_factory.mktemp("paths")
    model, config = make_base(seed=0)
    good, _ = make_adapter(tmp / "outside", model, name="good")
    (tmp / "outside" / "secret.json").write_text(json.dumps({"peft_type": SECRET, "r": SECRET}))
    (tmp / "allowed").mkdir()
    return tmp, base_shapes(config)


def linked_copy(folder: Path, to: Path, **links: Path) -> Path:
    """``folder`` holding a link to each of ``to``'s two files (or to ``links[file]``)."""
    folder.mkdir()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        (folder / name).symlink_to(links.get(name.replace(".", "_"), to / name))
    return folder


def refusal(folder: Path, tmp: Path, shapes, allowed: Path) -> str:
    with pytest.raises(AdapterFileOutside) as err:
        read_adapter(folder, base=shapes, max_rank=8, allowed_dirs=[os.path.realpath(allowed)])
    message = str(err.value)
    assert str(tmp) not in message and "outside" + os.sep not in message and SECRET not in message, message
    return message


def test_a_folder_of_links_out_of_the_allowed_folder_is_refused(layout, tmp_path):
    tmp, shapes = layout
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    linked = linked_copy(allowed / "linked", tmp / "outside" / "good")
    assert "adapter_config.json resolves outside lora.adapter_dirs" in refusal(linked, tmp, shapes, allowed)
    # The weights alone linked out: refused too (the config is a real file inside).
    half = allowed / "half"
    half.mkdir()
    (half / CONFIG_FILE).write_bytes((tmp / "outside" / "good" / CONFIG_FILE).read_bytes())
    (half / WEIGHTS_FILE).symlink_to(tmp / "outside" / "good" / WEIGHTS_FILE)
    assert f"{WEIGHTS_FILE} resolves outside" in refusal(half, tmp, shapes, allowed)
    # Unconfined (a configured adapter), the same links are read.
    assert read_adapter(linked, base=shapes, max_rank=8).num_modules > 0


def test_a_config_linked_to_a_json_file_outside_is_not_read(layout, tmp_path):
    tmp, shapes = layout
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    folder = linked_copy(allowed / "ad", tmp / "outside" / "good", adapter_config_json=tmp / "outside" / "secret.json")
    refusal(folder, tmp, shapes, allowed)
    with pytest.raises(AdapterError, match=SECRET):  # read unconfined, its values would be echoed
        read_adapter(folder, base=shapes, max_rank=8)


def test_links_that_stay_inside_the_allowed_folder_are_read(layout, tmp_path):
    """A Hugging Face cache layout: a snapshot's files link into ``blobs/``."""
    tmp, shapes = layout
    allowed = tmp_path / "hub"
    (allowed / "blobs").mkdir(parents=True)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        (allowed / "blobs" / name).write_bytes((tmp / "outside" / "good" / name).read_bytes())
    snapshot = allowed / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        (snapshot / name).symlink_to(Path("../..") / "blobs" / name)
    read = read_adapter(snapshot, base=shapes, max_rank=8, allowed_dirs=[os.path.realpath(allowed)])
    assert read.digest == read_adapter(tmp / "outside" / "good", base=shapes, max_rank=8).digest


def test_a_file_swapped_for_a_link_after_the_folder_was_checked_is_refused(layout, tmp_path):
    tmp, shapes = layout
    allowed = tmp_path / "allowed"
    folder = allowed / "ad"
    folder.mkdir(parents=True)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        (folder / name).write_bytes((tmp / "outside" / "good" / name).read_bytes())
    checked = resolve_runtime_path(str(folder), [str(allowed)])  # the frontend's check of the name: passes
    (folder / WEIGHTS_FILE).unlink()
    (folder / WEIGHTS_FILE).symlink_to(tmp / "outside" / "good" / WEIGHTS_FILE)
    refusal(Path(checked), tmp, shapes, allowed)


def test_a_fifo_in_the_folder_is_refused_without_hanging(layout, tmp_path):
    tmp, shapes = layout
    folder = tmp_path / "allowed" / "ad"
    folder.mkdir(parents=True)
    os.mkfifo(folder / CONFIG_FILE)
    with pytest.raises(AdapterError, match="adapter_config.json is not a regular file"):
        read_adapter(folder, base=shapes, max_rank=8, allowed_dirs=[os.path.realpath(tmp_path / "allowed")])


@run_async
async def test_the_reader_confines_runtime_reads_and_trusts_configured_adapters(layout, tmp_path):
    """The real adapter-reader (in the LoRA tests' cluster): a configured
    adapter whose files link out of every allowed folder is read; a runtime
    read of the same links (the pool sends a runtime load's confined) is refused with the 403's code."""
    tmp, shapes = layout
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    configured = linked_copy(tmp_path / "configured", tmp / "outside" / "good")  # outside adapter_dirs, links out
    runtime = linked_copy(allowed / "runtime", tmp / "outside" / "good")
    async with Cluster(({"conf": configured}, shapes), runtime_dirs=[str(allowed)]) as cluster:
        read = await cluster.reader.read(ReadAdapter(name="conf", path=str(configured)))
        assert isinstance(read, AdapterRead), read
        failed = await cluster.reader.read(ReadAdapter(name="x", path=str(runtime), refresh=True, confined=True))
        assert isinstance(failed, AdapterReadFailed) and failed.code == "adapter_path_not_allowed", failed
        assert str(tmp) not in failed.message


@run_async
async def test_runtime_loads_through_links_are_403s_that_echo_no_path(adapters, layout, tmp_path):
    tmp, _ = layout
    root = tmp_path / "allowed"
    root.mkdir()
    linked = linked_copy(root / "linked", tmp / "outside" / "good")
    secret = linked_copy(root / "secret", tmp / "outside" / "good", adapter_config_json=tmp / "outside" / "secret.json")
    (root / "escape").symlink_to(tmp / "outside" / "good", target_is_directory=True)
    (tmp_path / "model").mkdir()
    async with Served(adapters, tmp_path / "model", runtime_dirs=[str(root)]) as served:
        for name, folder in (("linked", linked), ("secret", secret), ("escape", root / "escape")):
            status, body = await served.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
            assert status == 403 and body["error"]["code"] == "adapter_path_not_allowed", (name, body)
            assert body["error"]["type"] == "permission_error"  # as a folder outside is refused
            message = error(body)
            assert str(tmp) not in message and SECRET not in message, (name, message)
        assert not {"linked", "secret", "escape"} & set(await served.models())


def test_a_folder_link_out_of_the_allowed_folder_says_it_leads_out(layout, tmp_path):
    """The path as written sits inside the allowed folder: the refusal says a link leads out (not that the path
    is outside, which it visibly is not), and never where to."""
    from mstar_actors.lora.paths import AdapterPathError

    tmp, _shapes = layout
    allowed = tmp / "allowed"
    (allowed / "link").symlink_to(tmp / "outside" / "good", target_is_directory=True)
    with pytest.raises(AdapterPathError) as err:
        resolve_runtime_path(str(allowed / "link"), [str(allowed)])
    assert "leads outside the allowed adapter folders through a link" in str(err.value)
    assert "outside" + os.sep not in str(err.value)
    with pytest.raises(AdapterPathError, match="is outside the allowed adapter folders"):
        resolve_runtime_path(str(tmp / "outside" / "good"), [str(allowed)])
