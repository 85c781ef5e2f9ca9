"""Offline encoder time of the Conformer families, to compare two revisions of OASR (issue #23:
"Conformer/Zipformer offline encoder >= 1.5x OASR's own PyTorch path today").

    python -m benchmarks.encoderbench --device cuda --json new.json
    PYTHONPATH=<an older tree's src folders> python -m benchmarks.encoderbench --device cuda \
        --json old.json
    python -m benchmarks.encoderbench --compare old.json new.json

Each model is built from seeded random weights at a released shape and run from features on the
device (the encoder alone: no audio upload, no mel, no search), fp16 on CUDA, best of
``--repeats`` after a warm-up:

* ``wenet``: WeNet U2++ Conformer (12 blocks x 256, 4 heads, FFN 2048, kernel 15, x4 conv2d
  subsampling), 64 x 30 s (3000 feature frames);
* ``wenet-large``: the same at 512 wide, 8 heads (WenetSpeech's model);
* ``parakeet``: the FastConformer encoder of Parakeet-0.6B (24 x 1024, 8 heads, FFN 4096, x8
  dw-striding subsampling, 128 mel), 128 x 30 s.

The same seed gives the same weights and inputs on every revision, so the JSON also carries a
checksum of each output; ``--compare`` prints the time ratio of each model and whether the
outputs agree within fp16 rounding.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

MODELS = {
    "wenet": {"family": "wenet", "d": 256, "heads": 4, "ffn": 2048, "batch": 64},
    "wenet-large": {"family": "wenet", "d": 512, "heads": 8, "ffn": 2048, "batch": 64},
    "parakeet": {"family": "nemo", "d": 1024, "heads": 8, "ffn": 4096, "batch": 128},
}


def _random_state(shapes: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    state = {}
    for k, s in shapes.items():
        if k.endswith("num_batches_tracked"):
            state[k] = torch.tensor(0, dtype=torch.long)
        elif k.endswith("running_var"):
            state[k] = 0.5 + torch.rand(s, generator=g)
        elif k.endswith(("norm.weight", "norm_out.weight")) or ".norm_" in k and k.endswith("weight"):
            state[k] = 1.0 + 0.1 * torch.randn(s, generator=g)
        else:
            fan_in = max(1, int(torch.tensor(s[1:]).prod()) if len(s) > 1 else s[0])
            state[k] = torch.randn(s, generator=g) / fan_in ** 0.5
    return state


def _wenet(spec: dict, device: str, dtype, seed: int):
    import torch

    from oasr_models_wenet.config import WenetConfig
    from oasr_models_wenet.nn import WenetNet, build_network

    cfg = WenetConfig(input_dim=80, vocab_size=5000, output_size=spec["d"],
                      attention_heads=spec["heads"], linear_units=spec["ffn"])
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in WenetNet(cfg).state_dict().items()}
    net = build_network(cfg, _random_state(shapes, seed), device, dtype).eval()
    feats_dim = 80

    def run(feats, lens):
        return net.encoder(feats, lens, -1, -1)[0]

    return run, feats_dim


def _nemo(spec: dict, device: str, dtype, seed: int):
    import torch

    from oasr_models_nemo.config import NemoConfig
    from oasr_models_nemo.nn import FastConformerNet, build_network

    cfg = NemoConfig(head="ctc", vocab_size=1025, blank_id=1024, num_mel_bins=128)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in FastConformerNet(cfg).state_dict().items()}
    net = build_network(cfg, _random_state(shapes, seed), device, dtype).eval()

    def run(feats, lens):
        return net.encoder(feats, lens)[0]

    return run, 128


def measure(name: str, device: str, repeats: int, seconds: float, batch: int = 0,
            seed: int = 0, profile_rows: int = 0) -> dict:
    import torch

    spec = dict(MODELS[name], **({"batch": batch} if batch else {}))
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    build = _wenet if spec["family"] == "wenet" else _nemo
    run, dim = build(spec, device, dtype, seed)
    frames = int(seconds * 100)
    g = torch.Generator().manual_seed(seed + 1)
    feats = torch.randn(spec["batch"], frames, dim, generator=g).to(device, dtype)
    lens = torch.full((spec["batch"],), frames, dtype=torch.long, device=device)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = run(feats, lens)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    best = min(times[1:])
    profile = None
    if profile_rows:
        from benchmarks.profiling import profile_call

        with torch.no_grad():
            profile = profile_call(lambda: run(feats, lens), device, rows=profile_rows)
    out = out.float()
    return {"model": name, "batch": spec["batch"], "seconds": seconds, "dtype": str(dtype)[6:],
            "encoder_s": round(best, 4), "rtfx": round(spec["batch"] * seconds / best, 1),
            "output_shape": list(out.shape), "output_mean_abs": float(out.abs().mean()),
            "output_row0": [round(float(v), 4) for v in out[0, :4, :4].flatten()],
            **({"profile": profile} if profile else {})}


def compare(old_path: Path, new_path: Path) -> list[dict]:
    old = {r["model"]: r for r in json.loads(old_path.read_text())["models"]}
    new = {r["model"]: r for r in json.loads(new_path.read_text())["models"]}
    rows = []
    for name in [n for n in new if n in old]:
        a, b = old[name], new[name]
        rel = abs(a["output_mean_abs"] - b["output_mean_abs"]) / max(a["output_mean_abs"], 1e-9)
        rows.append({"model": name, "old_s": a["encoder_s"], "new_s": b["encoder_s"],
                     "speedup": round(a["encoder_s"] / b["encoder_s"], 2),
                     "same_output": a["output_shape"] == b["output_shape"] and rel < 1e-2})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=0, help="override each model's batch")
    p.add_argument("--profile", action="store_true", help="profile one call of each model too")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--compare", type=Path, nargs=2, metavar=("OLD", "NEW"))
    args = p.parse_args(argv)
    if args.compare:
        print(json.dumps(compare(*args.compare), indent=1))
        return
    import torch

    torch.set_grad_enabled(False)
    rows = []
    for name in args.models.split(","):
        rows.append(measure(name, args.device, args.repeats, args.seconds, args.batch,
                            profile_rows=25 if args.profile else 0))
        print(json.dumps(rows[-1]), file=sys.stderr)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "models": rows}
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
