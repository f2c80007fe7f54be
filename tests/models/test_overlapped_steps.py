"""The runner's overlapped steps give the tokens of one-at-a-time steps.

On CUDA the worker enqueues the next plan's ``forward`` before it
``collect``s the step ahead (``ModelRunner``'s module doc): a token the host
has not read yet is read on the device. Here the same scheduler (planning
one step ahead, as the conductor does) drives two runners on the same
weights, one overlapped and one stepping ``execute`` after ``execute``:
every request's tokens and logprobs must be equal, for greedy, seeded and
unseeded random rows, penalties and logprobs, through chunked prefill, a
prefix hit, and preemptions (a small KV cache). The static (graph) paths
run without capture on CPU and take the device tokens as well."""

from __future__ import annotations

import os
from collections import deque

import pytest

from mstar_actors import messages
from mstar_actors.sched import Scheduler
import runner_factories

BLOCK_SIZE = 4
NUM_BLOCKS = 40  # too few for every request at once: the scheduler preempts


def make_runner(folder, paths: str):
    if paths == "cuda-graphs":  # captured decode and mixed-step graphs, bf16
        return runner_factories.make_runner(folder, dtype="bfloat16", device="cuda", block_size=BLOCK_SIZE,
                                            num_blocks=NUM_BLOCKS, seed=0, max_num_seqs=8, cuda_graph_max_batch=8,
                                            cuda_graph_max_tokens=16)
    runner = runner_factories.make_runner(folder, dtype="float32", device="cpu", block_size=BLOCK_SIZE,
                                          num_blocks=NUM_BLOCKS, seed=0, enforce_eager=True, max_num_seqs=8)
    if paths in ("static", "static-draws"):
        runner.enable_step_graphs(8, 16, capture=False, draws=paths == "static-draws")
    return runner


def requests(eos: int, drawn: bool = False) -> list[messages.Prepared]:
    """Five requests; ``drawn``: each one a decode graph may draw (greedy,
    temperature, seeds), the seeded ones' seeds counting a token not yet read."""
    shared = list(range(40, 64))
    params = [
        dict(temperature=0.0),
        dict(temperature=0.8, seed=11, logprobs=3),
        dict(temperature=1.0, top_k=20),  # unseeded: the runners' generators draw in the same order
        dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=2),
        dict(temperature=0.7, top_p=0.9, seed=5, presence_penalty=0.4),
    ]
    if drawn:
        params = [dict(temperature=0.0), dict(temperature=0.8, seed=11), dict(temperature=1.0),
                  dict(temperature=1.2, seed=3), dict(temperature=0.6, seed=5)]
    out = []
    for i, p in enumerate(params):
        prompt = shared + [100 + 7 * i + j for j in range(3 + 5 * i)]  # a shared prefix, lengths 27..47
        sampling = messages.SamplingParams(max_tokens=18, ignore_eos=True, **p)
        out.append(messages.Prepared(request_id=f"r{i}", model="m", prompt_token_ids=prompt, sampling=sampling))
    return out


def drive(runner, overlapped: bool, ahead: int = 1) -> tuple[list, int]:
    """Every request through ``runner``: the scheduler's outputs in order, and
    how many sequences restarted after a preemption. The scheduler plans
    ``ahead`` steps past the result it awaits (the conductor's
    ``scheduler.steps_ahead``); the runner answers a step when it has begun
    the next, and a result is applied only when the scheduler must wait for
    it, so both runners see the same calls in the same order."""
    eos = tuple(runner.spec.eos_token_ids)  # (the conductor's are ModelInfo's, read by the same function)
    sched = Scheduler(num_blocks=runner.num_kv_blocks, block_size=BLOCK_SIZE, max_num_seqs=8,
                      max_num_batched_tokens=16, max_model_len=runner.max_model_len, eos_token_ids=eos,
                      enable_prefix_caching=True, max_in_flight=1 + ahead)
    for req in requests(eos[0], drawn=runner.graphs is not None and runner.graphs.draws):
        sched.receive(req)
        assert sched.add(req, "root") == []
    outputs: list = []
    num_restarts = 0
    on_runner: deque = deque()  # (plan, Step) forwarded and not yet collected (overlapped), oldest first
    results: deque = deque()  # (plan, tokens) the runner answered, not yet applied

    while True:
        plan = sched.schedule() if sched.can_schedule() else None
        if plan is None:
            if results:
                old, sampled = results.popleft()
                outputs.extend(sched.update(messages.StepDone(step_id=old.step_id, rank=0, sampled=sampled)))
            elif on_runner:
                old, step = on_runner.popleft()
                results.append((old, runner.collect(step)))
            else:
                break
            continue
        num_restarts += sum(bool(s.output_token_ids) for s in plan.started)
        if overlapped:  # the worker's order: the next forward, then the answer ahead, then the sampling
            step = runner.forward(plan)
            if on_runner:
                old, older_step = on_runner.popleft()
                results.append((old, runner.collect(older_step)))
            runner.sample(step)
            on_runner.append((plan, step))
        else:  # the plan runs whole
            results.append((plan, runner.execute(plan)))
    assert not sched.has_work()
    return outputs, num_restarts


@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("paths", ["eager", "static", "static-draws", pytest.param("cuda-graphs", marks=pytest.mark.gpu)])
def test_overlapped_steps_give_the_tokens_of_steps_one_at_a_time(paths, ahead, hf_models):
    if paths == "static-draws" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the graphs' draw runs on CPU tensors only in Triton's interpreter")
    folder, _ = hf_models("llama")
    want, num_restarts = drive(make_runner(folder, paths), overlapped=False, ahead=ahead)
    runner = make_runner(folder, paths)
    drawn = [runner_factories.record_draws(g) for g in (runner.graphs, runner.mixed_graphs)
             if g is not None and g.draws]
    got, _ = drive(runner, overlapped=True, ahead=ahead)
    assert got == want
    assert all(any(d) for d in drawn)  # with draws on, each set of graphs drew some steps itself
    assert num_restarts > 0  # the KV cache was small enough
    finished = [o for o in got if isinstance(o, messages.Finished)]
    assert len(finished) == 5 and all(o.finish_reason == "length" for o in finished)
    if runner.graphs is None or not runner.graphs.draws:
        assert any(isinstance(o, messages.TokenDelta) and o.tokens[0].logprob is not None for o in got)
    assert all(seq.pending == -1 for seq in runner.seqs.values())


def test_a_token_not_yet_read_is_the_next_steps_input_on_the_device(hf_models):
    """The mechanism itself: after ``sample``, the sequence holds its token as
    pending and the next batch reads it from ``step_tokens``."""
    folder, _ = hf_models("llama")
    runner = make_runner(folder, "eager")
    greedy = messages.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    start = messages.SeqStart(request_id="a", prompt_token_ids=[5, 6, 7], sampling=greedy)
    first = runner.forward(messages.StepPlan(step_id=1, started=[start], scheduled=[
        messages.ScheduledChunk(request_id="a", num_computed=0, num_tokens=3, block_ids=[0], sample=True)]))
    runner.sample(first)
    seq = runner.seqs["a"]
    assert (seq.pending, seq.num_known, seq.num_tokens) == (0, 3, 4)
    second = runner.forward(messages.StepPlan(step_id=2, started=[], scheduled=[
        messages.ScheduledChunk(request_id="a", num_computed=3, num_tokens=1, block_ids=[0], sample=True)]))
    assert second.batch.device_inputs == [(0, 0)] and second.batch.input_ids == [0]
    (token,) = runner.collect(first)
    assert seq.output_token_ids == [token.token_id] and seq.pending == -1
    assert runner.step_tokens[0].item() == token.token_id
    runner.sample(second)
    (token2,) = runner.collect(second)
    assert seq.output_token_ids == [token.token_id, token2.token_id]
