"""What one rank runs in the tensor-parallel tests: hand-built plans through
the rank's runner (``plan_driver``), the same on every rank and at tp=1.

Each scenario takes the rank's ``TensorParallel`` first (``SINGLE_RANK`` for
the unsharded reference) and returns plain data: outputs by request id, the
logits of every sampled row in step order, and the parameters the rank holds.
"""

from __future__ import annotations


import torch

import runner_factories
from mstar_actors import messages
from mstar_actors.runner.sampling import sample_tokens
from plan_driver import PlanDriver

BLOCK_SIZE = 4
NUM_NEW = 32
GREEDY = messages.SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


def decode_prompts(vocab: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(5)
    prompts = {rid: torch.randint(3, vocab, (n,), generator=gen).tolist() for rid, n in [("a", 30), ("b", 14), ("c", 9)]}
    prompts["a2"] = prompts["a"][:24] + torch.randint(3, vocab, (5,), generator=gen).tolist()
    return prompts


class LogitsRecorder:
    """A sampler that keeps every step's logits, then samples as the runner would."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits, rows, *, generator):
        self.logits.append(logits.detach().cpu().numpy().copy())  # numpy: crosses the result queue by value
        return sample_tokens(logits, rows, generator=generator)


def held_parameters(runner) -> int:
    return sum(p.numel() for p in runner.model.parameters())


def decode_scenario(tp, folder, vocab: int, **runner_keys) -> dict:
    """Chunked prefill, a prefix-cache hit and a preemption (a sequence
    dropped and restarted with its outputs) among decodes, to ``NUM_NEW``
    tokens each."""
    recorder = LogitsRecorder()
    keys = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=96, seed=0) | runner_keys
    runner = runner_factories.make_runner(folder, sampler=recorder, tp=tp, **keys)
    prompts = decode_prompts(vocab)
    d = PlanDriver(runner, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=GREEDY)
    starts = [d.start(rid, prompts[rid]) for rid in ("a", "b", "c")]
    d.step(starts, [d.chunk("a", 12), d.chunk("b"), d.chunk("c")])
    d.step([], [d.chunk("a", 12), *d.decodes("b", "c")])
    d.step([], [d.chunk("a", 6), *d.decodes("b", "c")])
    a2 = d.start("a2", prompts["a2"], shared_blocks=d.seqs["a"]["blocks"][:6], num_computed=24)  # a prefix hit
    d.step([a2], [d.chunk("a2"), *d.decodes("a", "b", "c")])
    for _ in range(3):
        d.step([], d.decodes("a", "a2", "b", "c"))
    # Preemption: c's blocks go back; it restarts later with its outputs, recomputed in one chunk.
    outputs_c = list(d.seqs["c"]["outputs"])
    d.step([], d.decodes("a", "a2", "b"), [d.finish("c")])
    restarted = d.start("c", prompts["c"], outputs=outputs_c)
    d.step([restarted], [d.chunk("c"), *d.decodes("a", "a2", "b")])
    outputs = d.run_to_end()
    return dict(outputs=outputs, logits=recorder.logits, num_params=held_parameters(runner),
                num_kv_heads=runner.kv_caches[0].shape[-2], rank=tp.rank)


def vl_scenario(tp, folder) -> dict:
    """Image and text prompts through the multimodal runner: chunks that
    split an image run, then decodes."""
    from models.test_qwen2_5_vl import media_prompt
    from models.vl_factories import FakeArena

    arena = FakeArena()
    prompts = {
        "img": media_prompt([("text", 5), ("image", (1, 6, 10)), ("text", 6)], arena, seed=1),
        "txt": media_prompt([("text", 17)], arena, seed=2),
        "img2": media_prompt([("text", 3), ("image", (1, 4, 4)), ("text", 4)], arena, seed=3),
    }
    recorder = LogitsRecorder()
    runner = runner_factories.make_runner(folder, sampler=recorder, tp=tp, resolve_tensor=arena.resolve,
                                          dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=64, seed=0)
    d = PlanDriver(runner, block_size=BLOCK_SIZE, num_new=16, sampling=GREEDY)
    starts = [d.start(rid, p, m) for rid, (p, m, _) in prompts.items()]
    d.step(starts, [d.chunk("img", 10), d.chunk("txt", 9), d.chunk("img2")])
    d.step([], [d.chunk("img"), d.chunk("txt"), *d.decodes("img2")])
    outputs = d.run_to_end()
    return dict(outputs=outputs, logits=recorder.logits, num_params=held_parameters(runner), rank=tp.rank)




def lora_scenario(tp, base_folder, installs: list, max_rank: int, device: str = "cpu") -> dict:
    """Three adapters installed as a worker installs them (``install_from_host``
    from shared-memory host copies), then base and adapter rows in the same
    steps: chunked prefill and a prefix-cache hit within one adapter (the
    plans of ``test_lora_parity``'s ``run_mixed``). Returns the outputs and
    every install's answer."""
    from actors.worker import install_from_host

    runner = runner_factories.make_runner(base_folder, tp=tp, dtype="float32", device=device, block_size=BLOCK_SIZE,
                                          num_blocks=96, seed=0, max_loras=len(installs), max_lora_rank=max_rank)
    replies = [install_from_host(runner, tp.rank, msg) for msg in installs]
    slots = {msg.name: msg.slot for msg in installs}
    gen = torch.Generator().manual_seed(3)
    prompts = {rid: torch.randint(3, 320, (n,), generator=gen).tolist() for rid, n in [("a1", 30), ("b0", 14), ("t1", 9), ("m1", 7)]}
    prompts["a2"] = prompts["a1"][:24] + torch.randint(3, 320, (5,), generator=gen).tolist()
    on = {"a1": "all", "a2": "all", "t1": "attn", "m1": "mlp", "b0": None}
    d = PlanDriver(runner, block_size=BLOCK_SIZE, num_new=16, sampling=GREEDY)
    start = {rid: d.start(rid, prompts[rid], slot=slots.get(on[rid], 0)) for rid in ("a1", "b0", "t1", "m1")}
    d.step(start.values(), [d.chunk("a1", 12), d.chunk("b0"), d.chunk("t1"), d.chunk("m1")])
    d.step([], [d.chunk("a1", 12), *d.decodes("b0", "t1", "m1")])
    d.step([], [d.chunk("a1", 6), *d.decodes("b0", "t1", "m1")])
    a2 = d.start("a2", prompts["a2"], slot=slots["all"], shared_blocks=d.seqs["a1"]["blocks"][:6], num_computed=24)
    d.step([a2], [d.chunk("a2"), *d.decodes("a1", "b0", "t1", "m1")])
    return dict(outputs=d.run_to_end(), prompts=prompts, on=on, replies=[(r.ok, r.error) for r in replies],
                stack_rows={name: tuple(stack.b.shape) for name, stack in runner.lora.stacks.items()})


def merged_scenario(tp, base_folder, installs: list, max_rank: int) -> dict:
    """The adapters without an LM head or embedding target, each rank merging after two steps on
    one adapter (``lora.merge``): two requests on one adapter, then one on another. Returns the
    outputs and what the weights held at each step."""
    from actors.worker import install_from_host

    runner = runner_factories.make_runner(base_folder, tp=tp, dtype="float32", device="cpu", block_size=BLOCK_SIZE,
                                          num_blocks=96, seed=0, max_loras=max(m.slot for m in installs),
                                          max_lora_rank=max_rank)
    replies = [install_from_host(runner, tp.rank, msg) for msg in installs]
    runner.merge_one_adapter_steps(runner.lora.merged_weights(), 2)
    held, hold = [], runner.merged.hold
    runner.merged.hold = lambda slot, tenant: (hold(slot, tenant), held.append(runner.merged.tenant))
    slots = {msg.name: msg.slot for msg in installs}
    gen = torch.Generator().manual_seed(4)
    prompts = {rid: torch.randint(3, 320, (n,), generator=gen).tolist() for rid, n in [("t1", 9), ("t2", 13), ("m1", 7)]}
    on = {"t1": "attn", "t2": "attn", "m1": "mlp"}
    d = PlanDriver(runner, block_size=BLOCK_SIZE, num_new=16, sampling=GREEDY)
    d.step([d.start(r, prompts[r], slot=slots[on[r]]) for r in ("t1", "t2")], [d.chunk("t1"), d.chunk("t2")])
    outputs = d.run_to_end()
    d = PlanDriver(runner, block_size=BLOCK_SIZE, num_new=16, sampling=GREEDY)
    d.step([d.start("m1", prompts["m1"], slot=slots["mlp"])], [d.chunk("m1")])
    outputs |= d.run_to_end()
    return dict(outputs=outputs, prompts=prompts, on=on, replies=[(r.ok, r.error) for r in replies], held=held)


def serve_rank(tp, base_folder, commands, replies, fail_names: tuple[str, ...], max_loras: int) -> int:
    """A worker's work on a real sharded runner, driven through queues: the
    parent relays the conductor's ``InstallAdapter`` and ``StepPlan`` here and
    the answers back (``WorkerReady`` first; ``None`` ends it). Installs of
    ``fail_names`` fail on this rank, as a rank-local fault would."""
    import time

    from actors.worker import install_from_host

    runner = runner_factories.make_runner(base_folder, tp=tp, dtype="float32", device="cpu", block_size=4,
                                          num_blocks=64, seed=0, max_loras=max_loras, max_lora_rank=8,
                                          max_model_len=64)
    install = runner.install_adapter

    def failing_install(slot, weights):
        if weights.name in fail_names:
            raise RuntimeError(f"scripted failure of {weights.name!r} on rank {tp.rank}")
        install(slot, weights)

    runner.install_adapter = failing_install
    replies.put(runner.ready_info(tp.rank))
    num_steps = 0
    while (msg := commands.get()) is not None:
        if isinstance(msg, messages.InstallAdapter):
            replies.put(install_from_host(runner, tp.rank, msg))
        else:
            started = time.perf_counter()
            sampled = runner.execute(msg)
            num_steps += 1
            replies.put(messages.StepDone(step_id=msg.step_id, rank=tp.rank, sampled=sampled,
                                          elapsed_s=time.perf_counter() - started))
    return num_steps
