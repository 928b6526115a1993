"""gpt2/trainer.py due(): what each step owes (log, evaluate, HellaSwag, sample, save, stop), pure."""

from __future__ import annotations

from gpt2.config import TrainConfig
from gpt2.trainer import Actions, due

TC = TrainConfig(max_steps=10, log_interval=2, eval_interval=4, hellaswag_interval=5, hellaswag_file="hs.jsonl",
                 sample_interval=3, ckpt_interval=6)


def steps_where(what: str, tc: TrainConfig = TC, **kwargs) -> list[int]:
    return [s for s in range(1, tc.max_steps + 1) if getattr(due(s, tc, **kwargs), what)]


def test_each_action_at_its_interval_and_all_at_the_last_step():
    assert steps_where("log") == [2, 4, 6, 8, 10]
    assert steps_where("evaluate") == [4, 8, 10]
    assert steps_where("hellaswag", has_hellaswag=True) == [5, 10]
    assert steps_where("sample") == [3, 6, 9, 10]
    assert steps_where("save") == [6, 10]
    assert steps_where("final") == [10]
    assert steps_where("stop") == []


def test_zero_intervals_mean_never_but_the_last_step_still_evaluates_samples_and_saves():
    tc = TC.replace(eval_interval=0, ckpt_interval=0, sample_interval=0, hellaswag_interval=0)
    assert steps_where("evaluate", tc) == [10]
    assert steps_where("save", tc) == [10]
    assert steps_where("sample", tc) == []  # --sample-interval 0: no samples at all
    assert steps_where("hellaswag", tc) == []


def test_without_a_val_set_or_hellaswag_nothing_is_evaluated():
    assert steps_where("evaluate", has_val=False) == []
    assert steps_where("hellaswag", has_hellaswag=False) == []


def test_a_stop_request_saves_and_stops_except_at_the_last_step():
    act = due(7, TC, stop_requested=True)
    assert act.stop and act.save and not act.final and act.slow
    last = due(10, TC, stop_requested=True)  # the run is complete: no requeue
    assert not last.stop and last.save and last.final


def test_an_unusual_step_is_logged_off_the_interval():
    assert not due(3, TC).log
    assert due(3, TC, unusual=True).log


def test_slow_is_any_work_that_keeps_a_rank_from_the_next_step():
    assert due(2, TC) == Actions(log=True, evaluate=False, hellaswag=False, sample=False, save=False, final=False,
                                 stop=False)
    assert not due(2, TC).slow
    assert due(3, TC).slow  # rank 0 samples alone
