"""Issue #26 item 4, admission between steps: the continuous executor's admission-group rule
(refill rows in groups of ``min_admit_group``) holds a request back only while rows decode, and
for at most ``GROUP_WAIT_STEPS`` steps, so a request is not stuck behind long requests whose
rows free no request slot for a long time (or behind requests still being gated, which decode
nothing yet)."""

from __future__ import annotations

from oasr.executors.autoregressive import GROUP_WAIT_STEPS, Window
from oasr.types import DecodingOptions
from tests.engine.test_autoregressive_executor import (
    OneWindowDriver,
    TinyDecoder,
    _prompts,
    _scheduler,
)


class EndlessDriver(OneWindowDriver):
    """Windows without a stop token: a row decodes its whole budget."""

    def encoded(self, windows, features, ex) -> None:  # noqa: ANN001
        super().encoded(windows, features, ex)
        for w in ex.ready:
            w.stop_tokens = ()


def test_a_held_request_is_admitted_within_the_wait_bound() -> None:
    sched, ex = _scheduler(TinyDecoder(), max_batch_size=2, min_admit_group=2)
    ex.driver = EndlessDriver()
    long_opts = DecodingOptions(max_new_tokens=GROUP_WAIT_STEPS + 40)
    first = sched.submit(_prompts(1)[0], long_opts)
    while not ex.rows:
        sched.step()
    # one slot free, fewer than the group of 2, while a row decodes: held, but not for long
    second = sched.submit(_prompts(1, seed=2)[0], DecodingOptions(max_new_tokens=4))
    held = 0
    while not second.done():
        sched.step()
        held += 1
        assert held <= GROUP_WAIT_STEPS + 8, held
    assert not first.done()  # the second finished while the long row still decoded
    assert held > GROUP_WAIT_STEPS // 2  # it was held (the group rule still applies)
    sched.run_until_idle()
    assert len(first.result().text.split()) > GROUP_WAIT_STEPS  # it decoded on meanwhile


class GatingDriver(OneWindowDriver):
    """``begin`` takes ``steps`` steps per request before its window is queued (as Whisper's
    gate scanning a long input a slice per step)."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.seen: dict[str, int] = {}

    def begin(self, requests, ex) -> None:  # noqa: ANN001
        for r in requests:
            self.seen[r.rid] = self.seen.get(r.rid, 0) + 1
            if self.seen[r.rid] < self.steps:
                ex.begin_later(r)
            else:
                ex.encode_later(Window(r))


def test_nothing_is_held_while_no_row_decodes() -> None:
    """Requests admitted but not decoding yet (still being gated) hold nothing back: the next
    request is admitted in the next step, and is done long before the gated one."""
    sched, ex = _scheduler(TinyDecoder(), max_batch_size=3, min_admit_group=3)
    ex.driver = GatingDriver(steps=50)
    gated = sched.submit(_prompts(1)[0], DecodingOptions(max_new_tokens=8))
    sched.step()
    assert gated.rid in ex.active and not ex.rows
    ex.driver.steps = 1  # later requests need no gate
    short = sched.submit(_prompts(1, seed=3)[0], DecodingOptions(max_new_tokens=4))
    sched.step()
    assert short.rid in ex.active  # admitted at once (before: held until the gated one ended)
    while not short.done():
        sched.step()
    assert not gated.done()
    sched.run_until_idle()
    assert gated.result().text and short.result().text
