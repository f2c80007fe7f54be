"""LoRA over HTTP: the real frontend, conductor and adapter-reader (four fake
ranks from the agreement tests) over in-memory channels. Every refusal is
checked for its status and message."""

from __future__ import annotations

import asyncio
import json
import shutil

import aiohttp
import msgspec
import pytest
import torch
from lora_factories import edit_adapter, make_adapter, make_base
from test_lora_agreement import Cluster, adapters, run_async  # noqa: F401 (fixture)

from actors.frontend import FrontendActor
from mstar_actors.messages import ActorReady, ActorToLauncher, ConductorToFrontend, FrontendToPrepare, LoadAdapter, UnloadAdapter
from transport.memory import MemoryChannel


def save_word_tokenizer(folder) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(300)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 64}))


class Served:
    """Cluster + frontend; frontend->prepare is bridged straight to the conductor
    (prepare forwards adapter updates unchanged)."""

    def __init__(self, adapters, tmp_path, **kw):
        save_word_tokenizer(tmp_path)
        self.cluster = Cluster(adapters, **kw)
        config = self.cluster.config
        model = type(config.model)(path=str(tmp_path), name="base")
        self.config = type(config)(**{f: getattr(config, f) for f in config.__struct_fields__} | {"model": model})
        self.config.server.port = 0
        self.to_prepare = MemoryChannel(FrontendToPrepare, "frontend.prepare")
        self.to_frontend = MemoryChannel(ConductorToFrontend, "conductor.frontend(relay)")
        self.ready = MemoryChannel(ActorToLauncher, "frontend.launcher")
        info = msgspec.structs.replace(self.cluster.info, model_dir=str(tmp_path))  # the tokenizer's folder
        self.frontend = FrontendActor(name="frontend", config=self.config, info=info, inbox={"conductor": self.to_frontend},
                                      outbox={"prepare": self.to_prepare, "control": self.ready})

    async def bridge(self) -> None:
        while True:
            msg = await self.to_prepare.recv()
            assert isinstance(msg, LoadAdapter | UnloadAdapter), msg
            await self.cluster.to_conductor.send(msg)

    async def relay(self) -> None:
        while True:
            msg = await self.cluster.from_conductor.recv()
            await self.to_frontend.send(msg)

    async def __aenter__(self):
        await self.cluster.__aenter__()
        self.tasks = [asyncio.create_task(x) for x in (self.bridge(), self.relay())]
        self.frontend_task = asyncio.create_task(self.frontend.run())
        assert isinstance(await self.ready.recv(), ActorReady)  # the port is bound
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc):
        await self.session.close()
        for t in self.tasks:
            t.cancel()
        self.to_frontend.close()
        await self.frontend_task
        await self.cluster.__aexit__(*exc)

    async def post(self, path: str, body: dict) -> tuple[int, object]:
        async with self.session.post(f"http://127.0.0.1:{self.frontend.port}{path}", json=body) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text

    async def models(self) -> dict:
        async with self.session.get(f"http://127.0.0.1:{self.frontend.port}/v1/models") as r:
            return {m["id"]: m for m in (await r.json())["data"]}


def error(body) -> str:
    return body["error"]["message"]


@pytest.fixture(scope="module")
def bad_adapters(tmp_path_factory):
    """One adapter folder per refusal, under one allowed folder."""
    root = tmp_path_factory.mktemp("allowed")
    model, _ = make_base(seed=0)
    good, _ = make_adapter(root, model, name="good", r=4)
    out = {"good": good}

    def variant(name, **edit):
        folder = shutil.copytree(good, root / name)
        edit_adapter(folder, **edit)
        out[name] = folder

    variant("dora", config={"use_dora": True})
    variant("rank", config={"r": 16, "rank_pattern": {}},
            tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(16, 64),
                     "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 16)})
    variant("target", tensors={"base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": torch.zeros(4, 64),
                               "base_model.model.model.layers.0.self_attn.rotary.lora_B.weight": torch.zeros(64, 4)})
    variant("shapes", tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 65)})
    variant("bias", config={"bias": "all"})
    variant("modules_to_save", config={"modules_to_save": ["lm_head"]})
    missing = shutil.copytree(good, root / "missing")
    (missing / "adapter_model.safetensors").unlink()
    out["missing"] = missing
    corrupt = shutil.copytree(good, root / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    out["corrupt"] = corrupt
    return root, out


REFUSALS = {
    "dora": "dora",
    "rank": "rank",
    "target": "rotary",
    "shapes": "shape",
    "bias": "bias",
    "modules_to_save": "modules_to_save",
    "missing": "adapter_model.safetensors",
    "corrupt": "",
}


@run_async
async def test_runtime_load_refusals_are_400_with_the_readers_reason(adapters, bad_adapters, tmp_path):
    root, folders = bad_adapters
    async with Served(adapters, tmp_path, runtime_dirs=[str(root)]) as served:
        for name, needle in REFUSALS.items():
            status, body = await served.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folders[name])})
            assert status == 400, (name, body)
            assert f"'{name}'" in error(body) and needle.lower() in error(body).lower(), (name, error(body))
        status, text = await served.post("/v1/load_lora_adapter", {"lora_name": "good", "lora_path": str(folders["good"])})
        assert status == 200 and "good" in text
        models = await served.models()
        assert models["good"]["parent"] == "base" and models["good"]["root"] == str(folders["good"].resolve())
        assert "dora" not in models
        status, body = await served.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
        assert status == 403 and "outside the allowed adapter folders" in error(body) and str(root) in error(body)
        status, body = await served.post("/v1/unload_lora_adapter", {"lora_name": "nope"})
        assert status == 404 and body["error"]["code"] == "model_not_found" and "'nope'" in error(body)
        status, text = await served.post("/v1/unload_lora_adapter", {"lora_name": "good"})
        assert status == 200 and "removed" in text
        assert "good" not in await served.models()
        status, body = await served.post("/v1/completions", {"model": "good", "prompt": "w1 w2"})
        assert status == 404 and body["error"]["code"] == "model_not_found"


@run_async
async def test_runtime_updates_off_is_403_and_unknown_model_404(adapters, tmp_path):
    async with Served(adapters, tmp_path) as served:
        for path, body in [("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path)}),
                           ("/v1/unload_lora_adapter", {"lora_name": "a"})]:
            status, answer = await served.post(path, body)
            assert status == 403 and "lora.allow_runtime_updates" in error(answer)
        status, body = await served.post("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "w1"}]})
        assert status == 404 and body["error"]["code"] == "model_not_found" and "'nope'" in error(body)
        models = await served.models()
        assert set(models) == {"base", "a", "b", "c"} and models["a"]["parent"] == "base"
