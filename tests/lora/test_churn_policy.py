"""The churn policy's swap limit: a reserved slot and an install in flight
both count, and at most half the slots are out at once, so the requests
that arrive while one slot swaps still run on the others. Pure pool; then
the policy simulation (churn_sim.py) as a regression check."""

from __future__ import annotations

import churn_sim as sim
import pytest
from test_lora_churn import Driver, churn_and_calm


class Pool(Driver):
    """The churn tests' driver over adapters a, b, c, with reads answered at
    once and installs only when the test acks them."""

    def __init__(self, max_loras: int = 2, names: str = "abc"):
        super().__init__(max_loras=max_loras, names=names, max_cpu_loras=4)

    def handle(self, outs: list) -> None:
        super().handle(outs)
        self.answer_reads()

    def ack_all(self) -> None:
        self.ack_installs()

    def slot(self, name: str) -> int | None:
        return self.slot_of_adapter(name)


def resident_ab() -> Pool:
    p = Pool()
    p.send("a1", "a")
    p.send("b1", "b")
    p.ack_all()
    assert p.admitted == {"a1": p.slot("a"), "b1": p.slot("b")}
    return p


def test_no_drain_while_an_install_has_the_only_spare_slot():
    """The clients of the rows that just ended send their next requests while
    the freed slot installs: the other slot keeps taking them instead of
    being drained too (which would leave no slot serving for the install's
    length, and strand those requests for a whole request more)."""
    p = resident_ab()
    slot_a, slot_b = p.slot("a"), p.slot("b")
    p.send("c1", "c")
    assert p.adapter_pool.num_out_of_service == 1  # a's slot drains for c1
    p.end("a1")  # the drain is done: c installs into a's slot
    assert [i.name for i in p.unacked] == ["c"] and p.unacked[0].slot == slot_a
    p.send("a2", "a")  # a is gone now: it waits ...
    p.send("b2", "b")  # ... but b's slot is not drained for it while c installs
    assert p.admitted.get("b2") == slot_b and "a2" not in p.admitted
    assert p.adapter_pool.num_out_of_service == 1


def test_the_waiter_reserves_once_the_install_is_in_and_gets_the_slot_at_the_turns_end():
    """The held-back reservation is only delayed, never forgotten: the ack
    lets the waiter reserve a slot (the one whose tenant has held it
    longest, b's), whose tenant keeps taking rows until its turn ends; then
    its rows are parked and the waiter gets the slot."""
    p = resident_ab()
    slot_b = p.slot("b")
    p.send("c1", "c")
    p.end("a1")  # a's slot frees: c installs there
    p.send("a2", "a")  # a is gone: it waits, and reserves nothing while c installs
    assert p.adapter_pool.num_out_of_service == 1 and "a2" not in p.admitted
    p.ack_all()  # c is in: a2 reserves b's slot
    assert "c1" in p.admitted and p.adapter_pool.num_out_of_service == 1
    p.send("b2", "b")
    assert p.admitted.get("b2") == slot_b
    p.step(int(p.adapter_pool.quantum))
    p.ack_all()
    assert p.admitted.get("a2") == slot_b and p.parked == {"b1", "b2"}


def test_half_of_a_larger_pool_may_swap_at_once():
    """Four slots: a drain and an install are two out of service, so a third
    waiter waits without draining either of the two slots still serving."""
    p = Pool(max_loras=4, names="abcdef")
    for name in "abcd":
        p.send(f"{name}1", name)
    p.ack_all()
    p.send("e1", "e")
    p.send("f1", "f")  # two drains: the least recently used slots, a's and b's
    p.end("a1")  # e installs into a's slot; f still drains b's
    assert [i.name for i in p.unacked] == ["e"] and p.adapter_pool.num_out_of_service == 2
    p.send("a2", "a")
    p.send("c2", "c")
    p.send("d2", "d")
    assert "a2" not in p.admitted and p.admitted.get("c2") == p.slot("c") and p.admitted.get("d2") == p.slot("d")


# ---- the policy benchmark ----------------------------------------------------------


@pytest.mark.parametrize("install_steps, floor", [(1, 0.65), (5, 0.58)])
@pytest.mark.parametrize("concurrency", [8, 32])
def test_churn_keeps_two_thirds_of_the_batch_with_a_bounded_wait(concurrency, install_steps, floor):
    """3 adapters round robin over 2 slots, 64-token requests; a swap back in
    takes a step (inline on the ranks), an install from a host copy several.
    Two adapters of three run at any time, so about two thirds of the
    no-churn tokens per step is the ceiling; the turns grow with the installs'
    length, so slow ones cost a little more. Under the drain policy before
    the time slices: 51% at two waves, and a wait of a whole request."""
    kw = dict(max_tokens=64, install_steps=install_steps, read_steps=1, waves=2)
    churn, calm = churn_and_calm(concurrency, kw)
    assert churn.tokens_per_step >= floor * calm.tokens_per_step
    # A waiter waits for the turn in progress, the one staggered before it, then its install.
    quantum = max(16, 8 * install_steps)
    assert max(churn.ttft_steps) <= quantum + quantum // 2 + install_steps + kw["read_steps"] + 2


def test_sim_refuses_a_client_faster_than_the_conductor():
    with pytest.raises(ValueError, match="client_steps must be >= 1"):
        sim.simulate(2, max_tokens=4, num_requests=4, client_steps=0)


def test_adapter_names_are_those_of_admitted_choices_and_of_waiters():
    """``vllm:lora_requests_info``'s labels: admitted (running) and waiting adapters, parked choices waiting."""
    p = resident_ab()
    assert p.adapter_pool.adapter_names() == (("a", "b"), ())
    p.send("c1", "c")  # no free slot: c waits
    assert p.adapter_pool.adapter_names() == (("a", "b"), ("c",))
    p.end("a1")
    p.end("b1")
    p.settle()
    running, waiting = p.adapter_pool.adapter_names()
    assert running == ("c",) and waiting == () and p.admitted.get("c1") is not None
    p.end("c1")
    assert p.adapter_pool.adapter_names() == ((), ())
