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
        admitted[queue.pop()] = step
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
    assert [q.pop() for _ in range(4)] == [1, 3, 2, 0]


def test_fcfs_queue_is_arrival_order():
    q = FCFSQueue()
    for i in (3, 1, 2):
        q.push(i, now=0)
    assert [q.pop() for _ in range(3)] == [3, 1, 2] and len(q) == 0


def test_negative_aging_rejected():
    with pytest.raises(ValueError, match="aging"):
        SJFQueue([1.0], aging=-1)
