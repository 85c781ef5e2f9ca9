"""Writes tests/data/icefall/conformer_stateless2/: a tiny random-weight icefall
``pruned_transducer_stateless2`` Conformer transducer in icefall's release layout, and golden
outputs computed by icefall's own code. Not run by the tests; kept to show provenance.

    python tests/data/icefall/make_conformer_golden.py ICEFALL_CHECKOUT

ICEFALL_CHECKOUT is a k2-fsa/icefall checkout (used: commit 36e0420c7); its
``egs/librispeech/ASR/pruned_transducer_stateless2/{conformer,scaling,decoder,joiner}.py`` (and
``transducer_stateless/encoder_interface.py``) build the model, with ``icefall.utils`` reduced to
the three helpers they import. Greedy and modified beam search are icefall's, from the PyPI
package ``zipformer`` (``tests/icefall/_reference.py``), run on that model's decoder and joiner.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
OUT = HERE / "conformer_stateless2"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(icefall: Path) -> None:
    recipe = icefall / "egs/librispeech/ASR/pruned_transducer_stateless2"
    work = Path(tempfile.mkdtemp())
    for f in ("conformer.py", "scaling.py", "decoder.py", "joiner.py"):
        shutil.copy(recipe / f, work / f)
    shutil.copy(icefall / "egs/librispeech/ASR/transducer_stateless/encoder_interface.py", work)
    utils = types.ModuleType("icefall.utils")
    utils.is_jit_tracing = lambda: torch.jit.is_tracing()
    utils.make_pad_mask = lambda lengths, max_len=0: (
        torch.arange(max(max_len, int(lengths.max())))[None, :] >= lengths[:, None])
    utils.subsequent_chunk_mask = None
    pkg = types.ModuleType("icefall")
    pkg.utils = utils
    sys.modules.update({"icefall": pkg, "icefall.utils": utils})
    sys.path.insert(0, str(work))
    from conformer import Conformer  # noqa: E402
    from decoder import Decoder  # noqa: E402
    from joiner import Joiner  # noqa: E402
    from scaling import ScaledLinear  # noqa: E402

    conftest = _load(REPO / "tests/icefall/conftest.py", "icefall_conftest")
    torch.manual_seed(0)

    class Transducer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Conformer(num_features=80, subsampling_factor=4, d_model=32, nhead=4,
                                     dim_feedforward=64, num_encoder_layers=2, cnn_module_kernel=7)
            self.decoder = Decoder(vocab_size=40, decoder_dim=16, blank_id=0, context_size=2)
            self.joiner = Joiner(32, 16, 24, 40)
            self.simple_am_proj = ScaledLinear(32, 40)
            self.simple_lm_proj = ScaledLinear(16, 40)

    m = Transducer().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.endswith("_scale") and not name.endswith(".scale"):
                p.add_(torch.randn(p.shape, generator=g) * 0.05 * (p.abs().mean() + 0.1))
        feats, lens = conftest.calibration_features()
        enc, enc_lens = m.encoder(feats, lens)
        enc = torch.cat([enc[b, : int(n)] for b, n in enumerate(enc_lens)])
        mu, sd = enc.mean(0), enc.std(0) + 1e-3
        proj = m.joiner.encoder_proj  # read standardised encoder frames (see conftest)
        w = torch.randn(proj.weight.shape, generator=g) * 0.8 / sd
        proj.weight.copy_(w), proj.bias.copy_(-(w @ mu))
        proj.weight_scale.zero_(), proj.bias_scale.zero_()
        m.joiner.output_linear.weight_scale.add_(math.log(4.0))
        m.joiner.decoder_proj.weight_scale.add_(math.log(2.0))
        m.joiner.output_linear.bias[0] += 1.0 / m.joiner.output_linear.bias_scale.exp()
    m.vocab_size = 40
    if OUT.exists():
        shutil.rmtree(OUT)
    conftest.write_release(OUT, m)
    (OUT / "exp" / "pretrained.pt").unlink()
    torch.save({"model": m.state_dict()}, OUT / "exp" / "pretrained.pt")

    # golden: icefall's encoder one utterance at a time, icefall's searches
    feats, lens = conftest.calibration_features()
    ref = _load(REPO / "tests/icefall/_reference.py", "icefall_reference")
    arrays, runs = {}, {}
    with torch.no_grad(), ref.icefall_reference() as r:
        outs = []
        for b, n in enumerate(lens.tolist()):
            e, el = m.encoder(feats[b : b + 1, :n], lens[b : b + 1])
            outs.append(e[0])
            arrays[f"encoder_out_{b}"] = e[0].numpy()
        enc = torch.nn.utils.rnn.pad_sequence(outs, batch_first=True)
        enc_lens = torch.tensor([o.shape[0] for o in outs])
        greedy = r.search.greedy_search(m, enc, enc_lens, max_sym_per_frame=1)
        beam = r.search.modified_beam_search(m, enc, enc_lens, beam=4)
        runs = {"greedy_search": [list(h) for h in greedy], "modified_beam_search_4": [list(h) for h in beam]}
    np.savez_compressed(OUT / "golden.npz", **arrays)
    (OUT / "golden.json").write_text(json.dumps({"icefall_commit": "36e0420c7", "waves": "tests/icefall/conftest.py waves(3, seed=0)",
                                                 "runs": runs}, indent=1) + "\n")
    print(runs)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
