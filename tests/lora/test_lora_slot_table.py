"""The slot table: picks, pins, LRU reuse, all-rank acks, reloads, failures."""

from __future__ import annotations

import pytest

from mstar_actors.lora import ZERO_SLOT, SlotInstall, SlotState, SlotTable


def make_table(max_loras: int = 2, num_ranks: int = 1) -> SlotTable:
    return SlotTable(max_loras=max_loras, num_ranks=num_ranks)


def ready(table: SlotTable, name: str, digest: str = "d") -> int:
    """Acquire ``name`` and ack its install on every rank; returns the pinned slot."""
    slot = table.acquire(name, digest)
    assert slot is not None
    for install in table.take_installs():
        for rank in range(table.num_ranks):
            table.ack(rank, install.slot, install.digest, ok=True)
    assert table.is_ready(slot)
    return slot


def test_zero_slot_is_never_handed_out():
    table = make_table(max_loras=1)
    assert table.num_slots == 2
    assert table.acquire("a", "d") == 1
    assert table.is_ready(ZERO_SLOT)
    table.unpin(ZERO_SLOT)  # base rows pin nothing; a no-op


def test_acquire_installs_once_and_shares_the_slot():
    table = make_table()
    first = table.acquire("a", "d1")
    assert table.state(first) is SlotState.INSTALLING
    assert table.acquire("a", "d1") == first
    assert table.take_installs() == [SlotInstall(first, "a", "d1")]
    assert table.take_installs() == []
    assert table.num_pins(first) == 2
    assert not table.is_ready(first)


def test_ready_only_when_every_rank_acks_the_same_digest():
    table = make_table(num_ranks=3)
    slot = table.acquire("a", "d1")
    assert table.ack(0, slot, "d1", ok=True) is None
    assert table.ack(1, slot, "stale", ok=True) is None  # another install's ack: ignored
    assert table.ack(2, slot, "d1", ok=True) is None
    assert table.state(slot) is SlotState.INSTALLING
    settled = table.ack(1, slot, "d1", ok=True)
    assert settled.ok and settled.slot == slot and settled.name == "a"
    assert table.is_ready(slot)


def test_one_rank_failing_refuses_the_adapter_on_every_rank():
    table = make_table(num_ranks=2)
    slot = table.acquire("a", "d1")
    assert len(table.take_installs()) == 1
    assert table.ack(1, slot, "d1", ok=False, error="out of memory") is None
    assert table.state(slot) is SlotState.FAILED
    # A request arriving meanwhile gets the failed slot, to fail at once.
    assert table.acquire("a", "d1") == slot
    settled = table.ack(0, slot, "d1", ok=True)
    assert not settled.ok and settled.errors == {1: "out of memory"}
    assert table.error(slot) == "rank 1: out of memory"
    table.unpin(slot)
    table.unpin(slot)
    assert table.state(slot) is SlotState.FREE  # freed once unpinned: a later acquire retries
    assert table.lookup("a", "d1") is None
    assert table.acquire("a", "d1") == slot
    assert table.take_installs() == [SlotInstall(slot, "a", "d1")]


def test_full_pool_is_backpressure_until_an_unpin():
    table = make_table(max_loras=2)
    a, b = ready(table, "a"), ready(table, "b")
    assert table.num_free() == 0
    assert table.acquire("c", "d") is None
    assert table.take_installs() == []
    assert table.acquire("a", "d") == a  # resident: a new request shares it
    table.unpin(b)
    assert table.acquire("c", "d") == b
    assert table.lookup("b", "d") is None and table.lookup("c", "d") == b
    assert table.lookup("a", "d") == a


def test_idle_slots_keep_their_adapter_and_are_evicted_lru():
    table = make_table(max_loras=2)
    a, b = ready(table, "a"), ready(table, "b")
    table.unpin(a)
    table.unpin(b)
    # "a" reused without an install: it is idle, not gone.
    assert table.acquire("a", "d") == a and table.take_installs() == []
    table.unpin(a)  # now "b" is the least recently released
    assert table.acquire("c", "d") == b
    assert table.lookup("a", "d") == a


def test_free_slots_are_taken_before_evicting_an_idle_adapter():
    table = make_table(max_loras=2)
    a = ready(table, "a")
    table.unpin(a)
    assert table.acquire("b", "d") != a
    assert table.lookup("a", "d") == a


def test_slot_mid_install_is_never_reused_even_unpinned():
    table = make_table(max_loras=1, num_ranks=2)
    slot = table.acquire("a", "d1")
    table.unpin(slot)  # the request was aborted while its adapter installed
    assert table.acquire("b", "d2") is None  # rank acks still pending
    table.ack(0, slot, "d1", ok=True)
    table.ack(1, slot, "d1", ok=True)
    assert table.acquire("b", "d2") == slot


def test_reload_with_new_digest_never_reuses_the_stale_slot():
    table = make_table(max_loras=2)
    old = ready(table, "a", "v1")  # a running request keeps it pinned
    new = table.acquire("a", "v2")
    assert new is not None and new != old
    assert table.take_installs() == [SlotInstall(new, "a", "v2")]
    assert table.lookup("a", "v2") == new and table.lookup("a", "v1") == old
    assert table.num_pins(old) == 1  # its request finishes on the old weights
    table.unpin(old)
    assert table.acquire("b", "d") == old  # idle: evicted as any other


def test_a_slot_is_found_by_its_version_and_an_old_one_never_takes_the_new():
    """Choices parked before a reload ask for the old version: that found the name's slot, holding the new
    one, and detached it under its pins (no request found it again, none drained it: everything waited)."""
    table = make_table(max_loras=2)
    new = ready(table, "a", "v2")
    old = table.acquire("a", "v1")  # the parked choices' version: installed beside it
    assert old not in (None, new) and table.take_installs() == [SlotInstall(old, "a", "v1")]
    assert table.lookup("a", "v2") == new and table.acquire("a", "v2") == new and table.num_pins(new) == 2
    assert table.pick_drain(exclude=frozenset({old})) == new
    table.ack(0, old, "v1", ok=True)
    assert table.acquire("a", "v1") == old and table.num_pins(old) == 2  # shared by the version's choices


def test_reload_of_an_idle_adapter_frees_its_slot_for_the_new_one():
    table = make_table(max_loras=1)
    old = ready(table, "a", "v1")
    table.unpin(old)
    assert table.acquire("a", "v2") == old
    assert table.take_installs() == [SlotInstall(old, "a", "v2")]


def test_protocol_errors_name_what_is_wrong():
    table = make_table(max_loras=1, num_ranks=2)
    slot = table.acquire("a", "d")
    with pytest.raises(ValueError, match="ack from rank 2; this table has ranks 0..1"):
        table.ack(2, slot, "d", ok=True)
    table.ack(0, slot, "d", ok=True)
    with pytest.raises(ValueError, match="rank 0 acked slot 1 .* twice"):
        table.ack(0, slot, "d", ok=True)
    with pytest.raises(ValueError, match=r"slot 5 is not an adapter slot; accepted: 1..1"):
        table.unpin(5)
    table.unpin(slot)
    with pytest.raises(ValueError, match="unpin of slot 1 .* which has no pins"):
        table.unpin(slot)
    with pytest.raises(ValueError, match="max_loras >= 1"):
        SlotTable(max_loras=0)


def test_pin_adds_a_holder_of_an_acquired_slot():
    table = make_table(max_loras=1)
    slot = ready(table, "a")
    table.pin(slot)
    table.unpin(slot)
    assert table.acquire("b", "d") is None  # still one pin
    table.unpin(slot)
    assert table.acquire("b", "d") == slot
    fresh = make_table(max_loras=1)
    with pytest.raises(ValueError, match="pin of free slot 1"):
        fresh.pin(1)


def test_an_excluded_slot_is_never_taken_by_a_new_install_but_still_shared():
    table = make_table(max_loras=2)
    a, b = ready(table, "a"), ready(table, "b")
    table.unpin(a)
    table.unpin(b)
    assert table.num_free(exclude=frozenset({a})) == 1
    assert table.acquire("c", "d", exclude=frozenset({a})) == b
    assert table.acquire("a", "d", exclude=frozenset({a})) == a  # resident: shared whatever exclude says
    assert table.acquire("e", "d", exclude=frozenset({a})) is None
    assert table.num_free(exclude=frozenset({a})) == 0


def test_pick_drain_prefers_the_ready_slot_with_fewest_pins_and_never_an_install_in_flight():
    table = make_table(max_loras=3)
    a, b = ready(table, "a"), ready(table, "b")
    table.pin(a)  # two rows on "a", one on "b"
    installing = table.acquire("c", "d")
    assert table.pick_drain() == b
    assert table.pick_drain(exclude=frozenset({b})) == a
    assert table.pick_drain(exclude=frozenset({a, b})) is None  # "c" is still installing
    assert table.lookup("c", "d") == installing
