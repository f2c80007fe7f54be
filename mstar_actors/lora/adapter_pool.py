"""The conductor's adapter pool: which request waits for which adapter, which
installs are in flight, which host copies it holds. Pure: no I/O, no asyncio.

Every method takes one event (a request, an abort, a reader's answer, a
rank's ack, a runtime load or unload, a request's end, a planned step) and
returns what to send, in order: ``Admit`` (hand the request to the scheduler
on that slot and prefix root), ``MoveRows`` (park admitted choices, or resume
them on a slot: the scheduler's ``set_lora_slot``), ``Failed`` / ``Finished``
/ ``AdapterUpdate`` / ``ModelsChanged`` (to the frontend), ``ReadAdapter`` /
``DropAdapter`` (to the adapter-reader), ``InstallAdapter`` (to every rank, on
the same broadcast as the step plans; a turn's end's inside its last plan).

A request on an adapter::

    waiting --host copy held, slot acquired--> installing --every rank ok--> admitted
       |\\--slot already ready with its digest---------------------------->/
       \\--slot acquired, a swap on every rank (rows_follow)-------------->/
    pool full: stays waiting (backpressure; never failed for it, never run on slot 0)
               and reserves a slot, whose rows are parked once it had its turn
    admitted --its slot taken for another adapter--> parked --a slot again--> admitted

Invariants:

- A request is admitted only on a slot every rank acknowledged with the
  adapter's digest, or whose install every rank finishes before it reads
  its next plan (``InstallAdapter.rows_follow``: sent only with no other
  install in flight, of an image every rank's last answer says it keeps, so
  it is a swap; a failure there fails the choices admitted on the slot
  before any of their results is used, ``_fail_followed``); ``Admit.slot``
  is that slot, and the scheduler puts it in the ``SeqStart`` of each
  choice; a parked choice resumes under the same rule, with the digest it
  ran on. Each admitted choice
  (an installing request: the request) holds one pin on its slot, released
  exactly once: at its end (``end``), on a failed install, or when it is
  parked (a parked choice holds none until it resumes; while its reinstall
  is in flight it holds one on that slot).
- Host copies are reference counted by the reader: each ``AdapterRead`` is
  one hold, each ``DropAdapter`` releases one. Copies an install in flight
  or a waiting or parked request needs stay held, and those of versions
  requests run on (a park would need them back, and once the name is
  unloaded or reloaded, which may come while they run, no file has them);
  a held copy is never
  evicted: a rank may still be mapping it. Of the rest, the most recently used copies of
  served versions stay held while all held copies fit ``max_cpu_loras`` (the
  reader's tier), so swapping an adapter back in costs no read; every other
  hold is dropped at once, so the tier may evict it. Unloaded and stale
  versions are never kept. The held copy is what was validated: a file
  changed on disk is served once reloaded (``load``), as before.
- Churn is time-sliced: when the oldest waiter of an adapter (a new request,
  or parked ones) finds every slot pinned, one ready slot is reserved for it
  (``_drains``: the one whose tenant has held it longest). Its tenant keeps
  serving, new requests on it included, until it has had its ``quantum``
  of planned steps since its install (``step`` counts them), the turns of
  the slots ending staggered; then its admitted
  choices are parked (``MoveRows(..., PARKED)``: they keep their KV and state
  and leave the plans), the slot is free, and the waiter's install takes it.
  The parked choices wait like a request, in the order they were parked, and
  resume (``MoveRows`` to the new slot, as a request is admitted) where
  their adapter is installed next. So a waiter waits at most for the turns of
  the tenants before it, a quantum each, never for requests to end: with a
  swap back in costing a copy (the ranks keep each adapter's image), the
  batch keeps every adapter's requests moving. When nothing can run (every
  live choice parked), ``stalled`` ends the quantum at once. At most
  ``max_drains`` slots are reserved or installing at once (an install in
  flight serves no row): the others keep the batch running. A reservation is
  dropped when its waiters are gone.
- The reader answers reads in the order they were sent (one at a time), so
  answers are matched to ``_reads`` first in, first out.
- A reload under a served name changes the adapter's digest: new and still
  waiting requests use the new version; admitted ones keep their slot (the
  slot table finds a slot by name and digest). The prefix root names the digest, so no KV block
  is shared across versions or adapters.
- An unloaded adapter's waiting, running and parked requests finish; new
  requests naming it get 404. Where runtime updates are on, a served
  adapter whose files no longer give a valid one (its host copy dropped,
  then the read for an install failed) is unloaded so: its waiters get that
  404 with the reader's reason, its running and parked choices finish on
  their held copy. A read the machine failed, or one with no way to load the adapter
  again, fails its waiters (500) and keeps it; a load queued under its name
  takes its waiters.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from mstar_actors.lora.slot_table import SlotState, SlotTable
from mstar_actors.sched.scheduler import PARKED
from mstar_actors.messages import (
    AdapterHostRef,
    AdapterInfo,
    AdapterInstalled,
    AdapterRead,
    AdapterReadFailed,
    AdapterUpdate,
    DropAdapter,
    Failed,
    Finished,
    InstallAdapter,
    LoadAdapter,
    ModelsChanged,
    Prepared,
    ReadAdapter,
    UnloadAdapter,
    choice_ids,
)


def lora_root(base: str, digest: str) -> str:
    """The prefix-cache root of a request on an adapter: KV is keyed by the weights."""
    return f"{base}+lora:{digest}"


@dataclass(frozen=True)
class Admit:
    """Hand ``prepared`` to the scheduler: rows run on ``slot`` with KV under ``root``."""

    prepared: Prepared
    slot: int
    root: str


@dataclass(frozen=True)
class MoveRows:
    """Set admitted choices' LoRA slot in the scheduler: ``slot``, or ``PARKED``."""

    request_ids: tuple[str, ...]
    slot: int


@dataclass(eq=False)
class _Adapter:
    name: str
    path: str
    digest: str = ""  # known after the first read; a reload changes it
    confined: bool = False  # loaded at runtime: every read of it stays inside lora.adapter_dirs
    is_reading: bool = False  # a read for an install is in flight


@dataclass(eq=False)
class _Waiting:
    """A request for its adapter's slot, or (``parked``) admitted choices whose
    slot was taken, waiting for the version ``digest`` they ran on."""

    prepared: Prepared | None
    adapter: _Adapter
    slot: int | None = None  # pinned while its install is in flight (once per parked choice)
    parked: tuple[str, ...] = ()
    digest: str = ""


def _version(w: _Waiting) -> tuple[str, str]:
    """The (name, digest) a waiter needs: its parked choices' own, or its adapter's served one."""
    return w.adapter.name, w.digest or w.adapter.digest


@dataclass(frozen=True)
class _Read:
    name: str
    path: str
    load_id: str | None  # the LoadAdapter's request id; None: a read for an install
    confined: bool  # a runtime load's: its files only inside lora.adapter_dirs (``ReadAdapter.confined``)
    adapter: _Adapter | None = None  # an install's: the adapter that asked (an unload and a load of the name
    # may come before the answer: its waiters then are the new adapter's, and the read is this one's)


@dataclass
class _Host:
    ref: AdapterHostRef
    num_holds: int = 0
    last_used: int = 0  # for keeping the most recently installed copies held


# Planned steps a slot's tenant keeps it, from its install, before a waiter
# reserving it parks its rows: at least QUANTUM_STEPS, and TURNS_PER_INSTALL
# times what installs take (in planned steps, measured from send to the last
# ack), so swaps keep a small share of the slot's time. A swap back in is a
# copy (about 2 ms on the H200, a step or less); a waiter waits about a turn
# for each tenant before it (``tests/lora/churn_sim.py``).
QUANTUM_STEPS = 16
TURNS_PER_INSTALL = 8


@dataclass
class AdapterPool:
    base: str  # the base model's served name
    max_loras: int
    num_ranks: int = 1
    allow_runtime_updates: bool = False
    max_cpu_loras: int = 0  # the reader's host tier; copies kept held for a quick reinstall
    quantum_steps: int = QUANTUM_STEPS

    def __post_init__(self) -> None:
        self.table = SlotTable(self.max_loras, self.num_ranks)
        self.adapters: dict[str, _Adapter] = {}
        self._waiting: list[_Waiting] = []  # arrival order
        self._slot_of: dict[str, int] = {}  # admitted choice id -> slot (0: base)
        self._slot_digest: dict[int, str] = {}  # the digest each install put in a slot
        self._installing: dict[int, tuple[str, str]] = {}  # slot -> (name, digest) whose acks are not all in
        self._follows: set[int] = set()  # installing slots sent with rows_follow: their rows are admitted already
        self._kept: dict[int, frozenset[str]] = {}  # rank -> the digests its last answer says it keeps images of
        self._reads: collections.deque[_Read] = collections.deque()
        self._hosts: dict[tuple[str, str], _Host] = {}  # (name, digest) -> held host copy
        # slot -> the version (name, digest) whose waiter it is reserved for (a name's versions may wait apart:
        # choices parked before a reload, new requests after it)
        self._drains: dict[int, tuple[str, str]] = {}
        # Half the slots may be out of service (reserved or installing) at once,
        # at least one: the rest keep the batch busy.
        self.max_drains = max(1, self.max_loras // 2)
        self._tick = 0
        self._steps = 0  # steps planned so far (``step``): the clock of the quanta
        self._tenancy: dict[int, int] = {}  # slot -> the step its tenant's install was acknowledged
        self._install_sent: dict[int, int] = {}  # slot -> the step its install in flight was sent
        self._last_park = -(1 << 30)  # the step of the last park
        self.install_steps = 1.0  # what installs take, in planned steps (a running mean)

    @classmethod
    def from_config(cls, config, base: str, num_ranks: int) -> AdapterPool:
        lora = config.lora
        pool = cls(base, lora.max_loras, num_ranks, lora.allow_runtime_updates, lora.max_cpu_loras)
        for name, path in lora.adapters.items():
            pool.adapters[name] = _Adapter(name, path)
        return pool

    # ------------------------------------------------------------ queries

    @property
    def num_waiting(self) -> int:
        """Choices held for their adapter (the scheduler's gauges count choices
        too; parked ones are the scheduler's)."""
        return sum(w.prepared.n for w in self._waiting if w.prepared is not None)

    def adapter_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(running, waiting), each sorted: the adapters whose choices are
        admitted to a slot, and those whose choices wait for one (parked
        ones too): vLLM's ``vllm:lora_requests_info`` labels."""
        running = {self.table.name_of(slot) for slot in set(self._slot_of.values()) if slot}  # (a few slots)
        return tuple(sorted(running)), tuple(sorted({w.adapter.name for w in self._waiting}))

    @property
    def quantum(self) -> float:
        """A tenant's turn, in planned steps (see ``QUANTUM_STEPS``)."""
        return max(self.quantum_steps, TURNS_PER_INSTALL * self.install_steps)

    @property
    def num_out_of_service(self) -> int:
        """Slots taken for a swap: reserved for a waiter, or installing (a
        swap whose rows follow it serves already)."""
        return len(self._drains) + len(self._installing.keys() - self._follows)

    def served(self) -> list[AdapterInfo]:
        return [AdapterInfo(a.name, a.path, a.digest) for a in sorted(self.adapters.values(), key=lambda a: a.name)]

    # ------------------------------------------------------------ requests

    def step(self) -> list:
        """A step was planned: the clock of the quanta. Returns what a
        quantum's end moves; its installs ride in that plan
        (``StepPlan.install_after``: every rank runs the step before the
        swap), the rest is routed after it."""
        self._steps += 1
        return self._settle() if any(self._turn_over(slot) for slot in self._drains) else []

    def stalled(self) -> list:
        """Nothing can run, yet choices are live (every one parked, or
        waiting for a slot): reserved slots' tenants are parked now."""
        return self._settle(end_quanta=True)

    def add(self, req: Prepared) -> list:
        if req.model == self.base:
            self._slot_of.update(dict.fromkeys(choice_ids(req.request_id, req.n), 0))
            return [Admit(req, 0, self.base)]
        adapter = self.adapters.get(req.model)
        if adapter is None:
            served = ", ".join([self.base, *sorted(self.adapters)])
            return [Failed(request_id=req.request_id, status=404, param="model", code="model_not_found",
                           error_type="invalid_request_error",
                           message=f"the model {req.model!r} does not exist; served models: {served}")]
        self._waiting.append(_Waiting(req, adapter))
        return self._settle()

    def abort(self, request_id: str) -> list:
        """A waiting request ends here; an admitted one is the scheduler's (see ``end``)."""
        w = next((w for w in self._waiting if w.prepared is not None and w.prepared.request_id == request_id), None)
        if w is None:
            return []
        self._waiting.remove(w)
        if w.slot is not None:
            self.table.unpin(w.slot)
        num_prompt = len(w.prepared.prompt_token_ids)
        finished = [Finished(request_id=rid, finish_reason="abort", num_prompt_tokens=num_prompt, num_output_tokens=0)
                    for rid in choice_ids(request_id, w.prepared.n)]
        return [*finished, *self._settle()]

    def end(self, request_id: str) -> list:
        """The scheduler ended (finished or failed) an admitted choice: unpin
        its slot; or a whole request of several choices (its refusal, such as
        a prompt past max_model_len): each of them."""
        slot = self._slot_of.pop(request_id, None)
        if slot is None:
            choices = [rid for rid in self._slot_of if rid.startswith(f"{request_id}-")
                       and rid[len(request_id) + 1:].isdigit()]
            if choices:  # (their pins were kept, and the ids, for ever: an adapter's slot stayed taken)
                return [out for rid in choices for out in self.end(rid)]
            return self._end_parked(request_id)
        if not slot:
            return []
        self.table.unpin(slot)
        return self._settle()

    def _end_parked(self, request_id: str) -> list:
        w = next((w for w in self._waiting if request_id in w.parked), None)
        if w is None:
            return []
        w.parked = tuple(rid for rid in w.parked if rid != request_id)
        if w.slot is not None:
            self.table.unpin(w.slot)
        if not w.parked:
            self._waiting.remove(w)
        return self._settle()

    # ------------------------------------------------------------ reader answers

    def on_read(self, msg: AdapterRead) -> list:
        read = self._pop_read(msg.name)
        self._hold(msg)
        if read.load_id is not None:
            return [*self._loaded(read, msg), *self._settle()]
        read.adapter.is_reading = False
        if read.adapter.path == read.path:  # else a reload overtook this read: keep the reload's digest
            read.adapter.digest = msg.digest
        return self._settle()

    def on_read_failed(self, msg: AdapterReadFailed) -> list:
        read = self._pop_read(msg.name)
        if read.load_id is not None and msg.code == "adapter_path_not_allowed":  # where it resolved stays unsaid
            return [AdapterUpdate(request_id=read.load_id, status=403, code=msg.code,
                                  message=f"adapter {read.name!r} was refused: {msg.message}")]
        if read.load_id is not None:
            return [AdapterUpdate(request_id=read.load_id, status=400, code="invalid_adapter",
                                  message=f"adapter {read.name!r} at {read.path} was refused: {msg.message}")]
        outs = []
        read.adapter.is_reading = False
        if any(r.name == read.name and r.load_id for r in self._reads):
            return self._settle()  # a load of the name is queued: its waiters go with it (``_loaded``)
        # Where runtime updates are on, a served adapter whose files no longer give one is unloaded (read
        # again, they would fail again): /v1/models stops listing it, and an operator loads it again. A
        # failed read of the machine's (no room in shared memory), or with no way to load it again, keeps it.
        served = self.adapters.get(read.name)
        unload = (served is not None and served.path == read.path and self.allow_runtime_updates
                  and msg.code in ("invalid_adapter", "adapter_path_not_allowed"))  # the files' fault
        if unload:
            del self.adapters[read.name]
            outs.append(ModelsChanged(adapters=self.served()))
        gone = (f"the model {read.name!r} was unloaded: its files could not be read again ({msg.message}); "
                f"served models: {', '.join([self.base, *sorted(self.adapters)])}; load it again with "
                "POST /v1/load_lora_adapter once its files are back")
        # Its waiters end: new requests, and parked choices whose copy was dropped (their streams would
        # otherwise wait for ever).
        for w in [w for w in self._waiting if w.adapter is read.adapter and w.slot is None]:
            self._waiting.remove(w)
            if w.parked:
                outs.extend(self._fail_parked(w, None, f"its files could not be read again: {msg.message}"))
            elif unload:
                outs.append(Failed(request_id=w.prepared.request_id, status=404, param="model",
                                   code="model_not_found", error_type="invalid_request_error", message=gone))
            else:
                outs.append(self._fail(w, 500, f"adapter {read.name!r} could not be read: {msg.message}"))
        return [*outs, *self._settle()]

    # ------------------------------------------------------------ rank acks

    def on_installed(self, msg: AdapterInstalled) -> list:
        self._kept[msg.rank] = frozenset(msg.kept)
        settled = self.table.ack(msg.rank, msg.slot, msg.digest, msg.ok, msg.error)
        if settled is None:
            return []
        self._installing.pop(settled.slot, None)
        followed = settled.slot in self._follows
        self._follows.discard(settled.slot)
        sent = self._install_sent.pop(settled.slot, self._steps)
        if settled.ok:
            self._tenancy[settled.slot] = self._steps
            self.install_steps = 0.5 * self.install_steps + 0.5 * max(1, self._steps - sent)
        outs = [] if settled.ok or not followed else self._fail_followed(settled)
        for w in [w for w in self._waiting if w.slot == settled.slot]:
            self._waiting.remove(w)
            if w.parked:
                outs.extend(self._resume(w, settled.slot) if settled.ok else self._fail_parked(w, settled))
            elif settled.ok:
                outs.append(self._admit(w, settled.slot))
            else:
                reason = "; ".join(f"rank {r}: {e}" for r, e in sorted(settled.errors.items()))
                self.table.unpin(settled.slot)
                outs.append(self._fail(w, 500, f"adapter {w.adapter.name!r} could not be installed "
                                               f"(refused on every rank): {reason}"))
        return [*outs, *self._settle()]

    def _fail_followed(self, settled) -> list:
        """An install sent with ``rows_follow`` failed on some rank: the choices
        admitted onto its slot meanwhile end as failed, before the results of
        any step they ran in are used (each rank answers the install before
        those steps), so nothing they computed reaches a client or the prefix
        cache. The failing rank ran them on a zeroed slot, as the others ran
        them (the worker's ``void_slot``: every rank runs the same batch).
        Their pins go with their ends (``end``)."""
        reason = "; ".join(f"rank {r}: {e}" for r, e in sorted(settled.errors.items()))
        return [Failed(request_id=rid, status=500, error_type="server_error", param="model",
                       message=f"adapter {settled.name!r} could not be installed: {reason}")
                for rid, slot in self._slot_of.items() if slot == settled.slot]

    # ------------------------------------------------------------ runtime updates

    def load(self, msg: LoadAdapter) -> list:
        refusal = self._check_update(msg.request_id, msg.name)
        if refusal is not None:
            return [refusal]
        loading = any(r.name == msg.name and r.load_id for r in self._reads)
        if not msg.replace and (msg.name in self.adapters or loading):
            return [AdapterUpdate(request_id=msg.request_id, status=400, code="adapter_already_loaded",
                                  message=f"lora_name: the adapter {msg.name!r} is already loaded (or being loaded); "
                                          "send load_inplace: true to replace it")]
        return [self._read(msg.name, msg.path, msg.request_id, confined=True)]  # the frontend resolved it (lora.paths)

    def unload(self, msg: UnloadAdapter) -> list:
        refusal = self._check_update(msg.request_id, msg.name)
        if refusal is not None:
            return [refusal]
        if self.adapters.pop(msg.name, None) is None:
            return [AdapterUpdate(request_id=msg.request_id, status=404, code="model_not_found",
                                  message=f"the LoRA adapter {msg.name!r} cannot be found; "
                                          f"served adapters: {', '.join(sorted(self.adapters)) or 'none'}")]
        done = AdapterUpdate(request_id=msg.request_id, status=200,
                             message=f"Success: LoRA adapter '{msg.name}' removed successfully.")
        # every frontend hears of the change before the client its answer: a request through another one
        # right after the 200 finds the model list changed
        return [ModelsChanged(adapters=self.served()), done, *self._settle()]

    def _check_update(self, request_id: str, name: str) -> AdapterUpdate | None:
        if not self.allow_runtime_updates:
            return AdapterUpdate(request_id=request_id, status=403, code="runtime_updates_disabled",
                                 message="runtime LoRA updates are off; set lora.allow_runtime_updates: true")
        if not name or name == self.base:
            return AdapterUpdate(request_id=request_id, status=400, code="invalid_adapter_name",
                                 message=f"lora_name {name!r}: name an adapter, not the base model {self.base!r}")
        return None

    def _loaded(self, read: _Read, msg: AdapterRead) -> list:
        adapter = self.adapters.get(read.name)
        if adapter is None:  # (unloaded meanwhile, or new): requests still waiting on the name take this one
            adapter = self.adapters[read.name] = _Adapter(read.name, read.path, confined=read.confined)
            for w in self._waiting:
                if w.prepared is not None and w.adapter.name == read.name:
                    w.adapter = adapter
        adapter.path, adapter.digest, adapter.confined = read.path, msg.digest, read.confined
        done = AdapterUpdate(request_id=read.load_id, status=200,
                             message=f"Success: LoRA adapter '{read.name}' added successfully.")
        return [ModelsChanged(adapters=self.served()), done]  # the frontends first (see ``unload``)

    # ------------------------------------------------------------ placing waiting requests

    def _settle(self, end_quanta: bool = False) -> list:
        """Place every waiting request (and parked choices) that can move, in
        arrival order; park the tenants of reserved slots whose quantum is
        over, and place again into what they left; then release host copies
        nothing needs any more."""
        outs = []
        while True:
            self._forget_drains()
            for w in list(self._waiting):
                if w.slot is None:
                    outs.extend(self._place_parked(w) if w.parked else self._place(w))
            parked = self._park_due(end_quanta)
            if not parked:
                break
            outs.extend(parked)
        return [*outs, *self._release_unneeded()]

    def _place(self, w: _Waiting) -> list:
        adapter = w.adapter
        slot = self._resident_slot(adapter)
        if slot is not None:  # reserved for another or not, its rows run until its tenant's turn ends
            return self._pin_existing(w, adapter)
        if not adapter.digest or (adapter.name, adapter.digest) not in self._hosts:
            return [*self._ensure_read(adapter), *self._reserve_drain(_version(w))]
        slot = self.table.acquire(adapter.name, adapter.digest, exclude=self._reserved_for_others(_version(w)))
        if slot is None:
            return self._reserve_drain(_version(w))  # every slot pinned or installing: wait for an end or an ack
        w.slot = slot
        self._drains = {s: target for s, target in self._drains.items() if target != _version(w)}
        self._hosts[adapter.name, adapter.digest].last_used = self._next_tick()
        installs = self._take_installs()
        if any(install.slot == slot and install.rows_follow for install in installs):
            self._waiting.remove(w)  # a swap every rank makes before its next plan: the rows may be in it
            return [*installs, self._admit(w, slot)]
        return installs

    def _resident_slot(self, adapter: _Adapter, digest: str | None = None) -> int | None:
        """The slot holding (or installing) this version of the adapter (``digest``: that one)."""
        digest = adapter.digest if digest is None else digest
        return self.table.lookup(adapter.name, digest) if digest else None

    # ------------------------------------------------------------ parking

    def _park_due(self, end_quanta: bool) -> list:
        """Park the rows of every reserved slot whose tenant had its quantum
        (any, with ``end_quanta``): the slot is free for its waiter. Parks
        are spaced a quantum over the slots apart, so the slots' turns end
        in a staggered round (two ending together would hand each other
        their tenants: a swap for nothing)."""
        outs = []
        for slot in list(self._drains):
            if self.table.state(slot) is not SlotState.READY or not (end_quanta or self._turn_over(slot)):
                continue
            ids = tuple(rid for rid, s in self._slot_of.items() if s == slot)
            if not ids:
                continue  # empty already: the waiter takes it
            name, digest = self.table.name_of(slot), self._slot_digest[slot]
            for rid in ids:
                del self._slot_of[rid]
                self.table.unpin(slot)
            adapter = self.adapters.get(name)
            if adapter is None or adapter.digest != digest:  # unloaded or reloaded: the parked keep their version
                adapter = _Adapter(name, "", digest)
            self._waiting.append(_Waiting(None, adapter, parked=ids, digest=digest))
            outs.append(MoveRows(ids, PARKED))
            self._last_park = self._steps
        return outs

    def _turn_over(self, slot: int) -> bool:
        """Whether the tenant of reserved ``slot`` had its quantum, and the last park is far enough back."""
        return (self._steps - self._tenancy.get(slot, 0) >= self.quantum
                and self._steps - self._last_park >= self.quantum / self.max_loras)

    def _place_parked(self, w: _Waiting) -> list:
        """Parked choices back on a slot of their version: the resident one
        (unless reserved for another waiter: its tenant is about to go), or
        an install; else a reservation of their own."""
        name, digest = w.adapter.name, w.digest
        slot = self._resident_slot(w.adapter, digest)
        if slot is not None:
            if self._drains.get(slot, _version(w)) != _version(w):
                return []
            return self._pin_parked(w, self.table.acquire(name, digest))
        if (name, digest) not in self._hosts:  # dropped before the park (past the reader's tier): read again
            if w.adapter.path and w.adapter.digest == digest:
                return [*self._ensure_read(w.adapter), *self._reserve_drain(_version(w))]
            self._waiting.remove(w)  # unloaded or reloaded since: that version is gone
            return self._fail_parked(w, None)
        slot = self.table.acquire(name, digest, exclude=self._reserved_for_others(_version(w)))
        if slot is None:
            return self._reserve_drain(_version(w))
        self._drains = {s: target for s, target in self._drains.items() if target != _version(w)}
        self._hosts[name, digest].last_used = self._next_tick()
        installs = self._take_installs()  # first: whether its rows may follow at once
        return [*installs, *self._pin_parked(w, slot)]

    def _pin_parked(self, w: _Waiting, slot: int) -> list:
        """The parked choices pin ``slot`` (acquired once: one pin more each
        after the first); resumed at once where it is ready or its swap's
        rows may follow (``rows_follow``)."""
        for _ in w.parked[1:]:
            self.table.pin(slot)
        state = self.table.state(slot)
        if state is SlotState.INSTALLING and slot not in self._follows:
            w.slot = slot  # resumed when every rank has answered
            return []
        self._waiting.remove(w)
        if state is not SlotState.FAILED:  # ready, or a swap its rows may follow
            return self._resume(w, slot)
        w.slot = slot  # failed on some rank (every ack in): the parked choices end
        return self._fail_parked(w, None, self.table.error(slot))

    def _resume(self, w: _Waiting, slot: int) -> list:
        for rid in w.parked:
            self._slot_of[rid] = slot
        return [MoveRows(w.parked, slot)]

    def _fail_parked(self, w: _Waiting, settled, reason: str = "") -> list:
        """Parked choices whose version cannot be installed again end as failed."""
        if w.slot is not None:
            for _ in w.parked:
                self.table.unpin(w.slot)
        if settled is not None:
            reason = "; ".join(f"rank {r}: {e}" for r, e in sorted(settled.errors.items()))
        reason = reason or "that version is no longer served"
        return [Failed(request_id=rid, status=500, error_type="server_error", param="model",
                       message=f"adapter {w.adapter.name!r} could not be installed again after its "
                               f"slot was lent to another adapter: {reason}") for rid in w.parked]

    def _take_installs(self) -> list:
        outs = []
        for install in self.table.take_installs():
            host = self._hosts[install.name, install.digest].ref
            follows = self._is_swap(install.digest)
            if follows:
                self._follows.add(install.slot)
            self._slot_digest[install.slot] = install.digest
            self._installing[install.slot] = (install.name, install.digest)
            self._install_sent[install.slot] = self._steps
            outs.append(InstallAdapter(slot=install.slot, name=install.name, digest=install.digest, host=host,
                                       rows_follow=follows))
        return outs

    def _is_swap(self, digest: str) -> bool:
        """Whether an install of ``digest`` sent now is a swap on every rank,
        done before the rank reads its next message: each rank's last answer
        says it keeps the image, and with no install in flight nothing has
        changed what a rank keeps since (only installs do)."""
        return (not self._installing and len(self._kept) == self.num_ranks
                and all(digest in kept for kept in self._kept.values()))

    # ------------------------------------------------------------ drains

    def _reserve_drain(self, version: tuple[str, str]) -> list:
        """The oldest waiter of ``version`` found no slot: reserve the ready slot
        whose tenant has held it longest, to be parked at its quantum's end
        (``_park_due``) and installed for the waiter. Called in arrival order,
        so older waiters reserve first. At most ``max_drains`` slots are
        reserved or installing at once, so the batch keeps running on the
        others. A waiter that found none to reserve tries again at the next
        event (an ack, an end), so it is never forgotten."""
        if version in self._drains.values() or self.num_out_of_service >= self.max_drains:
            return []
        if self.table.num_free(exclude=self._reserved_for_others(version)) > 0:
            return []  # a slot is takeable already; only the host copy is missing
        kept = frozenset(s for s in range(1, self.max_loras + 1) if not self._parkable(s))
        slot = self.table.pick_drain(exclude=kept | frozenset(self._drains), key=lambda s: self._tenancy.get(s, 0))
        if slot is not None:
            self._drains[slot] = version
        return []

    def _parkable(self, slot: int) -> bool:
        """Whether the version on ``slot`` could be installed again for its rows, parked: its host copy is
        held, or it is still served (read again). An unloaded or reloaded one whose copy is gone (admitted on
        its resident slot, none was held) runs on until its rows end."""
        name, digest = self.table.name_of(slot), self._slot_digest.get(slot)
        adapter = self.adapters.get(name)
        return (name, digest) in self._hosts or (adapter is not None and adapter.digest == digest)

    def _reserved_for_others(self, version: tuple[str, str]) -> frozenset[int]:
        return frozenset(slot for slot, target in self._drains.items() if target != version)

    def _forget_drains(self) -> None:
        """Drop drains whose reason is gone: no waiter of the target needs a
        slot any more (admitted, installing, aborted, failed, or unloaded),
        the slot left the ready state (reloaded, freed), or its rows could no
        longer come back once parked (``_parkable``)."""
        needy = {_version(w) for w in self._waiting if w.slot is None}
        self._drains = {slot: target for slot, target in self._drains.items()
                        if target in needy and self.table.state(slot) is SlotState.READY and self._parkable(slot)}

    def _pin_existing(self, w: _Waiting, adapter: _Adapter) -> list:
        slot = self.table.acquire(adapter.name, adapter.digest)
        state = self.table.state(slot)
        follows = state is SlotState.INSTALLING and slot in self._follows  # a swap its rows may follow
        if state is SlotState.READY or follows:
            self._waiting.remove(w)
            return [self._admit(w, slot)]
        if state is SlotState.FAILED:
            self._waiting.remove(w)
            error = self.table.error(slot)
            self.table.unpin(slot)
            return [self._fail(w, 500, f"adapter {adapter.name!r} could not be installed: {error}")]
        w.slot = slot  # installing: admitted when every rank has answered
        return []

    def _ensure_read(self, adapter: _Adapter) -> list:
        if adapter.is_reading:
            return []
        adapter.is_reading = True
        return [self._read(adapter.name, adapter.path, None, adapter.confined, adapter)]

    def _read(self, name: str, path: str, load_id: str | None, confined: bool,
              adapter: _Adapter | None = None) -> ReadAdapter:
        self._reads.append(_Read(name, path, load_id, confined, adapter))
        return ReadAdapter(name=name, path=path, refresh=load_id is not None, confined=confined)

    def _admit(self, w: _Waiting, slot: int) -> Admit:
        """The request's pin becomes its first choice's; each other choice pins once more."""
        for index, rid in enumerate(choice_ids(w.prepared.request_id, w.prepared.n)):
            if index:
                self.table.pin(slot)
            self._slot_of[rid] = slot
        return Admit(w.prepared, slot, lora_root(self.base, self._slot_digest[slot]))

    @staticmethod
    def _fail(w: _Waiting, status: int, message: str) -> Failed:
        error_type = "server_error" if status >= 500 else "invalid_request_error"
        return Failed(request_id=w.prepared.request_id, status=status, error_type=error_type, param="model",
                      message=message)

    # ------------------------------------------------------------ host copies

    def _pop_read(self, name: str) -> _Read:
        if not self._reads or self._reads[0].name != name:
            expected = self._reads[0].name if self._reads else "nothing"
            raise RuntimeError(f"adapter-reader answered {name!r} while {expected!r} was due: "
                               f"the reader must answer reads in order")
        return self._reads.popleft()

    def _hold(self, msg: AdapterRead) -> None:
        host = self._hosts.setdefault((msg.name, msg.digest), _Host(msg.host))
        host.num_holds += 1
        host.last_used = self._next_tick()

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _release_unneeded(self) -> list:
        """Drop the holds nothing needs, except on the most recently used copies
        of served versions while they fit the reader's tier: a swap back then
        installs at once, with no read round trip."""
        needed = set(self._installing.values())
        needed.update(_version(w) for w in self._waiting if w.slot is None)
        served = {(a.name, a.digest) for a in self.adapters.values() if a.digest}
        # the versions admitted rows run on: parked, they install it again, and once the name is unloaded or
        # reloaded (which may come while they run) no file gives it back
        needed.update((self.table.name_of(slot), self._slot_digest[slot])
                      for slot in set(self._slot_of.values()) if slot in self._slot_digest)
        spare = [key for key in self._hosts if key not in needed]
        warm = sorted((key for key in spare if key in served), key=lambda key: -self._hosts[key].last_used)
        keep = set(warm[:max(0, self.max_cpu_loras - len(self._hosts) + len(spare))])
        outs = []
        for name, digest in [key for key in spare if key not in keep]:
            host = self._hosts.pop((name, digest))
            outs.extend(DropAdapter(name=name, digest=digest) for _ in range(host.num_holds))
        return outs
