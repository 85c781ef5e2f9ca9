"""The scheduler with many requests queued (the many-files workload): admission order is the
length bucket then arrival, as before; a step that cannot admit does not touch the queue; an
executor that refuses every request this step is asked once, not once per queued request."""

from __future__ import annotations

import numpy as np

from oasr.scheduler import Request, Scheduler, SchedulerConfig
from oasr.types import DecodingOptions, Transcript


class CountingExecutor:
    """Holds up to ``capacity`` requests, finishes ``per_step`` per step; refuses every request
    while ``closed`` (and says so through ``refuses_all`` when ``flags``)."""

    def __init__(self, capacity: int, per_step: int, flags: bool = True) -> None:
        self.capacity, self.per_step, self.flags = capacity, per_step, flags
        self.held: list[Request] = []
        self.asked = 0
        self.closed = False
        self.refuses_all = False
        self.order: list[int] = []

    @property
    def num_running(self) -> int:
        return len(self.held)

    def try_admit(self, request: Request) -> bool:
        self.asked += 1
        self.refuses_all = self.flags
        if self.closed or len(self.held) >= self.capacity:
            return False
        self.refuses_all = False
        self.held.append(request)
        self.order.append(request.num_samples)
        return True

    def abort(self, request: Request) -> bool:
        return False

    def step(self) -> list[tuple[Request, Transcript | BaseException]]:
        done, self.held = self.held[: self.per_step], self.held[self.per_step :]
        return [(r, Transcript(text=str(r.num_samples), language="en", duration=1.0)) for r in done]


def _audios(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.zeros(int(rng.integers(1, 30 * 16000)), np.float32) for _ in range(n)]


def test_order_is_bucket_then_arrival() -> None:
    ex = CountingExecutor(capacity=8, per_step=8)
    sched = Scheduler(ex, SchedulerConfig(max_batch_size=8, bucket_seconds=5.0))
    audios = _audios(64)
    futures = sched.submit_many(audios, DecodingOptions())
    sched.step()  # the first admission sees all 64: the 8 of the lowest buckets, oldest first
    want = sorted(range(64), key=lambda k: (audios[k].shape[0] // (5 * 16000), k))[:8]
    assert ex.order == [audios[k].shape[0] for k in want]
    sched.run_until_idle()
    assert [f.result().text for f in futures] == [str(a.shape[0]) for a in audios]
    assert sched.num_waiting == 0 and sched.num_running == 0


def test_a_refusing_executor_is_asked_once_per_step() -> None:
    for flags, asked in ((True, 1), (False, 200)):
        ex = CountingExecutor(capacity=64, per_step=0, flags=flags)
        sched = Scheduler(ex, SchedulerConfig(max_batch_size=64))
        sched.submit_many(_audios(200, seed=1), DecodingOptions())
        ex.closed = True
        sched.step()
        assert ex.asked == asked and sched.num_waiting == 200
        ex.closed = False
        sched.step()  # admits 64, then the executor is full: the round ends
        assert sched.num_running == 64 and sched.num_waiting == 136
        before = ex.asked
        sched.step()  # full: the queue is not even ordered, the executor not asked
        assert ex.asked == before
