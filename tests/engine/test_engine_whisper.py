"""ASREngine on the real tiny.en: continuous batching gives the per-batch path's exact tokens;
memory-bounded admission; per-request errors; service modes; thread-safe submission."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from oasr.engine import ASREngine, ServiceModeError
from oasr.errors import BadAudioError, UnsupportedOptionError
from oasr.scheduler import SchedulerConfig
from oasr.types import DecodingOptions, EngineConfig


def _tokens(t):
    return [tok for s in t.segments for tok in s.tokens]


@pytest.fixture(scope="module")
def reference(tiny_en, clips):
    """The model's own answer for one clip decoded alone, computed once per (clip, options) in
    this module: several tests compare against the same references (the model is deterministic
    and holds no state between calls)."""
    cache = {}

    def ref(audio, opts=None):
        opts = DecodingOptions() if opts is None else opts
        key = (next(i for i, c in enumerate(clips) if c is audio), repr(opts))
        if key not in cache:
            cache[key] = tiny_en.transcribe([audio], opts)[0]
        return cache[key]

    return ref


def _engine(model, **kw):
    sc = SchedulerConfig(**{"max_batch_size": 3, **kw})
    return ASREngine(EngineConfig(max_batch_size=sc.max_batch_size), model=model, scheduler_config=sc)


@pytest.mark.slow  # parity with the per-batch path on 5 real clips
@pytest.mark.parametrize("opts", [
    DecodingOptions(),
    DecodingOptions.build(without_timestamps=True, condition_on_previous_text=False),
], ids=["timestamps", "no_timestamps"])  # fmt: skip
def test_continuous_batching_matches_transcribe(tiny_en, clips, reference, opts):
    eng = _engine(tiny_en)  # 3 rows for 5 inputs: rows are refilled as windows finish
    outs = eng.transcribe_outputs(clips, decoding=opts)
    ex = eng.scheduler.executor
    assert type(ex).__name__ == "AutoregressiveExecutor"  # the core's, with Whisper's driver
    assert type(ex.driver).__name__ == "WhisperDriver"
    assert ex.stats["max_rows"] == 3
    for audio, out in zip(clips, outs, strict=True):
        assert out.ok, out.error
        ref = reference(audio, opts)
        assert _tokens(out.transcript) == _tokens(ref)
        assert out.transcript.text == ref.text
        assert [(s.start, s.end) for s in out.transcript.segments] == [
            (s.start, s.end) for s in ref.segments
        ]
    assert len(outs[3].transcript.segments) > 1  # the 35 s clip took several windows


@pytest.mark.slow  # parity with the per-batch path
def test_encoder_lookahead_matches_transcribe(tiny_en, clips, reference):
    """Windows encoded ahead of a free row (on the CPU: in the same stream, earlier) wait with
    their features and decode to the same tokens; the executor holds more requests than rows."""
    eng = _engine(tiny_en, max_batch_size=2, encoder_lookahead=2, min_admit_group=1)
    outs = eng.transcribe_outputs(clips)
    ex = eng.scheduler.executor
    assert ex.max_requests == 4
    assert eng.scheduler.stats["max_running"] == 4
    assert ex.stats["max_rows"] == 2
    for audio, out in zip(clips, outs, strict=True):
        assert out.ok, out.error
        assert _tokens(out.transcript) == _tokens(reference(audio))


def test_small_memory_budget_queues_a_flood(tiny_en, clips, reference):
    from oasr_models_whisper.engine_adapter import make_executor

    probe = make_executor(tiny_en, SchedulerConfig(max_batch_size=8))
    per_row = probe.memory_bytes // 8  # cross K/V + a full context of blocks, one row
    eng = _engine(tiny_en, max_batch_size=8, kv_cache_bytes=int(per_row * 1.5))
    short = clips[0]
    # 4 at once already queue 3 behind the one row the budget allows (10 only waited longer)
    futs = [eng.submit(short) for _ in range(4)]
    texts = {f.result(timeout=240).text for f in futs}
    ex = eng.scheduler.executor
    assert ex.max_rows == 1 and ex.stats["max_rows"] == 1
    assert texts == {reference(short).text}
    eng.shutdown()


def test_errors_are_isolated(tiny_en, clips):
    eng = _engine(tiny_en)
    bad_audio = np.full(16000, np.nan, np.float32)
    outs = eng.transcribe_outputs([clips[0], bad_audio, clips[2]])
    assert outs[0].ok and outs[2].ok
    assert isinstance(outs[1].error, BadAudioError)
    # an option the model refuses fails that request alone
    f_bad = eng.submit(clips[0], DecodingOptions(language="de"))
    f_ok = eng.submit(clips[2])
    with pytest.raises(UnsupportedOptionError):
        f_bad.result(timeout=120)
    assert f_ok.result(timeout=120).text == outs[2].transcript.text
    eng.shutdown()


def test_threads_submit_together(tiny_en, clips, reference):
    eng = _engine(tiny_en, max_batch_size=4)
    # each clip decoded alone (shared with the parity tests), instead of an extra engine run
    refs = [reference(c).text for c in clips[:3]]
    results: dict[tuple[int, int], str] = {}

    def worker(t):
        futs = [(k, eng.submit(clips[k])) for k in range(3)]
        for k, f in futs:
            results[(t, k)] = f.result(timeout=240).text

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[(t, k)] == refs[k] for t in range(3) for k in range(3))
    eng.shutdown()


def test_beam_search_runs_on_the_batch_path(tiny_en, clips):
    eng = _engine(tiny_en)
    opts = DecodingOptions(beam_size=2)
    out = eng.transcribe_outputs([clips[0]], decoding=opts)[0]
    assert out.ok
    assert out.transcript.text == tiny_en.transcribe([clips[0]], opts)[0].text


def test_service_modes_are_typed(tiny_en, clips, reference):
    eng = _engine(tiny_en)
    for call in (lambda: eng.add_streaming_request(), lambda: eng.feed_chunk("s1", clips[0]),
                 lambda: eng.step(), lambda: eng.run(),
                 lambda: eng.transcribe_outputs(clips[:1], streaming=True)):  # fmt: skip
        with pytest.raises(ServiceModeError):
            call()
    with pytest.raises(UnsupportedOptionError):  # tiny.en cannot stream
        ASREngine(EngineConfig(service_mode="streaming"), model=tiny_en)
    # the existing direct API is unchanged
    assert eng.transcribe_arrays([clips[0]])[0].text == reference(clips[0]).text


def test_word_timestamps_and_prompt_match(tiny_en, clips):
    eng = _engine(tiny_en)
    opts = DecodingOptions(word_timestamps=True, prompt="Numbers and names.")
    outs = eng.transcribe_outputs([clips[0], clips[4]], decoding=opts)
    for audio, out in zip([clips[0], clips[4]], outs, strict=True):
        ref = tiny_en.transcribe([audio], opts)[0]
        assert out.ok and _tokens(out.transcript) == _tokens(ref)
        assert [(w.word, w.start, w.end) for w in out.transcript.words] == [
            (w.word, w.start, w.end) for w in ref.words
        ]


def test_abort_a_running_request(tiny_en, clips):
    from oasr.scheduler import RequestAbortedError

    eng = _engine(tiny_en, max_batch_size=2)
    sched = eng.scheduler
    fa = sched.submit(clips[3], DecodingOptions())  # the 35 s clip: several windows
    fb = sched.submit(clips[0], DecodingOptions())
    sched.step()
    sched.step()
    assert eng.abort(fa.rid)
    sched.run_until_idle()
    with pytest.raises(RequestAbortedError):
        fa.result(timeout=1)
    assert fb.result(timeout=1).text
    ex = sched.executor
    assert not ex.rows and not ex.active and not ex.driver.states
    assert ex.cache.allocator.num_free == ex.cache.allocator.capacity  # every block came back


@pytest.mark.slow  # parity with each input decoded alone
def test_offline_batches_through_the_scheduler(tiny_en, clips, reference):
    """transcribe_arrays goes through the engine's scheduler (the one batching layer): results
    in input order, equal to the model's own answer for each input, progress up to the total."""
    eng = _engine(tiny_en)
    seen = []
    outs = eng.transcribe_arrays(clips, progress=lambda d, t: seen.append((d, t)))
    assert eng.scheduler.step_count > 0 and eng.scheduler.stats["max_running"] > 1
    for audio, out in zip(clips, outs, strict=True):
        assert _tokens(out) == _tokens(reference(audio))
    total = sum(len(a) for a in clips) / 16000
    assert seen[-1][0] == pytest.approx(total) == seen[-1][1]
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:], strict=False))  # never goes back


def test_one_input_one_result_a_list_a_list(tiny_en, clips):
    eng = _engine(tiny_en)
    one = eng.transcribe_offline(clips[0])
    assert one.text and str(one) == one.text  # a Transcript prints as its text
    listed = eng.transcribe_offline([clips[0]])
    assert isinstance(listed, list) and listed[0].text == one.text
    assert eng.transcribe(clips[0]).text == one.text  # offline engine: transcribe = transcribe_offline
