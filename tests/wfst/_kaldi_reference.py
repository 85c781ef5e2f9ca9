"""kaldi-decoder's FasterDecoder on a graph image: the reference the GPU decoder is held to."""

from __future__ import annotations

import numpy as np

from oasr_decoders_wfst.graph import WfstGraph


def to_kaldifst(graph: WfstGraph):
    """The same graph as a kaldifst ``StdVectorFst`` (state ids and float32 weights kept)."""
    import kaldifst

    src = np.repeat(np.arange(graph.num_states), np.diff(graph.state_offsets))
    order = np.argsort(src != graph.start, kind="stable")  # the first line names the start
    lines = [f"{s} {d} {i} {o} {w:.9g}" for s, d, i, o, w in zip(
        src[order].tolist(), graph.next_states[order].tolist(), graph.ilabels[order].tolist(),
        graph.olabels[order].tolist(), graph.weights[order].tolist(), strict=False)]
    finals = np.nonzero(np.isfinite(graph.final_weights))[0]
    lines += [f"{s} {graph.final_weights[s]:.9g}" for s in finals.tolist()]
    if not lines or not lines[0].startswith(f"{graph.start} "):
        lines.insert(0, f"{graph.start} inf")
    fst = kaldifst.compile("\n".join(lines) + "\n", keep_state_numbering=True)
    assert fst.start == graph.start
    return fst


def kaldi_decode(fst, scaled_log_probs: np.ndarray, beam: float, max_active: int,
                 min_active: int, beam_delta: float = 0.5) -> tuple[list[int], list[int], float]:
    """FasterDecoder one-best for one utterance (log-probs already scaled): word ids, the frame
    of each word's arc (an epsilon arc: the last frame consumed before it) and the cost."""
    import kaldi_decoder
    import kaldifst

    opts = kaldi_decoder.FasterDecoderOptions(beam=beam, max_active=max_active,
                                              min_active=min_active, beam_delta=beam_delta)
    dec = kaldi_decoder.FasterDecoder(fst, opts)
    dec.decode(kaldi_decoder.DecodableCtc(np.ascontiguousarray(scaled_log_probs, dtype=np.float32)))
    ok, lattice = dec.get_best_path()
    if not ok:
        return [], [], float("inf")
    # the best path is linear: walk it from the start state
    arcs: dict[int, tuple[int, int, int, float]] = {}
    finals: dict[int, float] = {}
    for line in lattice.to_str().splitlines():
        f = line.split()
        if len(f) >= 4:
            w = sum(float(x) for x in f[4].split(",")) if len(f) > 4 else 0.0
            arcs[int(f[0])] = (int(f[1]), int(f[2]), int(f[3]), w)
        elif f:
            finals[int(f[0])] = sum(float(x) for x in f[1].split(",")) if len(f) > 1 else 0.0
    state, frame, cost = lattice.start, 0, 0.0
    words, frames = [], []
    while state in arcs:
        nxt, ilabel, olabel, w = arcs[state]
        cost += w
        if olabel:
            words.append(olabel)
            frames.append(frame if ilabel else max(frame - 1, 0))
        frame += 1 if ilabel else 0
        state = nxt
    assert kaldifst.get_linear_symbol_sequence is not None
    return words, frames, cost + finals.get(state, 0.0)
