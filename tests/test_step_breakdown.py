"""The step breakdown's derivations (benchmarks/testbed/step_breakdown.py) on hand-made timelines."""

import pytest

from benchmarks.testbed.step_breakdown import (
    StepMarks,
    ThreadTimes,
    Transfer,
    Wait,
    first_partitions,
    issue_skew,
    last_ready_skew,
    link_steps,
    merge,
    merge_ranks,
    rank_pace,
    thread_kind,
    time_by_kind,
    training_steps,
    union_length,
)


def test_union_merges_overlaps_and_keeps_gaps():
    intervals = [(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0), (7.0, 7.0)]
    assert merge(intervals) == [(0.0, 4.0), (5.0, 6.0)]
    assert union_length(intervals) == pytest.approx(5.0)
    assert union_length([]) == 0.0


def _t(step, start, t_issue, t_done, length=10, t_ready=None):
    return Transfer(
        step, start, length, 4 * length, t_issue if t_ready is None else t_ready, t_issue, t_done
    )


def test_link_step_cycle_is_busy_plus_idle_plus_stall():
    transfers = [
        _t(0, 20, 1.0, 2.0),
        _t(0, 10, 1.5, 3.0),
        _t(0, 0, 4.0, 5.0),  # idle 3..4
        _t(1, 20, 7.0, 8.0),
    ]
    marks = [StepMarks(1, 4.5, 6.0, 9.0, 9.1)]  # step 1: forward 4.5..6, backward 6..9
    (row,) = link_steps(transfers, marks)
    assert row.step == 0 and row.collectives == 3 and row.nbytes == 120
    assert row.busy_s == pytest.approx(3.0)
    assert row.idle_inside_s == pytest.approx(1.0)
    assert row.boundary_stall_s == pytest.approx(2.0)  # last done 5.0 -> next issue 7.0
    assert row.cycle_s == pytest.approx(row.busy_s + row.idle_inside_s + row.boundary_stall_s)
    assert row.stall_in_forward_s == pytest.approx(1.0)  # 5..6
    assert row.stall_in_backward_s == pytest.approx(1.0)  # 6..7


def test_overlapping_steps_give_a_negative_stall():
    (row,) = link_steps([_t(0, 0, 0.0, 2.0), _t(1, 0, 1.5, 3.0)])
    assert row.boundary_stall_s == pytest.approx(-0.5)
    assert row.cycle_s == pytest.approx(1.5)


def test_merged_ranks_move_at_the_later_issue_and_done():
    rank0 = [_t(0, 0, 1.0, 2.0), _t(0, 10, 1.1, 2.5), _t(1, 0, 5.0, 6.0)]
    rank1 = [_t(0, 0, 1.4, 2.1), _t(0, 10, 1.0, 2.4)]  # no step-1 record: dropped
    merged = merge_ranks(rank0, rank1)
    assert [(t.step, t.start, t.t_issue, t.t_done) for t in merged] == [
        (0, 0, 1.4, 2.1),
        (0, 10, 1.1, 2.5),
    ]
    assert issue_skew(rank0, rank1) == pytest.approx([0.4, -0.1])
    late1 = [_t(0, 0, 1.0, 2.0, t_ready=0.9), _t(0, 10, 1.3, 2.0, t_ready=1.25)]
    assert last_ready_skew(rank0, late1) == pytest.approx([0.15])  # rank 0's last ready: 1.1


def test_first_partitions_are_those_reaching_the_first_parameter():
    # first parameter's slice starts at 100; a partition from 95 of length 10 reaches into it
    transfers = [
        _t(0, 0, 1.0, 2.0, length=95),
        _t(0, 95, 3.0, 3.5, t_ready=2.5),
        _t(0, 105, 2.9, 4.0, t_ready=2.8),
    ]
    marks = [StepMarks(0, 0.0, 1.0, 2.5, 2.6), StepMarks(1, 2.6, 6.0, 8.0, 8.1)]
    waits = [Wait(1, 2.7, 4.0), Wait(1, 5.0, 5.5)]  # the first begins in the forward's first 10%
    (row,) = first_partitions(transfers, 100, marks, waits)
    assert row.ready_to_issue_s == pytest.approx(0.5)
    assert row.issue_to_done_s == pytest.approx(1.1)  # the latest of them: 2.9 -> 4.0
    assert row.done_after_backward_s == pytest.approx(1.5)
    assert row.next_first_wait_s == pytest.approx(1.3)
    assert row.next_forward_wait_s == pytest.approx(1.8)


def test_a_late_first_wait_is_not_the_first_partitions_wait():
    marks = [StepMarks(0, 0.0, 1.0, 2.0, 2.1), StepMarks(1, 2.1, 4.1, 5.0, 5.1)]
    (row,) = first_partitions([_t(0, 0, 1.5, 2.5)], 0, marks, [Wait(1, 3.5, 3.6)])
    assert row.next_first_wait_s == 0.0
    assert row.next_forward_wait_s == pytest.approx(0.1)


def test_training_steps_split_the_step_and_exclude_waits_from_compute():
    marks = [StepMarks(0, 0.0, 2.0, 5.0, 5.5), StepMarks(1, 6.0, 7.0, 8.0, 8.1)]
    (row,) = training_steps(marks, [Wait(0, 0.5, 1.0), Wait(0, 0.8, 1.2), Wait(1, 6.1, 6.2)])
    assert row.step_s == pytest.approx(6.0)
    assert row.forward_wait_s == pytest.approx(0.7)
    assert row.forward_s == pytest.approx(1.3)
    assert (row.backward_s, row.step_call_s, row.between_s) == pytest.approx((3.0, 0.5, 0.5))
    assert row.step_s == pytest.approx(
        row.forward_s + row.forward_wait_s + row.backward_s + row.step_call_s + row.between_s
    )


def _compute_rows(computes):
    """Training steps whose forward (a 0.2 s wait excluded) + backward is each given compute."""
    marks, waits, t = [], [], 0.0
    for step, c in enumerate(computes + [0.0]):
        marks.append(StepMarks(step, t, t + 0.2 + 0.25 * c, t + 0.2 + c, t + 0.2 + c))
        waits.append(Wait(step, t, t + 0.2))
        t += c + 0.3
    return training_steps(marks, waits)


def test_rank_pace_is_the_later_ranks_compute_step_by_step():
    pace = rank_pace(_compute_rows([1.0, 2.0, 1.0, 2.0]), _compute_rows([2.0, 1.0, 1.0, 2.0]))
    assert pace.steps == 4
    assert pace.compute_s == pytest.approx((1.5, 1.5))
    assert pace.apart_s == pytest.approx(0.5)  # |1-2|, |2-1|, 0, 0
    assert pace.pace_cost_s == pytest.approx(0.25)  # mean max(r0, r1) 1.75 - mean of both 1.5
    sd = (4 / 3 * 0.25) ** 0.5  # each rank's sample standard deviation
    assert pace.spread_s == pytest.approx((sd, sd))
    assert pace.independent_s == pytest.approx((2 * sd * sd * 2 / 3.141592653589793) ** 0.5)
    # ranks that move together are not apart however much they vary
    same = rank_pace(_compute_rows([1.0, 3.0, 1.0]), _compute_rows([1.0, 3.0, 1.0]))
    assert (same.apart_s, same.pace_cost_s) == (0.0, 0.0) and same.independent_s > 1.0
    assert (
        rank_pace(_compute_rows([1.0]), _compute_rows([1.0])) is None
    )  # one common step: no spread


def test_thread_kinds_and_times_per_step():
    assert [
        thread_kind(n)
        for n in (
            "MainThread",
            "autobyte-r0-update",
            "autobyte-r1-follower",
            "ab-r0-leader",
            "python",
        )
    ] == ["training", "update", "dispatch", "dispatch", "backend"]
    before = {
        1: ThreadTimes("MainThread", 1_000, 10),
        2: ThreadTimes("python", 500, 0),
        3: ThreadTimes("old", 900, 0),
    }
    after = {
        1: ThreadTimes("MainThread", 5_001_000, 2_000_010),
        2: ThreadTimes("python", 1_000_500, 0),
        3: ThreadTimes("autobyte-r0-update", 2_000_000, 0),  # tid reused: counts from zero
        4: ThreadTimes("ab-r0-leader", 1_000_000, 0),
    }
    cpu = time_by_kind(before, after, steps=2)
    assert cpu == pytest.approx(
        {"training": 2.5e-3, "update": 1e-3, "dispatch": 0.5e-3, "backend": 0.5e-3, "total": 4.5e-3}
    )
    assert time_by_kind(before, after, 2, "runqueue_ns")["training"] == pytest.approx(1e-3)


def test_fixed_cost_is_the_intercept_of_two_sizes():
    from benchmarks.profile_step import fixed_cost

    # 0.4 ms fixed + 8 ms per MiB
    assert fixed_cost(0.0084, 0.0324, 1 << 20, 4 << 20) == pytest.approx(0.0004)
