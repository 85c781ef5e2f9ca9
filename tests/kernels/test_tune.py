"""oasr.tune on the CPU: candidate selection with a fake timer, the JSON cache (location, merge,
env overrides, bad files) and what ``tuned_params`` returns."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from oasr import tune

IDENT = ("NVIDIA H200", "sm90")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No registered tunables but the test's, no env overrides, the memory cache cleared."""
    monkeypatch.setattr(tune, "_TUNABLES", [])
    monkeypatch.setattr(tune, "_BUILTIN", {})
    monkeypatch.delenv("OASR_AUTOTUNE_CACHE", raising=False)
    monkeypatch.delenv("OASR_AUTOTUNE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    tune.clear_memory_cache()
    yield tmp_path
    tune.clear_memory_cache()


def _tunable(times: dict[int, float], launched: list, op="toy_op", variant=""):
    """Candidates threads in ``times``; the fake 'kernel' records its launches; threads=999
    cannot launch."""

    def make(shape, dtype, device):
        def run(params):
            if params["threads"] == 999:
                return None
            launched.append((shape["n"], params["threads"]))
            return params["threads"]

        return run

    return tune.Tunable(
        op=op,
        key=lambda shape, dtype: f"{dtype}:n{shape['n']}",
        candidates=lambda shape: [{"threads": t} for t in [*times, 999]],
        make=make,
        default=lambda shape: {"threads": 128},
        shapes=[{"n": 1}, {"n": 2}],
        variant=variant,
        dtypes=("f16",),
    )


def fake_timer(times: dict[int, float], launched: list):
    def timer(run):
        threads = run()
        return times[threads] * (1 + len(launched) * 0)  # deterministic per candidate

    return timer


def test_cache_path_layout_and_override(fresh, monkeypatch) -> None:
    assert tune.cache_path("NVIDIA H200", "sm90") == fresh / "xdg" / "oasr" / "autotune" / "nvidia-h200-sm90.json"
    monkeypatch.setenv("OASR_AUTOTUNE_CACHE", str(fresh / "mine.json"))
    assert tune.cache_path("NVIDIA H200", "sm90") == fresh / "mine.json"


def test_autotune_picks_fastest_and_writes_cache(fresh) -> None:
    times = {64: 3e-6, 128: 2e-6, 256: 1e-6, 512: 4e-6}
    launched: list = []
    tune.register_tunable(_tunable(times, launched))
    report = tune.autotune(device="cpu", identity=IDENT, timer=fake_timer(times, launched))
    path = tune.cache_path(*IDENT)
    assert report["path"] == str(path)
    data = json.loads(path.read_text())
    assert data["version"] == tune.CACHE_VERSION and data["arch"] == "sm90" and data["device"] == "NVIDIA H200"
    for key in ("f16:n1", "f16:n2"):
        entry = data["entries"]["toy_op"][key]
        assert entry["params"] == {"threads": 256}
        assert entry["us"] == pytest.approx(1.0) and entry["default_us"] == pytest.approx(2.0)
        assert entry["candidates"] == 4  # threads=999 could not launch
    assert report["entries"]["toy_op"]["f16:n1"]["params"] == {"threads": 256}


def test_tuned_params_reads_cache_and_falls_back(fresh, monkeypatch) -> None:
    path = tune.cache_path(*IDENT)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 1, "device": IDENT[0], "arch": "sm90",
                                "entries": {"toy_op": {"k1": {"params": {"threads": 64}}}}}))  # fmt: skip
    monkeypatch.setattr(tune, "device_identity", lambda device=None: IDENT)
    default = {"threads": 128}
    assert tune.tuned_params("toy_op", "k1", "cuda:0", default) == {"threads": 64}
    assert tune.tuned_params("toy_op", "other", "cuda:0", default) is default
    assert tune.tuned_params("other_op", "k1", "cuda:0", default) is default
    monkeypatch.setenv("OASR_AUTOTUNE", "0")
    assert tune.tuned_params("toy_op", "k1", "cuda:0", default) is default
    monkeypatch.delenv("OASR_AUTOTUNE")
    # the file is read once per device: a change shows after clear_memory_cache()
    path.write_text(json.dumps({"version": 1, "device": IDENT[0], "arch": "sm90",
                                "entries": {"toy_op": {"k1": {"params": {"threads": 512}}}}}))  # fmt: skip
    assert tune.tuned_params("toy_op", "k1", "cuda:0", default) == {"threads": 64}
    tune.clear_memory_cache()
    assert tune.tuned_params("toy_op", "k1", "cuda:0", default) == {"threads": 512}


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 99, "arch": "sm90", "entries": {}}),
                                     json.dumps({"version": 1, "arch": "sm80", "entries": {"toy_op": {"k1": {"params": {}}}}})])  # fmt: skip
def test_bad_or_foreign_cache_files_mean_defaults(fresh, monkeypatch, caplog, content) -> None:
    path = tune.cache_path(*IDENT)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    monkeypatch.setattr(tune, "device_identity", lambda device=None: IDENT)
    with caplog.at_level("WARNING", logger="oasr.tune"):
        assert tune.tuned_params("toy_op", "k1", "cuda:0", {"threads": 1}) == {"threads": 1}
    assert "ignoring" in caplog.text


def test_autotune_keeps_other_entries_and_filters_ops(fresh) -> None:
    launched: list = []
    times = {64: 2e-6, 128: 1e-6}
    tune.register_tunable(_tunable(times, launched, op="toy_op"))
    tune.register_tunable(_tunable({64: 1e-6, 128: 2e-6}, [], op="other_op"))
    path = fresh / "c.json"
    path.write_text(json.dumps({"version": 1, "device": IDENT[0], "arch": "sm90",
                                "entries": {"old_op": {"x": {"params": {"threads": 32}}}}}))  # fmt: skip
    tune.autotune(ops=["toy_op"], shapes={"toy_op": [{"n": 7}]}, device="cpu", identity=IDENT,
                  timer=fake_timer(times, launched), path=path)  # fmt: skip
    data = json.loads(path.read_text())
    assert set(data["entries"]) == {"old_op", "toy_op"}  # other_op not tuned, old_op kept
    assert data["entries"]["toy_op"] == {"f16:n7": data["entries"]["toy_op"]["f16:n7"]}
    assert data["entries"]["toy_op"]["f16:n7"]["params"] == {"threads": 128}
    assert {n for n, _ in launched} == {7}
    with pytest.raises(KeyError, match="no tunable kernel"):
        tune.autotune(ops=["nope"], device="cpu", identity=IDENT, timer=fake_timer(times, []), path=path)


def test_register_tunable_replaces_same_op_and_variant(fresh) -> None:
    tune.register_tunable(_tunable({1: 1.0}, [], variant="a"))
    tune.register_tunable(_tunable({1: 1.0}, [], variant="b"))
    tune.register_tunable(_tunable({2: 1.0}, [], variant="a"))
    assert sorted(t.variant for t in tune.registered_tunables()) == ["a", "b"]


def test_import_oasr_tune_does_not_import_torch() -> None:
    code = "import sys, oasr.tune; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_autotune_compares_with_the_native_op(fresh) -> None:
    """With a native reference the entry says whether the kernel beat it (use_kernel)."""
    times = {64: 2e-6, 128: 1e-6, "native": 1.5e-6}
    launched: list = []
    tunable = _tunable({64: 2e-6, 128: 1e-6}, launched)
    tunable.native = lambda shape, dtype, device: (lambda: "native" if shape["n"] == 1 else "slow")
    tune.register_tunable(tunable)

    def timer(run):
        out = run()
        return {"slow": 5e-7}.get(out, times.get(out))

    report = tune.autotune(device="cpu", identity=IDENT, timer=timer, path=fresh / "n.json")
    entries = report["entries"]["toy_op"]
    assert entries["f16:n1"]["params"] == {"threads": 128, "use_kernel": True}  # 1.0 us < 1.5 us
    assert entries["f16:n1"]["native_us"] == pytest.approx(1.5)
    assert entries["f16:n2"]["params"] == {"threads": 128, "use_kernel": False}  # native 0.5 us


def test_builtin_entries_fill_in_for_the_file(fresh, monkeypatch) -> None:
    monkeypatch.setattr(tune, "device_identity", lambda device=None: IDENT)
    tune.register_builtin("sm90", {"toy_op": {"k1": {"params": {"threads": 32, "use_kernel": False}},
                                              "k2": {"threads": 96}}})  # fmt: skip
    tune.register_builtin("sm80", {"toy_op": {"k1": {"params": {"threads": 8}}}})
    assert tune.tuned_params("toy_op", "k1", "cuda:0", {}) == {"threads": 32, "use_kernel": False}
    assert tune.tuned_params("toy_op", "k2", "cuda:0", {}) == {"threads": 96}
    path = tune.cache_path(*IDENT)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 1, "device": IDENT[0], "arch": "sm90",
                                "entries": {"toy_op": {"k1": {"params": {"threads": 64}}}}}))  # fmt: skip
    tune.clear_memory_cache()
    assert tune.tuned_params("toy_op", "k1", "cuda:0", {}) == {"threads": 64}  # the file wins
    assert tune.tuned_params("toy_op", "k2", "cuda:0", {}) == {"threads": 96}
    monkeypatch.setenv("OASR_AUTOTUNE", "0")
    assert tune.tuned_params("toy_op", "k2", "cuda:0", {"threads": 1}) == {"threads": 1}


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy on an imported module
def test_python_dash_m_runs_the_imported_module(monkeypatch) -> None:
    """``python -m oasr.tune`` must tune through the imported ``oasr.tune``, whose registry the
    kernel providers fill, not through the ``__main__`` copy of the module (whose registry stays
    empty: on the H200 it reported no entries)."""
    import runpy

    import oasr.tune

    calls = []
    monkeypatch.setattr(oasr.tune, "main", lambda argv=None: calls.append(argv) or 0)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("oasr.tune", run_name="__main__")
    assert exit_info.value.code == 0 and calls == [None]
