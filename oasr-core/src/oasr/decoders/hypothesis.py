"""The result type every generic decoder returns (CTC, transducer, TDT).

One type, so that token frame times, per-token log-probabilities and scores flow the same way
into :func:`oasr.decoders.token_timestamps` and :func:`oasr.decoders.group_words` whatever the
decode family. ``oasr.decoders.ctc.CTCHypothesis`` is this class under its older name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Hypothesis"]


@dataclass
class Hypothesis:
    """One decoding result.

    ``tokens``: output ids, no blanks. ``times``: the encoder frame of each token (CTC: its peak
    on the best alignment; transducer: the frame at which it was emitted). ``token_logprobs``:
    log P(token) at that frame. ``score``: the decoder's total log score (see each decoder).
    ``durations``: frames each token covers, for decoders that predict them (TDT); empty
    otherwise."""

    tokens: list[int]
    score: float = 0.0
    times: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    durations: list[int] = field(default_factory=list)

    @property
    def confidences(self) -> list[float]:
        return [math.exp(x) for x in self.token_logprobs]
