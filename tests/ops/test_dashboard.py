"""deploy/grafana/oasr.json against a real Prometheus (Debian's ``prometheus``) scraping a real
``oasr-server``: every panel's PromQL returns data, and names only metrics the server exports."""

from __future__ import annotations

import base64
import json
import math
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "oasr.json"
PROMETHEUS_YML = REPO / "deploy" / "prometheus.yml"
SPEECH = REPO / "tests" / "data" / "speech" / "en_ls_2830-3980-0043.wav"
#: What Grafana puts for the dashboard's variables (the instance variable's "All" is ".*"; the
#: rate window is at least four scrape intervals, the test scrapes every second).
VARIABLES = {"$__rate_interval": "30s", "$instance": ".*"}
#: Panels that have data only where the model runs on a CUDA device.
GPU_ONLY = {"oasr_gpu_memory_bytes"}
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, rows' nested panels included."""
    out = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                out.append((panel["title"], target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (every identifier that starts ``oasr_``)."""
    return set(re.findall(r"\boasr_[a-zA-Z0-9_]+", expr))


def exported_families(metrics_text: str) -> set[str]:
    """Metric family names of a Prometheus text exposition (its ``# TYPE`` lines)."""
    families = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            families.add(name)
            if kind == "counter" and not name.endswith("_total"):
                families.add(name + "_total")
    return families


def unknown_metrics(dashboard: dict, families: set[str]) -> list[str]:
    """``panel: name`` for every metric a query names that is not one of ``families``."""
    missing = []
    for title, expr in panel_queries(dashboard):
        for name in sorted(metric_names(expr)):
            base = name
            if base not in families:
                for suffix in _SUFFIXES:
                    if base.endswith(suffix) and base[: -len(suffix)] in families:
                        base = base[: -len(suffix)]
                        break
            if base not in families:
                missing.append(f"{title}: {name}")
    return missing


def substitute(expr: str) -> str:
    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"a dashboard variable the test does not know: {expr}"
    return expr


def test_dashboard_queries_name_only_exported_metrics() -> None:
    """Offline: every query parses into names of metrics the server's registry exports, and a
    query naming a metric the server does not export is caught."""
    from oasr_server.metrics import ServerMetrics

    dashboard = json.loads(DASHBOARD.read_text())
    families = exported_families(ServerMetrics().render().decode())
    assert "oasr_gpu_memory_bytes" in families  # declared even on a CPU server
    queries = panel_queries(dashboard)
    assert len(queries) >= 20
    assert unknown_metrics(dashboard, families) == []
    named = set().union(*(metric_names(e) for _, e in queries))
    for needed in (
        "oasr_requests_total",
        "oasr_errors_total",
        "oasr_request_duration_seconds_bucket",
        "oasr_rtfx",
        "oasr_request_rtfx_bucket",
        "oasr_queue_depth",
        "oasr_engine_in_flight",
        "oasr_streams_active",
        "oasr_batch_size_bucket",
        "oasr_gpu_memory_bytes",
    ):
        assert needed in named, needed
    broken = json.loads(DASHBOARD.read_text())
    broken["panels"][1]["targets"][0]["expr"] = "sum(rate(oasr_decode_pool_jobs_total[5m]))"
    assert unknown_metrics(broken, families) == [
        f"{broken['panels'][1]['title']}: oasr_decode_pool_jobs_total"
    ]


@pytest.fixture(scope="module")
def prometheus(energy_server, ops, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Prometheus on a free port with deploy/prometheus.yml's scrape job pointed at the test
    server (1 s scrapes, the server's API key in a credentials file, as the file's comment says)."""
    binary = ops.require_program(("prometheus",), "prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    job["scrape_interval"] = job["scrape_timeout"] = "1s"
    job["static_configs"] = [{"targets": [f"127.0.0.1:{energy_server.port}"]}]
    (tmp / "key").write_text(energy_server.key)
    job["authorization"] = {"type": "Bearer", "credentials_file": str(tmp / "key")}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = ops.free_port()
    log = tmp / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        with httpx.Client(base_url=base, timeout=5) as c:
            while True:
                assert proc.poll() is None, log.read_text()[-3000:]
                try:
                    targets = c.get("/api/v1/targets").json()["data"]["activeTargets"]
                    if targets and targets[0]["health"] == "up":
                        break
                except (httpx.TransportError, ValueError, KeyError):
                    pass
                assert time.monotonic() < deadline, f"no healthy scrape: {log.read_text()[-3000:]}"
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _realtime_stream(port: int, key: str) -> None:
    """A realtime WebSocket session with server VAD on real speech, to its completed turn."""
    from websockets.sync.client import connect

    from oasr.audio import load_audio

    speech = load_audio(str(SPEECH), 24000)
    audio = np.concatenate([np.zeros(12000, np.float32), speech, np.zeros(24000, np.float32)])
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    with connect(
        f"ws://127.0.0.1:{port}/v1/realtime?intent=transcription",
        subprotocols=["realtime", f"openai-insecure-api-key.{key}"],
        open_timeout=10,
    ) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        for i in range(0, len(pcm), 9600):
            chunk = base64.b64encode(pcm[i : i + 9600]).decode()
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        while True:
            event = json.loads(ws.recv(timeout=20))
            if event["type"] == "conversation.item.input_audio_transcription.completed":
                break


def _traffic(server) -> None:
    auth = {"Authorization": f"Bearer {server.key}"}
    wav = SPEECH.read_bytes()
    with httpx.Client(base_url=server.base, timeout=30) as c:
        for fmt in ("json", "verbose_json", "srt"):
            r = c.post(
                "/v1/audio/transcriptions",
                files={"file": ("speech.wav", wav, "audio/wav")},
                data={"model": "energy", "response_format": fmt},
                headers=auth,
            )
            assert r.status_code == 200, r.text
        bad = c.post(
            "/v1/audio/transcriptions",
            files={"file": ("noise.wav", b"not audio at all" * 64, "audio/wav")},
            headers=auth,
        )
        assert bad.status_code == 400, bad.text
        denied = c.post("/v1/audio/transcriptions", files={"file": ("a.wav", wav, "audio/wav")})
        assert denied.status_code == 401
    _realtime_stream(server.port, server.key)


def _wait_for_scrapes(c: httpx.Client, n: int) -> None:
    """Until Prometheus has stored ``n`` more scrapes of the server (by sample timestamp)."""

    def last() -> float:
        r = c.get("/api/v1/query", params={"query": "max(timestamp(oasr_model_ready))"})
        result = r.json()["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0

    deadline = time.monotonic() + 30
    for _ in range(n):
        seen = last()
        while last() <= seen:
            assert time.monotonic() < deadline, "Prometheus stopped scraping the server"
            time.sleep(0.2)


@pytest.mark.slow  # a real oasr-server and a real Prometheus
def test_every_panel_returns_data_from_a_real_prometheus(energy_server, prometheus) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    with httpx.Client(base_url=prometheus, timeout=10) as c:
        # two rounds of traffic with scrapes between, so rates and quantiles see increases
        _traffic(energy_server)
        _wait_for_scrapes(c, 2)
        _traffic(energy_server)
        _wait_for_scrapes(c, 2)
        # the GPU series exist only on a CUDA server; the family is still declared on the CPU
        meta = c.get("/api/v1/targets/metadata", params={"metric": "oasr_gpu_memory_bytes"})
        assert meta.json()["data"], "Prometheus saw no oasr_gpu_memory_bytes metadata"
        empty, nan = [], []
        for title, expr in panel_queries(dashboard):
            r = c.get("/api/v1/query", params={"query": substitute(expr)})
            assert r.status_code == 200 and r.json()["status"] == "success", (title, r.text)
            result = r.json()["data"]["result"]
            if metric_names(expr) & GPU_ONLY:
                assert result == [], (title, result)  # a CPU server reports no GPU memory
                continue
            if not result:
                empty.append(f"{title}: {expr}")
            elif not any(math.isfinite(float(s["value"][1])) for s in result):
                nan.append(f"{title}: {expr}")
        assert empty == [], "panels without data:\n" + "\n".join(empty)
        assert nan == [], "panels with only NaN:\n" + "\n".join(nan)
        up = c.get("/api/v1/query", params={"query": "oasr_model_ready"}).json()
        assert float(up["data"]["result"][0]["value"][1]) == 1.0
        statuses = c.get(
            "/api/v1/query",
            params={
                "query": "sum by (status) (oasr_requests_total{route='/v1/audio/transcriptions'})"
            },
        ).json()["data"]["result"]
        by_status = {s["metric"]["status"]: float(s["value"][1]) for s in statuses}
        assert by_status == {"200": 6.0, "400": 2.0, "401": 2.0}, by_status


def test_prometheus_yml_is_valid(ops) -> None:
    promtool = ops.require_program(("promtool",), "prometheus")
    out = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.gpu
def test_gpu_memory_panel_series_exist_on_cuda() -> None:
    """On a CUDA device the server's collector exports every ``kind`` the GPU panel selects
    (the CPU runs above see none). Run: ``pytest -m gpu tests/ops``."""
    import torch
    from prometheus_client.parser import text_string_to_metric_families

    from oasr_server.metrics import ServerMetrics

    held = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB allocated
    metrics = ServerMetrics()
    metrics.bind_gpu("cuda")
    samples = {
        s.labels["kind"]: s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        if family.name == "oasr_gpu_memory_bytes"
        for s in family.samples
    }
    gpu_exprs = [e for _, e in panel_queries(json.loads(DASHBOARD.read_text())) if "gpu" in e]
    kinds = set(re.findall(r"allocated|reserved|used|total", " ".join(gpu_exprs)))
    assert kinds == {"allocated", "reserved", "used", "total"}
    assert set(samples) == kinds, samples
    assert samples["allocated"] >= held.numel()
    assert samples["reserved"] >= samples["allocated"]
    assert 0 < samples["used"] <= samples["total"]
