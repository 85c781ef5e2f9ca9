"""Scheduler policy with a fake executor: admission, starvation bound, error isolation."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from oasr.scheduler import BatchExecutor, Scheduler, SchedulerConfig
from oasr.types import DecodingOptions, Transcript


class FakeExecutor:
    """``capacity`` requests at once; a request needs ``len(audio) // 16000`` steps."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.running: dict = {}
        self.admit_order: list[str] = []

    @property
    def num_running(self) -> int:
        return len(self.running)

    def try_admit(self, r) -> bool:
        if r.audio.size and not np.isfinite(r.audio).all():
            raise ValueError("bad audio")
        if len(self.running) >= self.capacity:
            return False
        self.running[r.rid] = [r, max(1, r.audio.shape[0] // 16000)]
        self.admit_order.append(r.rid)
        return True

    def abort(self, r) -> bool:
        return self.running.pop(r.rid, None) is not None

    def step(self):
        done = []
        for rid, item in list(self.running.items()):
            item[1] -= 1
            if item[1] <= 0:
                del self.running[rid]
                done.append((item[0], Transcript(text=rid, language="en", duration=0.0)))
        return done


def _audio(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * 16000), np.float32)


def test_length_bucketing_prefers_short_and_starvation_bound():
    ex = FakeExecutor(capacity=1)
    bound = 6
    s = Scheduler(ex, SchedulerConfig(max_batch_size=1, max_wait_steps=bound, bucket_seconds=1.0))
    opts = DecodingOptions()
    long = s.submit(_audio(20), opts, "long")
    for k in range(3):
        s.submit(_audio(1), opts, f"short{k}")
    # a continuous flood of short requests, one per step
    k = 3
    admitted_at = None
    for _ in range(60):
        s.submit(_audio(1), opts, f"short{k}")
        k += 1
        s.step()
        if admitted_at is None and "long" in ex.admit_order:
            admitted_at = s.step_count
    assert ex.admit_order[0].startswith("short")  # shorter bucket first
    assert admitted_at is not None, "the long request starved"
    assert admitted_at <= bound + 2
    # once starved, nothing younger overtakes: the requests that waited while "long" ran are
    # admitted oldest first
    after = ex.admit_order[ex.admit_order.index("long") + 1 :]
    assert after[:5] == sorted(after[:5], key=lambda r: int(r[5:]))
    s.run_until_idle()
    assert long.result().text == "long"


def test_queue_bound_and_errors_are_per_request():
    from oasr.scheduler import EngineBusyError

    ex = FakeExecutor(capacity=2)
    s = Scheduler(ex, SchedulerConfig(max_batch_size=2, max_queue=3))
    opts = DecodingOptions()
    good = [s.submit(_audio(1), opts) for _ in range(2)]
    bad = s.submit(np.full(16000, np.nan, np.float32), opts)
    with pytest.raises(EngineBusyError):
        s.submit(_audio(1), opts)
    s.run_until_idle()
    assert all(f.result().text for f in good)
    with pytest.raises(ValueError):
        bad.result()


def test_abort_and_thread():
    ex = FakeExecutor(capacity=1)
    s = Scheduler(ex, SchedulerConfig(max_batch_size=1))
    opts = DecodingOptions()
    a = s.submit(_audio(3), opts, "a")
    b = s.submit(_audio(1), opts, "b")
    assert s.abort("b")
    from oasr.scheduler import RequestAbortedError

    with pytest.raises(RequestAbortedError):
        b.result(timeout=1)
    s.start()
    futs = []
    lock = threading.Lock()

    def worker(n):
        for _ in range(5):
            f = s.submit(_audio(1), opts)
            with lock:
                futs.append(f)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert a.result(timeout=10).text == "a"
    assert len({f.result(timeout=10).text for f in futs}) == 20
    s.stop()


def test_batch_executor_isolates_a_failing_request():
    class Model:
        name = "fake"
        from oasr.types import DecodeFamily, ModelCapabilities

        capabilities = ModelCapabilities(decode_family=DecodeFamily.CTC)

        def transcribe(self, audios, options, progress=None):
            if any(a.size == 0 for a in audios):
                raise ValueError("empty")
            return [Transcript(text=str(a.size), language=None, duration=0.0) for a in audios]

    s = Scheduler(BatchExecutor(Model(), 4), SchedulerConfig(max_batch_size=4))
    opts = DecodingOptions()
    fs = [s.submit(_audio(1), opts), s.submit(np.zeros(0, np.float32), opts), s.submit(_audio(2), opts)]
    s.run_until_idle()
    assert fs[0].result().text == "16000" and fs[2].result().text == "32000"
    with pytest.raises(ValueError):
        fs[1].result()


def test_one_queue_full_error_503_with_the_old_name_kept():
    from oasr.errors import EngineOverloadedError
    from oasr.scheduler import EngineBusyError

    assert EngineBusyError is EngineOverloadedError  # old imports keep working
    assert (EngineOverloadedError.http_status, EngineOverloadedError.code) == (503, "overloaded")
    s = Scheduler(FakeExecutor(capacity=1), SchedulerConfig(max_queue=2))
    with pytest.raises(EngineOverloadedError, match="max_queue=2"):
        s.submit_many([_audio(1)] * 3, DecodingOptions())  # all or nothing
    assert s.num_waiting == 0


class _BatchRecorder:
    """A CTC-like model that records every batch it is given (as the lengths in seconds)."""

    name = "recorder"

    def __init__(self, fail_seconds: int | None = None) -> None:
        from oasr.types import DecodeFamily, FeatureSpec, ModelCapabilities

        self.capabilities = ModelCapabilities(decode_family=DecodeFamily.CTC)
        self.feature_spec = FeatureSpec(kind="none")
        self.batches: list[list[int]] = []
        self.fail_seconds = fail_seconds

    def transcribe(self, audios, options, progress=None):
        secs = [a.size // 16000 for a in audios]
        self.batches.append(secs)
        if self.fail_seconds in secs:
            raise RuntimeError("this input breaks the model")
        if progress is not None:
            progress(0.5, 1.0)
            progress(1.0, 1.0)
        return [Transcript(text=str(s), language=None, duration=float(s)) for s in secs]


def test_engine_batches_sorted_by_length_through_the_scheduler():
    """transcribe_arrays queues every input at once, shortest first: the BatchExecutor runs
    full batches of similar lengths (what the former direct path did), answers in input order,
    and reports progress per batch up to the total."""
    from oasr.engine import ASREngine
    from oasr.types import EngineConfig

    model = _BatchRecorder()
    eng = ASREngine(EngineConfig(max_batch_size=3), model=model)
    lengths = [7, 1, 5, 2, 6, 3, 4]
    seen = []
    outs = eng.transcribe_arrays([_audio(n) for n in lengths], progress=lambda d, t: seen.append((d, t)))
    assert [t.text for t in outs] == [str(n) for n in lengths]
    assert model.batches == [[1, 2, 3], [4, 5, 6], [7]]  # each model call is at most max_batch_size
    assert seen[-1] == (float(sum(lengths)), float(sum(lengths)))
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_engine_isolates_a_failing_input_once():
    """A batch that raises is retried one request at a time, by the BatchExecutor alone: the
    bad input fails with its own error, its neighbours get their answers."""
    from oasr.engine import ASREngine
    from oasr.types import EngineConfig

    model = _BatchRecorder(fail_seconds=2)
    eng = ASREngine(EngineConfig(max_batch_size=4), model=model)
    outs = eng.transcribe_outputs([_audio(1), _audio(2), _audio(3)])
    assert [o.ok for o in outs] == [True, False, True]
    assert isinstance(outs[1].error, RuntimeError) and outs[2].transcript.text == "3"
    assert model.batches == [[1, 2, 3], [1], [2], [3]]
    with pytest.raises(RuntimeError, match="breaks the model"):
        eng.transcribe_arrays([_audio(2)])


def test_engine_submit_many_shares_one_batch():
    """``submit_many`` (the server's path for a request of several pieces) queues the inputs
    together, so the scheduler thread cannot start a batch between them."""
    from oasr.engine import ASREngine
    from oasr.types import EngineConfig

    model = _BatchRecorder()
    eng = ASREngine(EngineConfig(max_batch_size=4), model=model)
    futures = eng.submit_many([_audio(1), _audio(2), _audio(3)])
    assert [f.result(timeout=10).text for f in futures] == ["1", "2", "3"]
    assert model.batches == [[1, 2, 3]]
    eng.shutdown()


def test_on_step_runs_before_the_step_answers_its_callers():
    """The server's batch metrics are recorded by ``on_step``: a caller that has its answer must
    find its step there, so the hook sees the step's count before any future resolves, and a
    failing hook loses no answer."""
    ex = FakeExecutor(capacity=4)
    s = Scheduler(ex, SchedulerConfig(max_batch_size=4))
    futures = [s.submit(_audio(1), DecodingOptions(), f"r{k}") for k in range(3)]
    seen: list[tuple[int, int, list[bool]]] = []

    def hook(sched: Scheduler) -> None:
        seen.append((sched.last_step_finished, sched.executor.num_running, [f.done() for f in futures]))
        raise RuntimeError("a broken metrics hook")

    s.on_step = hook
    assert s.step() == 3
    assert seen == [(3, 0, [False, False, False])]
    assert [f.result().text for f in futures] == ["r0", "r1", "r2"]
