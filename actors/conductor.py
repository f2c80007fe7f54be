"""The conductor actor: the only decider. A thin busy loop around the Scheduler.

Start-up is an agreement: every rank reports ``WorkerReady`` (its capacity)
and the conductor combines them (the minimum of ``num_kv_blocks`` and
``num_state_slots``; either every rank keeps recurrent state or none) into one
``Scheduler`` of the model's facts (``ModelInfo``: EOS ids, context; the
config's block size), and tells the frontend the context that KV capacity
leaves (``ContextAgreed``).
Only then does it report ready.

The busy loop, each turn:

1. apply what has arrived: aborts and new requests, in channel order
   (an abort is idempotent; ``Failed`` from prepare is relayed);
2. while the scheduler may plan (``scheduler.async_scheduling``: one step
   ahead of the ranks, or ``steps_ahead`` steps, else one step at a time),
   ``schedule()`` and broadcast the ``StepPlan`` to every rank;
3. else await the oldest step's answer from every rank, applying other
   arrivals meanwhile (an abort then lands before the step's results are
   used); with nothing in flight and no work, park on the mailbox until a
   message arrives (no polling);
4. ``update()`` with rank 0's tokens (the others acknowledge, with matching
   step ids), plan the next step and send it (``plan_ahead``), then send the
   outputs to the frontend, plus ``EngineStats`` when they changed: the
   ranks wait for the plan, the tokens hold no step back. A ``StepFailed``
   fails its rows (or the whole step) with a 500 and the loop keeps serving
   the others.

Planning ahead, a rank finds the next plan waiting when its step ends: the
result's trip here, the update, the plan and its trip back overlap the
step instead of following it (``Scheduler``'s module doc says what the
plan assumes of the step in flight).

A plan's rows go out as ``schedule()`` returns them: the scheduler is their
only author (KV blocks, LoRA slots, media orders); the conductor routes and
steps. The one field it adds is ``install_after``, the installs of a LoRA
turn that ends with that step (``AdapterPool.step``, which counts the steps
planned, so it runs once the plan exists).

LoRA: ``AdapterPool`` (``mstar_actors.lora.adapter_pool``) decides which
request waits for which adapter and which slot installs go out; the actor only
routes what it returns. Requests reach the scheduler only once their slot is
acknowledged by every rank, or at once where the install is a swap every
rank finishes before its next plan (``InstallAdapter.rows_follow``), and
with their slot (``Admit.slot``); installs travel on
the same broadcast as the plans, so every rank sees plans and installs in one
order (a turn's end inside the plan of its last step, ``install_after``: each
rank acknowledges it before it answers the step ahead, so the slot's next rows
join the next plan). A choice's end (any ``Finished`` / ``Failed`` the
scheduler emits) unpins its slot. Under churn the pool parks a slot's admitted
choices when their adapter's turn ends (``MoveRows``: the scheduler leaves them
out of the plans) and moves them to a slot again once their adapter is
reinstalled; the swap's install rides in the last plan that used the slot, so
every rank runs that step on the old weights.

Structured outputs: a constrained request waits in ``GrammarGate``
(``mstar_actors.sched.grammar_gate``) while every rank compiles its grammar
beside its steps (``CompileGrammar`` on the broadcast, ``GrammarCompiled``
back), then goes on as any other; a slow schema holds its own request, never
the batch.

Choices: a request of ``n`` choices arrives prepared once; the scheduler
runs it as ``n`` sequences sharing its prompt and media.

Media: a media request's blocks from each item's first token on are keyed by
that item's digest as well (``Prepared.media_digests``, ``Sequence.block_hash``),
so KV of placeholder blocks is shared only between requests with the same
images in the same places, while the text before them (a system prompt, an
earlier turn's images) is shared with any request under the same root that
has it, text-only ones too. The scheduler owns the
request's arena refs from here on (``mstar_actors.sched.media``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec

from actors.base import Actor, frontend_name
from mstar_actors.lora.adapter_pool import AdapterPool, Admit, MoveRows
from mstar_actors.sched.agreement import combine_failures, combine_ready, make_scheduler, salted_root
from mstar_actors.sched.grammar_gate import GrammarGate
from mstar_actors.messages import (
    Abort,
    AdapterInstalled,
    AdapterRead,
    AdapterReadFailed,
    AdapterUpdate,
    CancelCompile,
    ContextAgreed,
    DropAdapter,
    Failed,
    Finished,
    GrammarCompiled,
    InstallAdapter,
    LoadAdapter,
    Prepared,
    ReadAdapter,
    StepDone,
    StepFailed,
    StepPlan,
    TokenDelta,
    UnloadAdapter,
    WorkerReady,
    choice_ids,
    frontend_of,
)


class StepTimeout(RuntimeError):
    """A step some rank never answered (``scheduler.step_timeout_s``)."""


class ConductorActor(Actor):
    """inbox: ``prepare``, ``worker0`` .. ``worker{N-1}``, ``adapter_reader``, ``control``;
    outbox: ``frontend`` (and ``frontend1`` ... with ``server.api_server_count``), ``workers``
    (broadcast to every rank), ``adapter_reader``, ``control``."""

    def __init__(self, *, num_ranks: int | None = None, **kw: Any):
        super().__init__(**kw)
        self.num_ranks = num_ranks or self.config.parallel.tp
        self.adapter_pool = AdapterPool.from_config(self.config, self.info.served_name, self.num_ranks)
        self.grammar_gate = GrammarGate(self.num_ranks)
        self.scheduler: Any = None
        # Steps sent to the ranks, oldest first, with their answers so far: step id -> rank -> result.
        self.step_results: dict[int, dict[int, StepDone | StepFailed]] = {}
        self.last_stats: Any = None
        self.step_tokens: list[int] = []  # each step's tokens since the stats last sent
        # request id -> (monotonic time its Prepared came, that of the plan that first started it): vLLM's
        # queue and prefill times, sent on its first delta (``timed``)
        self.arrived: dict[str, tuple[float, float | None]] = {}
        # server.api_server_count frontends: an output goes to the one its request id names (frontend_of).
        self.frontends = [self.outbox[frontend_name(i)] for i in range(sum(1 for name in self.outbox
                                                                             if name.startswith("frontend")))]

    # ---- start: agreement -------------------------------------------------

    async def start(self) -> None:
        ready: dict[int, WorkerReady] = {}
        early: list[tuple[str, Any]] = []
        while len(ready) < self.num_ranks:
            channel, msg = await self.mailbox.get()
            if isinstance(msg, WorkerReady):
                ready[msg.rank] = msg
            elif channel.startswith("worker"):
                await self.dispatch(channel, msg)  # a rank's end of channel or an unknown message
            else:
                early.append((channel, msg))  # nothing should come before Started; keep order anyway
        facts = combine_ready([ready[r] for r in sorted(ready)])
        self.scheduler = make_scheduler(self.config, self.info, facts, self.log)
        block_size, context = self.config.kv.block_size, self.info.max_model_len
        self.log.info("%d rank(s) agree: %d KV blocks of %d tokens, context %d%s",
                      self.num_ranks, facts.num_kv_blocks, block_size, context,
                      f", {facts.num_state_slots} recurrent-state slots" if facts.num_state_slots else "")
        self.info = self.info.with_kv_capacity(facts.num_kv_blocks * block_size)
        if self.info.max_model_len < context:
            self.log.warning("the KV cache holds %d tokens, fewer than the context (%d): a request's prompt and "
                             "output get at most %d (/v1/models says so); give it more blocks (kv.num_blocks, "
                             "kv.memory_fraction) or lower scheduler.max_model_len",
                             facts.num_kv_blocks * block_size, context, self.info.max_model_len)
        await self.tell_frontends(ContextAgreed(max_model_len=self.info.max_model_len))
        await self.send_stats()  # the gauges (KV blocks in all) from the start, not from the first step
        for channel, msg in early:
            await self.dispatch(channel, msg)

    async def stop(self) -> None:
        """On a failure (a rank's channel broke, say) every live request is told
        why before the channels close: its frontend would only see them end.
        Live: every choice that arrived and has not ended (``arrived``), the
        ones the adapter pool or the grammar gate holds as well as the
        scheduler's."""
        if not self.failure or self.scheduler is None:
            return
        message = f"the engine stopped: {self.failure}; the server must be restarted"
        for request_id in dict.fromkeys([*self.scheduler.requests, *self.arrived]):
            out = Failed(request_id=request_id, status=503, error_type="service_unavailable_error", message=message)
            try:
                self.frontends[frontend_of(request_id)].send_nowait(out)
            except Exception as err:  # full or gone: the frontend fails it on the channel's end
                self.log.debug("could not tell %s: %s", request_id, err)

    # ---- the busy loop ----------------------------------------------------

    async def serve(self) -> None:
        stats_due = False  # an arrival or abort while idle: the gauges once its plan (if any) is sent
        while True:
            await self.apply_arrived()  # 1
            if self.scheduler.can_schedule():
                plan = self.scheduler.schedule() if self.scheduler.has_work() else None
                if plan is None and not self.step_results:  # no step to carry the orders: they go alone
                    plan = self.scheduler.schedule_orders()
                if plan is not None:
                    await self.send_plan(plan)  # 2
                    if stats_due:  # an arrival planned at once runs: not reported as waiting first
                        stats_due = False
                        await self.send_stats()
                    continue
            if stats_due:
                stats_due = False
                await self.send_stats()
            if self.step_results:
                oldest = next(iter(self.step_results))
                outputs = self.finish_step(oldest, await self.await_step(oldest))  # 3, 4
                await self.plan_ahead()
                await self.send_outputs(outputs)
                await self.send_stats()
                continue
            if self.scheduler.has_work() and (moved := self.adapter_pool.stalled()):
                await self.route(moved)  # every live row parked: their turns end now
                continue
            await self.dispatch(*await self.mailbox.get())  # park until something arrives
            stats_due = True  # an abort or arrival while idle changes the gauges

    async def send_plan(self, plan: StepPlan) -> None:
        """Send ``plan``; a LoRA turn that ends with it (``AdapterPool.step``)
        has its installs ride in it (``install_after``: every rank runs the
        step first) and the rest of what it moves routed after."""
        self.step_results[plan.step_id] = {}
        if plan.started:
            now = time.monotonic()
            for start in plan.started:  # (a restart after a preemption is not a first schedule)
                if (arrived := self.arrived.get(start.request_id)) is not None and arrived[1] is None:
                    self.arrived[start.request_id] = (arrived[0], now)
        if num_tokens := sum(chunk.num_tokens for chunk in plan.scheduled):  # (a plan of orders alone runs none)
            self.step_tokens.append(num_tokens)
        moved = self.adapter_pool.step()
        installs = [out for out in moved if isinstance(out, InstallAdapter)]
        for out in installs:
            self.log.debug("install %r into slot %d after step %d", out.name, out.slot, plan.step_id)
        await self.outbox["workers"].send(msgspec.structs.replace(plan, install_after=installs) if installs else plan)
        await self.route([out for out in moved if not isinstance(out, InstallAdapter)])

    async def apply_arrived(self) -> None:
        while (item := self.mailbox.get_nowait()) is not None:
            await self.dispatch(*item)

    async def await_step(self, step_id: int) -> dict[int, StepDone | StepFailed]:
        """Every rank's answer to step ``step_id`` (the oldest in flight);
        StepTimeout, which stops the server, when one has not come within
        ``scheduler.step_timeout_s`` of the wait's start."""
        results = self.step_results[step_id]
        timeout_s = self.config.scheduler.step_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s
        while len(results) < self.num_ranks:
            try:
                async with asyncio.timeout_at(deadline):  # (no task a message, as wait_for would make)
                    channel, msg = await self.mailbox.get()
            except TimeoutError:
                silent = [rank for rank in range(self.num_ranks) if rank not in results]
                raise StepTimeout(f"step {step_id}: no answer from rank(s) {silent} in {timeout_s:g} s "
                                  "(scheduler.step_timeout_s): a rank hung (stopped, or stuck in a kernel; one hung "
                                  "rank holds the others in their collectives); the server stops so its requests "
                                  "fail instead of waiting") from None
            await self.dispatch(channel, msg)
        del self.step_results[step_id]
        return results

    def finish_step(self, step_id: int, results: dict[int, StepDone | StepFailed]) -> list[Any]:
        """The scheduler's outputs of step ``step_id``, which every rank answered."""
        failures = [results[r] for r in sorted(results) if isinstance(results[r], StepFailed)]
        if failures:
            failed = combine_failures(step_id, failures)
            self.log.error("step %d failed (%s): %s", step_id,
                           ", ".join(failed.request_ids) or "every row", failed.message)
            # Rows the failure does not name did not advance: the scheduler runs them again.
            return self.scheduler.fail_step(failed)
        return self.scheduler.update(results[0])

    async def plan_ahead(self) -> None:
        """After a step's update, the next plan, before that step's outputs:
        the ranks wait for it (the host work of a step, the conductor's and a
        rank's, follows this answer in turn) while the frontends' tokens do
        not hold a step back. What arrived meanwhile waits for the loop's
        next turn: an abort handled here would send its ``Finished`` ahead
        of the request's last tokens."""
        if self.scheduler.can_schedule() and self.scheduler.has_work():
            plan = self.scheduler.schedule()
            if plan is not None:
                await self.send_plan(plan)

    # ---- reactions ----------------------------------------------------------

    async def handle(self, channel: str, msg: Any) -> None:
        match msg:
            case Prepared():
                now = time.monotonic()
                self.arrived.update((rid, (now, None)) for rid in choice_ids(msg.request_id, msg.n))
                self.scheduler.receive(msg)  # it owns the media from here, admitted or not
                if msg.sampling.structured is not None:  # its grammar compiles on the ranks first
                    await self.outbox["workers"].send(self.grammar_gate.hold(msg))
                else:
                    await self.route(self.adapter_pool.add(msg))
            case GrammarCompiled() if channel.startswith("worker"):
                match self.grammar_gate.on_compiled(msg):
                    case Prepared() as prepared:
                        await self.route(self.adapter_pool.add(prepared))
                    case Failed() as refused:  # a spec the ranks' engine refuses: its media goes
                        self.scheduler.abort(refused.request_id)
                        await self.send_outputs([refused])
            case Abort(request_id=request_id):
                if self.grammar_gate.holds(request_id):  # a request still waiting for its grammar: the ranks drop
                    await self.outbox["workers"].send(CancelCompile(request_id))  # its compile
                    await self.send_outputs(self.grammar_gate.drop(request_id))
                await self.route(self.adapter_pool.abort(request_id))  # a request still waiting for its adapter
                await self.send_outputs(self.scheduler.abort(request_id))
            case Failed() if channel == "prepare":
                await self.frontends[frontend_of(msg.request_id)].send(msg)
            case LoadAdapter() if channel == "prepare":
                await self.route(self.adapter_pool.load(msg))
            case UnloadAdapter() if channel == "prepare":
                await self.route(self.adapter_pool.unload(msg))
            case AdapterRead() if channel == "adapter_reader":
                await self.route(self.adapter_pool.on_read(msg))
            case AdapterReadFailed() if channel == "adapter_reader":
                served = msg.name in self.adapter_pool.adapters
                await self.route(self.adapter_pool.on_read_failed(msg))
                if served and msg.name not in self.adapter_pool.adapters:
                    self.log.warning("adapter %r unloaded: its files no longer give an adapter (%s); load it again "
                                     "with POST /v1/load_lora_adapter once they do", msg.name, msg.message)
            case AdapterInstalled() if channel.startswith("worker"):
                self.log.debug("rank %d: slot %d %s", msg.rank, msg.slot, "installed" if msg.ok else "failed")
                await self.route(self.adapter_pool.on_installed(msg))
            case StepDone() | StepFailed() if channel.startswith("worker"):
                self.record_result(channel, msg)
            case _:
                self.unknown(channel, msg)

    def record_result(self, channel: str, msg: StepDone | StepFailed) -> None:
        results = self.step_results.get(msg.step_id)
        if results is None:
            raise RuntimeError(f"{channel} sent {type(msg).__name__} for step {msg.step_id}, which is not in flight "
                               f"(in flight: {sorted(self.step_results)})")
        if msg.rank in results:
            raise RuntimeError(f"{channel} answered step {msg.step_id} twice")
        unanswered = [step for step, got in self.step_results.items() if step < msg.step_id and msg.rank not in got]
        if unanswered:
            raise RuntimeError(f"rank {msg.rank} answered step {msg.step_id} before step(s) {unanswered}: "
                               "ranks must execute plans in order")
        results[msg.rank] = msg

    async def route(self, outputs: list[Any]) -> None:
        """Send what the adapter pool decided, in its order."""
        for out in outputs:
            match out:
                case Admit(prepared=prepared, slot=slot, root=root):
                    # KV is keyed by the weights that computed it: the base name or the adapter's digest.
                    await self.send_outputs(self.scheduler.add(prepared, salted_root(root, prepared), slot))
                case MoveRows(request_ids=request_ids, slot=slot):
                    self.scheduler.set_lora_slot(request_ids, slot)
                case InstallAdapter():
                    self.log.debug("install %r into slot %d", out.name, out.slot)
                    await self.outbox["workers"].send(out)
                case ReadAdapter() | DropAdapter():
                    await self.outbox["adapter_reader"].send(out)
                case AdapterUpdate():  # a runtime load or unload's answer: the operator's record
                    self.log.log(logging.INFO if out.status == 200 else logging.WARNING, "%s", out.message)
                    await self.send_outputs([out])
                case Failed():  # the pool refused a request it never admitted: its media goes
                    self.scheduler.abort(out.request_id)
                    await self.send_outputs([out])
                case _:
                    await self.send_outputs([out])

    async def send_outputs(self, outputs: list[Any]) -> None:
        """Outputs of a request to its frontend; the rest (``ModelsChanged``) to every one. A choice's
        outputs after its end are dropped: a step's, sent after the plan ahead, whose adapter pool
        failed the choice meanwhile (``send_plan``)."""
        for out in outputs:
            request_id = getattr(out, "request_id", None)
            if request_id is None:
                await self.tell_frontends(out)
                continue
            if isinstance(out, TokenDelta | Finished | Failed) and not self.is_live(request_id):
                continue
            if isinstance(out, TokenDelta) and out.num_prompt_tokens:  # its first
                out = self.timed(out)
            await self.frontends[frontend_of(request_id)].send(out)
            if isinstance(out, Finished | Failed):
                self.forget_arrival(request_id)
                await self.route(self.adapter_pool.end(request_id))

    def is_live(self, request_id: str) -> bool:
        """Whether a request (any of its choices) or a choice has not ended yet."""
        if request_id in self.arrived:
            return True
        prefix = f"{request_id}-"
        return any(rid.startswith(prefix) and rid[len(prefix):].isdigit() for rid in self.arrived)

    def forget_arrival(self, request_id: str) -> None:
        """A choice ended, or a whole request of several choices (a refusal): each of its."""
        if self.arrived.pop(request_id, None) is None:
            prefix = f"{request_id}-"
            for rid in [r for r in self.arrived if r.startswith(prefix) and r[len(prefix):].isdigit()]:
                del self.arrived[rid]

    def timed(self, delta: TokenDelta) -> TokenDelta:
        """A choice's first delta with its queue and prefill times (``arrived``: when its Prepared came and
        when a plan first started it)."""
        arrived, scheduled = self.arrived.get(delta.request_id, (None, None))
        if scheduled is None:
            return delta
        return msgspec.structs.replace(delta, queued_s=scheduled - arrived, prefill_s=time.monotonic() - scheduled)

    async def tell_frontends(self, msg: Any) -> None:
        for frontend in self.frontends:
            await frontend.send(msg)

    async def send_stats(self) -> None:
        stats = self.scheduler.stats()
        # Held before the scheduler: for an adapter's slot, or a grammar's compile (waiting, not for an adapter).
        for_adapter = self.adapter_pool.num_waiting
        num_held = for_adapter + self.grammar_gate.num_waiting
        if num_held:  # (parked choices, the scheduler's, counted there)
            stats = msgspec.structs.replace(stats, num_waiting=stats.num_waiting + num_held,
                                            num_waiting_for_adapter=stats.num_waiting_for_adapter + for_adapter,
                                            num_waiting_deferred=stats.num_waiting_deferred + num_held)
        running, waiting = self.adapter_pool.adapter_names()
        if running or waiting:
            stats = msgspec.structs.replace(stats, running_adapters=running, waiting_adapters=waiting)
        if self.step_tokens:
            stats = msgspec.structs.replace(stats, step_tokens=tuple(self.step_tokens))
        if stats != self.last_stats:
            self.last_stats = stats
            self.step_tokens.clear()
            await self.tell_frontends(stats)
