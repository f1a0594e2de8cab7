"""The state slots and saved states of a hybrid model's scheduler (pagoda/core/state_pool.py)."""

from __future__ import annotations

import pytest

from pagoda.core.state_pool import StateCheckpoints, StatePool


def test_slots_are_handed_out_once_and_come_back():
    pool = StatePool(2)
    a, b = pool.allocate(), pool.allocate()
    assert {a, b} == {0, 1} and pool.allocate() is None
    pool.free(a)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(a)
    with pytest.raises(AssertionError, match="out of sync"):
        pool.check_integrity([])
    pool.check_integrity([b])


def test_saved_states_reuse_the_least_recently_used_entry_not_busy_this_step():
    saved = StateCheckpoints(2, interval=3)
    saved.begin_step()
    first, second = saved.write("a"), saved.write("b")
    assert {first, second} == {0, 1}
    assert saved.write("a") == first        # the same prefix: its own entry
    assert saved.write("c") is None         # both entries are this step's: nothing reused
    assert not saved.has("c")
    saved.begin_step()
    assert saved.restore("a") == first      # read this step: "b" is now the least recently used
    assert saved.write("c") == second and not saved.has("b")
    saved.begin_step()
    saved.demote("c")                       # a request's previous chunk end: reused first
    assert saved.write("d") == second and saved.has("a") and not saved.has("c")
    saved.check_integrity()
    saved.reset()
    assert len(saved) == 0
    saved.check_integrity()
    with pytest.raises(ValueError):
        StateCheckpoints(0)
