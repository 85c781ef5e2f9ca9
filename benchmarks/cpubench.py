"""Whole-process CPU benchmark: the ``oasr transcribe`` command beside a faster-whisper script.

    python -m benchmarks.asrbench --workload cpu                    # quiet, every input set
    python -m benchmarks.asrbench --workload cpu --busy             # a CPU hog on core 0 too
    python -m benchmarks.asrbench --workload cpu --profile smoke    # one 2 s file, once: seconds
    python -m benchmarks.cpubench --inputs short,long --repeats 5 --json out.json

Each side is a fresh process, as a user runs it, on the same CTranslate2 tiny.en weights (the
CLI's default model) and the same files:

  oasr            ``oasr transcribe FILES --output-dir DIR`` (the CLI's defaults: greedy with
                  temperature fallback, the VAD gate on, its own thread choice)
  faster_whisper  ``python -m benchmarks.cpubench fw-worker FILES``: ``WhisperModel(ckpt,
                  compute_type="float32")`` and ``model.transcribe(f, beam_size=1)`` per file
                  (its defaults otherwise: the same temperature fallback, no VAD filter)

Inputs: ``short`` the nine English recordings of five sources and four containers
(~88 s), ``long`` one ~83 s WAV made of English recordings with 0.6 s gaps (sequential
long-form: three 30 s windows), ``startup`` one 2 s file (model load + first transcript).
The sides run in turn (oasr, faster-whisper, oasr, ...) ``--repeats`` times; the report gives
each side's median wall seconds, CPU seconds (user + system of the whole process tree), peak
memory (the largest sum of the tree's resident sets, sampled every 10 ms), corpus WER, and the
ratios OASR / faster-whisper. Both sides run with OASR's bytecode compiled beforehand
(:func:`compiled_env`: what an installed wheel has; site-packages, faster-whisper included,
already has its ``.pyc``). ``--busy`` keeps one pure-Python CPU hog pinned to core 0 for the
whole run (both sides under the same load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import wave
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPEECH = REPO / "tests" / "data" / "speech"
VENV_BIN = Path(sys.executable).parent

#: nine English recordings: five speakers / sources, FLAC, WAV, MP3 and Ogg/Opus
SHORT = [
    "en_jfk_inaugural.flac",
    "en_ls_1995-1837-0001.wav",
    "en_ls_1089-134686-0001.wav",
    "en_ls_1272-141231-0002.mp3",
    "en_fleurs_000.ogg",
    "en_fleurs_001.ogg",
    "en_fleurs_002.ogg",
    "en_fleurs_006.ogg",
    "en_fleurs_007.ogg",
]
#: concatenated (0.6 s gaps) into the long-form input, ~83 s
LONG = [name for name in SHORT if name != "en_fleurs_000.ogg"]
STARTUP = ["en_ls_2830-3980-0043.wav"]  # 1.975 s
GAP_S = 0.6
SR = 16000


@dataclass
class Run:
    side: str
    wall_s: float
    cpu_s: float
    peak_mb: float
    texts: list[str]


@dataclass
class InputResult:
    inputs: str
    files: int
    audio_s: float
    busy: bool
    runs: dict[str, list[dict]] = field(default_factory=dict)
    median: dict[str, dict] = field(default_factory=dict)
    wer: dict[str, float | None] = field(default_factory=dict)
    texts: dict[str, list[str]] = field(default_factory=dict)
    ratio: dict[str, float] = field(default_factory=dict)


def _manifest() -> dict[str, dict]:
    rows = [
        json.loads(line) for line in (SPEECH / "manifest.jsonl").read_text().splitlines() if line
    ]
    return {r["audio"]: r for r in rows}


def _write_long(path: Path) -> tuple[float, str]:
    """The long-form input: the LONG recordings decoded to 16 kHz mono, joined with gaps."""
    import numpy as np

    from oasr.audio import load_audio

    rows = _manifest()
    gap = np.zeros(int(GAP_S * SR), np.float32)
    parts: list = []
    for k, name in enumerate(LONG):
        parts += ([gap] if k else []) + [load_audio(str(SPEECH / name), SR)]
    audio = np.concatenate(parts)
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SR)
        w.writeframes(pcm.tobytes())
    return len(audio) / SR, " ".join(rows[name]["text"] for name in LONG)


def input_set(name: str, tmp: Path) -> tuple[list[Path], list[str], float]:
    """(files, reference texts, audio seconds) of an input set."""
    rows = _manifest()
    if name == "long":
        path = tmp / "en_longform_83s.wav"
        seconds, text = _write_long(path)
        return [path], [text], seconds
    names = {"short": SHORT, "startup": STARTUP}[name]
    return ([SPEECH / n for n in names], [rows[n]["text"] for n in names],
            sum(float(rows[n]["duration_s"]) for n in names))  # fmt: skip


# --------------------------------------------------------------------------- measuring a process
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


def compiled_env() -> dict[str, str]:
    """The environment both sides run in: Python's bytecode of every OASR source compiled
    beforehand, in place (each package's ``__pycache__``, git-ignored), as a wheel install has
    it. faster-whisper, torch and the rest of site-packages carry their ``.pyc`` files from pip;
    OASR's editable sources in a checkout may have none, and where ``PYTHONDONTWRITEBYTECODE``
    is set (as on CI machines) every OASR process would compile its ~70 modules again (about
    0.25 s here): a cost of the checkout, not of OASR. (It once compiled them under
    ``PYTHONPYCACHEPREFIX`` in a temporary directory; that prefix also hides site-packages' own ``.pyc``, so
    the first timed process compiled torch from source, ~4 s of CPU in its round.)"""
    import compileall

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    old = sys.pycache_prefix
    sys.pycache_prefix = None  # next to the sources, where the children look
    try:
        for src in sorted(REPO.glob("oasr*/src")):
            compileall.compile_dir(src, quiet=1, workers=1)
    finally:
        sys.pycache_prefix = old
    return env


def _tree(root: int) -> list[int]:
    """``root`` and its descendants (a scan of /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(
                    int(entry)
                )
            except (OSError, ValueError, IndexError):
                continue
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _rss_kb(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE_KB
        except (OSError, ValueError, IndexError):
            continue
    return total


def measure(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, float, str]:
    """Run ``cmd``; (wall s, CPU s of the process tree, peak tree RSS MB, stdout)."""
    out = tempfile.TemporaryFile()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, env=env, cwd=REPO)
    peak = [0]
    done = threading.Event()

    def sample() -> None:  # the tree is rescanned every 0.2 s, its RSS read every 10 ms
        pids, k = [proc.pid], 0
        while not done.is_set():
            pids = _tree(proc.pid) if k % 20 == 0 else pids
            peak[0] = max(peak[0], _rss_kb(pids))
            k += 1
            done.wait(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    err = proc.stderr.read() if proc.stderr else b""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    out.seek(0)
    stdout = out.read().decode()
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[:3])} ... failed ({proc.returncode}): {err.decode()[-2000:]}"
        )
    # ru_maxrss covers the largest single process (a peak between two samples)
    peak_kb = max(peak[0], usage.ru_maxrss)
    return wall, usage.ru_utime + usage.ru_stime, peak_kb / 1024, stdout


def oasr_cmd(files: list[Path], outdir: Path, extra: list[str]) -> list[str]:
    return [str(VENV_BIN / "oasr"), "transcribe", *map(str, files), "--output-dir", str(outdir),
            "-f", "txt", *extra]  # fmt: skip


def fw_cmd(files: list[Path], ckpt: str, threads: int) -> list[str]:
    return [sys.executable, "-m", "benchmarks.cpubench", "fw-worker", "--ckpt", ckpt,
            "--threads", str(threads), *map(str, files)]  # fmt: skip


def fw_worker(argv: list[str]) -> None:
    """The faster-whisper side: load, transcribe each file, print the texts as JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    from faster_whisper import WhisperModel

    model = WhisperModel(args.ckpt, device="cpu", compute_type="float32", cpu_threads=args.threads)
    texts = []
    for f in args.files:
        segments, _ = model.transcribe(f, beam_size=1)
        texts.append("".join(s.text for s in segments).strip())
    print(json.dumps(texts))


def run_side(side: str, files: list[Path], ckpt: str, args: argparse.Namespace, tmp: Path,
             env: dict[str, str] | None = None) -> Run:  # fmt: skip
    if side == "oasr":
        outdir = Path(tempfile.mkdtemp(dir=tmp))
        extra = ["--threads", str(args.threads)] if args.threads else []
        wall, cpu, peak, _ = measure(oasr_cmd(files, outdir, extra + args.oasr_args), env=env)
        texts = [(outdir / f"{f.stem}.txt").read_text().strip() for f in files]
    else:
        wall, cpu, peak, out = measure(fw_cmd(files, ckpt, args.threads), env=env)
        texts = json.loads(out.strip().splitlines()[-1])
    return Run(side, wall, cpu, peak, texts)


class Hog:
    """A pure-Python busy loop pinned to core 0 (``--busy``)."""

    def __init__(self, on: bool):
        self.on, self.proc = on, None

    def __enter__(self) -> Hog:
        if self.on:
            cmd = [sys.executable, "-c", "while True: pass"]
            self.proc = subprocess.Popen(["taskset", "-c", "0", *cmd])
            time.sleep(0.5)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def bench(args: argparse.Namespace) -> dict:
    from benchmarks.asrbench import corpus_wer, english_normalizer
    from oasr.defaults import default_checkpoint

    ckpt = args.ckpt_dir or str(default_checkpoint())
    sides = ["oasr", "faster_whisper"]
    results: list[InputResult] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        env = compiled_env()
        for name in args.inputs.split(","):
            files, refs, audio_s = input_set(name, tmp)
            res = InputResult(name, len(files), round(audio_s, 2), args.busy)
            runs: dict[str, list[Run]] = {s: [] for s in sides}
            with Hog(args.busy):
                for _ in range(args.repeats):
                    for side in sides:
                        runs[side].append(run_side(side, files, ckpt, args, tmp, env))
            for side in sides:
                res.runs[side] = [
                    {k: round(v, 3) for k, v in asdict(r).items() if k not in ("texts", "side")}
                    for r in runs[side]
                ]
                res.median[side] = {k: round(statistics.median(getattr(r, k) for r in runs[side]), 3)
                                    for k in ("wall_s", "cpu_s", "peak_mb")}  # fmt: skip
                res.wer[side] = round(corpus_wer(refs, runs[side][-1].texts), 2)
                res.texts[side] = runs[side][-1].texts
            for k in ("wall_s", "cpu_s", "peak_mb"):
                res.ratio[k] = round(res.median["oasr"][k] / res.median["faster_whisper"][k], 3)
            results.append(res)
    report = {
        "workload": "cpu",
        "busy": args.busy,
        "repeats": args.repeats,
        "threads": args.threads or "default",
        "cpus": os.cpu_count(),
        "oasr_args": args.oasr_args,
        "normalizer": english_normalizer()[1],
        "loadavg_after": os.getloadavg(),
        "results": [asdict(r) for r in results],
    }
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


def print_table(report: dict) -> None:
    load = "busy (hog on core 0)" if report["busy"] else "quiet"
    print(f"whole process, {load}, median of {report['repeats']}")
    print(f"{'inputs':8} {'side':15} {'wall s':>7} {'CPU s':>7} {'peak MB':>8} {'WER %':>6}")
    for r in report["results"]:
        for side in ("oasr", "faster_whisper"):
            m, wer = r["median"][side], r["wer"][side]
            w = f"{wer:6.2f}" if wer is not None else "     -"
            print(
                f"{r['inputs']:8} {side:15} {m['wall_s']:7.2f} {m['cpu_s']:7.2f} {m['peak_mb']:8.0f} {w}"
            )
        q = r["ratio"]
        print(
            f"{r['inputs']:8} {'oasr / fw':15} {q['wall_s']:6.2f}x {q['cpu_s']:6.2f}x {q['peak_mb']:7.2f}x"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cpu workload (benchmarks/cpubench.py)")
    group.add_argument(
        "--busy", action="store_true", help="cpu: a CPU hog pinned to core 0 during both sides"
    )
    group.add_argument(
        "--inputs", default=None, help="cpu: comma-separated of short,long,startup (all)"
    )
    group.add_argument(
        "--cpu-threads",
        type=int,
        default=0,
        help="cpu: both sides' threads (default 0: each one's own choice)",
    )
    group.add_argument("--oasr-arg", dest="oasr_args", action="append", default=[],
                       help="cpu: an extra `oasr transcribe` argument (repeatable)")  # fmt: skip


def main(argv: list[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["fw-worker"]:
        fw_worker(argv[1:])
        return None
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cpubench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--profile", choices=["smoke", "english"], default="english")
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", default=None)
    add_arguments(parser)
    return bench(resolve(parser.parse_args(argv)))


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Defaults that depend on the profile (shared with asrbench's arguments)."""
    smoke = args.profile == "smoke"
    args.inputs = args.inputs or ("startup" if smoke else "short,long,startup")
    args.repeats = args.repeats or (1 if smoke else 3)
    args.threads = args.cpu_threads
    return args


if __name__ == "__main__":
    main()
