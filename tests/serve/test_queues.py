"""Admission order of the waiting queues; aging bounds how long a long request can wait."""

import pytest

from ecru.serve import FCFSQueue, SJFQueue


def serve_stream(queue, predicted, *, steps: int) -> dict[int, int]:
    """Request 0 (long) waits from step 0; a short request arrives every step; one is admitted per step."""
    admitted, queue_ids = {}, [0]
    queue.push(0, now=0)
    for step in range(steps):
        new = len(queue_ids)
        predicted.append(5.0)
        queue_ids.append(new)
        queue.push(new, now=step)
        admitted[queue.pop(now=step)] = step
    return admitted


def test_pure_sjf_starves_the_long_request():
    admitted = serve_stream(SJFQueue(predicted := [200.0], aging=0.0), predicted, steps=500)
    assert 0 not in admitted


def test_aging_prevents_starvation():
    aging = 0.5
    admitted = serve_stream(SJFQueue(predicted := [200.0], aging=aging), predicted, steps=500)
    assert 0 in admitted
    # its key 200 is beaten only by requests arriving before step (200 - 5) / aging = 390
    assert admitted[0] == pytest.approx(390, abs=1)


def test_sjf_orders_by_prediction_with_stable_ties():
    q = SJFQueue([30, 10, 20, 10], aging=0.1)
    for i in range(4):
        q.push(i, now=0)
    assert [q.pop(now=0) for _ in range(4)] == [1, 3, 2, 0]


def test_fcfs_queue_is_arrival_order():
    q = FCFSQueue()
    for i in (3, 1, 2):
        q.push(i, now=0)
    assert [q.pop(now=0) for _ in range(3)] == [3, 1, 2] and len(q) == 0


def test_negative_aging_rejected():
    with pytest.raises(ValueError, match="aging"):
        SJFQueue([1.0], aging=-1)


def test_fcfs_slack_admits_the_longest_waiting_once_past_its_deadline():
    # waiting at each pop: request 0 (200) and the short one just arrived (5); one row. The deadline is
    # (1 + 0.5) x 205 / 1 = 307.5 steps, after which request 0 goes before the newer short request
    queue = SJFQueue(predicted := [200.0], aging=0.0, fcfs_slack=0.5, rows=1)
    admitted = serve_stream(queue, predicted, steps=500)
    assert admitted[0] == 308
    assert sorted(admitted.values()) == list(range(500))  # one admission per step, none lost


def test_fcfs_deadline_counts_the_running_rows_and_the_rows_that_share_the_work():
    # the running rows' predicted remainders join the backlog; two rows halve the FCFS wait
    running = SJFQueue(predicted := [200.0], aging=0.0, fcfs_slack=0.5, rows=1, running_tokens=lambda: 100.0)
    assert serve_stream(running, predicted, steps=500)[0] == 458  # 1.5 x 305
    two_rows = SJFQueue(predicted := [200.0], aging=0.0, fcfs_slack=0.5, rows=2)
    assert serve_stream(two_rows, predicted, steps=500)[0] == 154  # 1.5 x 205 / 2


@pytest.mark.parametrize("kw", [{"fcfs_slack": -0.1}, {"rows": 0}])
def test_fcfs_slack_and_rows_validated(kw):
    with pytest.raises(ValueError):
        SJFQueue([1.0], **kw)


def test_a_deadline_admission_leaves_no_duplicate_and_a_cancelled_request_leaves_the_backlog():
    q = SJFQueue([50.0, 10.0, 100.0, 9.0], aging=0.0, fcfs_slack=0.0, rows=1)
    q.push(0, now=0)
    q.push(1, now=0)
    assert q.pop(now=60) == 0  # waited 60 >= the backlog 50 + 10: the oldest first, by its deadline
    q.push(2, now=60)
    # request 0's heap entry (key 50) now tops request 2's (100): it is skipped, never admitted twice
    assert [q.pop(now=61), q.pop(now=61)] == [1, 2] and len(q) == 0
    for i in (0, 1, 2):  # they finish (the engine forgets them): their indices may come back as new requests
        q.discard(i)
    for i in (2, 0, 3):
        q.push(i, now=300)
    q.discard(3)  # cancelled: it leaves the queue and the backlog (100 + 50) at once
    assert len(q) == 2 and q.pop(now=450) == 2  # request 2 waited 150 >= 150: by its deadline
    assert q.pop(now=450) == 0 and len(q) == 0


def test_a_request_waits_once_and_fcfs_discard_removes_it():
    q = SJFQueue([5.0, 6.0], fcfs_slack=0.1)
    q.push(0, now=0)
    with pytest.raises(ValueError, match="already waiting"):
        q.push(0, now=1)
    fcfs = FCFSQueue()
    for i in (1, 2, 3):
        fcfs.push(i, now=0)
    fcfs.discard(2)
    fcfs.discard(9)  # never queued: nothing to do
    assert len(fcfs) == 2 and [fcfs.pop(now=0), fcfs.pop(now=0)] == [1, 3]


def test_stale_entries_are_dropped_while_requests_keep_waiting():
    # deadline admissions leave stale heap entries behind; a queue that never empties must not keep them all
    predicted = [100.0] + [1.0] * 2000
    q = SJFQueue(predicted, aging=0.0, fcfs_slack=0.0, rows=1000)
    q.push(0, now=0)
    for i in range(1, 2001):
        q.push(i, now=i)
        q.pop(now=i)
    assert len(q) == 1 and len(q._heap) + len(q._arrivals) <= 4 * len(q) + 66


def test_a_request_pushed_again_goes_on_waiting_from_where_it_stopped():
    # A waited 10 steps, ran, was preempted and is pushed again at step 20 beside a newcomer B
    q = SJFQueue({0: 50.0, 1: 45.0}, aging=1.0)
    q.push(0, now=0)
    assert q.pop(now=10) == 0
    q.push(0, now=20)
    q.push(1, now=20)
    # A's priority counts its 10 earlier steps: 50 - 10 < 45 - 0 (without them 50 > 45)
    assert q.smallest(2, now=20) == [40.0, 45.0]
    assert q.pop(now=20) == 0


def test_a_preempted_requests_deadline_counts_its_earlier_wait():
    q = SJFQueue({0: 100.0, 1: 1.0}, aging=0.0, fcfs_slack=0.0, rows=1)
    q.push(0, now=0)
    assert q.pop(now=90) == 0  # waited 90 steps
    q.push(0, now=95)
    q.push(1, now=95)
    # backlog 101 tokens on one row: past its deadline after 101 steps of waiting in all, 11 more here
    assert q.pop(now=105) == 1
    q.push(1, now=105)
    assert q.pop(now=106) == 0 and 0 in q.past_deadline
