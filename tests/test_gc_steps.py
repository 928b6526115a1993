"""gpt2/train/gc_steps.py: the collector frozen and off for the loop, collections at the same steps, put back after."""

from __future__ import annotations

import gc

from gpt2.train.gc_steps import collect_at_steps, collect_if_due


def test_the_loop_runs_with_automatic_collection_off_and_everything_from_start_up_frozen():
    assert gc.isenabled()
    before = gc.get_freeze_count()
    with collect_at_steps(50):
        assert not gc.isenabled() and gc.get_freeze_count() > before
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with collect_at_steps(0):  # 0: Python's own timing, untouched
        assert gc.isenabled() and gc.get_freeze_count() == 0


def test_collections_happen_at_every_nth_step_only():
    collections = gc.get_stats()[1]["collections"]
    assert [collect_if_due(s, 3) for s in range(1, 8)] == [False, False, True, False, False, True, False]
    assert gc.get_stats()[1]["collections"] == collections + 2  # generation 1, twice
    assert not collect_if_due(6, 0)
