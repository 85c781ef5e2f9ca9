"""examples/web in real headless Chromium (Debian's ``chromium``, driven over the DevTools
protocol) against a real ``oasr-server`` with the real Whisper tiny.en: Chromium's fake audio
capture plays a real speech file into the page's microphone path, the page streams it to
``/v1/realtime``, and its final text equals the engine's transcript of that file; then the page's
upload form returns subtitles with a download link. A screenshot is kept as a test artefact
(``$OASR_TEST_ARTIFACTS``, else the test's temporary directory)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
CLIP = REPO / "tests" / "data" / "speech" / "en_ls_1272-128104-0000.wav"
KEY = "k3y"


class DevTools:
    """A minimal Chrome DevTools Protocol client over one page target's WebSocket."""

    def __init__(self, url: str) -> None:
        from websockets.sync.client import connect

        self.ws = connect(url, max_size=None, open_timeout=10).__enter__()
        self.next_id = 0

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        mine = self.next_id
        self.ws.send(json.dumps({"id": mine, "method": method, "params": params}))
        while True:  # events (no id) are not used
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == mine:
                assert "error" not in message, (method, message["error"])
                return message["result"]

    def eval(self, expression: str):
        result = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)

    def close(self) -> None:
        self.ws.close()


def _fake_microphone_wav(path: Path) -> float:
    """The clip with 1 s of silence before and 3 s after (so server VAD ends the turn), 16-bit
    PCM WAV as Chromium's fake capture reads it. Returns its duration in seconds."""
    from oasr.audio import load_audio

    speech = load_audio(str(CLIP), 16000)
    audio = np.concatenate([np.zeros(16000, np.float32), speech, np.zeros(48000, np.float32)])
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    path.write_bytes(buf.getvalue())
    return len(audio) / 16000


@pytest.fixture(scope="module")
def whisper_server(ops, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    from oasr.defaults import default_checkpoint

    default_checkpoint()  # the real tiny.en must be installed (CI: scripts/setup.sh)
    tmp = tmp_path_factory.mktemp("whisper-server")
    server = ops.start_server(
        tmp, ["--decode-processes", "0", "--threads", "1"], key=KEY, ready_timeout=180
    )
    try:
        yield server
    finally:
        ops.stop_server(server)


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    wav = tmp_path_factory.mktemp("speech") / "microphone.wav"
    return wav, _fake_microphone_wav(wav)


@pytest.fixture(scope="module")
def reference(whisper_server, speech) -> tuple[str, str]:
    """The engine's answers for the file the browser plays, through the same server: the whole
    file uploaded, and the realtime turn(s) a plain Python client gets for it."""
    wav, _ = speech
    with httpx.Client(base_url=whisper_server.base, timeout=60) as c:
        r = c.post(
            "/v1/audio/transcriptions",
            files={"file": (wav.name, wav.read_bytes(), "audio/wav")},
            headers={"Authorization": f"Bearer {KEY}"},
        )
    assert r.status_code == 200, r.text
    whole_file, realtime = r.json()["text"].strip(), _realtime_transcript(whisper_server, wav)
    assert "quilter" in realtime.lower()
    # the VAD-cut turn and the whole file may differ in punctuation only (measured: one comma)
    assert _words(realtime) == _words(whole_file), (realtime, whole_file)
    return whole_file, realtime


@pytest.fixture
def browser(whisper_server, speech, ops, tmp_path: Path) -> Iterator[DevTools]:
    binary = ops.require_program(("chromium", "chromium-browser", "google-chrome"), "chromium")
    wav, _ = speech
    profile = tmp_path / "profile"
    args = [
        binary,
        "--headless=new",
        # our own page only; Chromium refuses its sandbox as root and in many containers
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--no-default-browser-check",
        "--use-fake-ui-for-media-stream",  # grant the microphone without a prompt
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}%noloop",
        "--autoplay-policy=no-user-gesture-required",
        "--remote-debugging-port=0",
        f"--user-data-dir={profile}",
        "--window-size=1100,1000",
        f"{whisper_server.base}/demo",
    ]
    log = tmp_path / "chromium.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.is_file() and port_file.read_text().strip()):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no DevTools port: {log.read_text()[-3000:]}"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(t for t in targets if t["type"] == "page")
        tools = DevTools(page["webSocketDebuggerUrl"])
        try:
            tools.wait(  # the target may still show about:blank when we attach
                "location.pathname === '/demo' && document.readyState === 'complete'",
                30,
                "the page to load",
            )
            tools.wait(  # without the key the page says what to do
                "document.getElementById('model').textContent.includes('API key')",
                10,
                "the key hint",
            )
            tools.eval(
                f"document.getElementById('key').value = {json.dumps(KEY)};"
                "document.getElementById('key').dispatchEvent(new Event('change'));"
                # every text the partial line shows, as the user would have seen it
                "window.partials = [];"
                "new MutationObserver(() =>"
                " partials.push(document.getElementById('partial').textContent))"
                ".observe(document.getElementById('partial'),"
                " {childList: true, characterData: true, subtree: true}); true"
            )
            tools.wait(
                "document.getElementById('model').textContent === 'oasr'", 10, "the model id"
            )
            yield tools
        finally:
            tools.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _realtime_transcript(server, wav: Path) -> str:
    """The final text of ``/v1/realtime`` (server VAD) for ``wav`` sent by a plain Python client:
    the engine's answer for the turn the server's VAD cuts from that audio."""
    import base64

    from websockets.sync.client import connect

    with wave.open(str(wav)) as w:
        rate, pcm = w.getframerate(), w.readframes(w.getnframes())
    with connect(
        f"ws://127.0.0.1:{server.port}/v1/realtime?intent=transcription",
        subprotocols=["realtime", f"openai-insecure-api-key.{server.key}"],
        open_timeout=10,
    ) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        update = {"input_audio_format": "pcm16", "input_audio_sample_rate": rate}
        ws.send(json.dumps({"type": "transcription_session.update", "session": update}))
        for i in range(0, len(pcm), rate // 5):
            chunk = base64.b64encode(pcm[i : i + rate // 5]).decode()
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        finals = []
        while True:  # every turn's final, until the server has nothing more to say
            try:
                event = json.loads(ws.recv(timeout=3 if finals else 60))
            except TimeoutError:
                break
            if event["type"] == "conversation.item.input_audio_transcription.completed":
                finals.append(event["transcript"].strip())
    return " ".join(finals)


def _words(text: str) -> list[str]:
    return re.sub(r"[^\w\s']", " ", text.lower()).split()


def _artifacts(tmp_path: Path) -> Path:
    where = Path(os.environ.get("OASR_TEST_ARTIFACTS") or tmp_path / "artifacts")
    where.mkdir(parents=True, exist_ok=True)
    return where


@pytest.mark.slow  # a real server with tiny.en and a real Chromium, speech played in real time
def test_demo_page_in_chromium(browser, speech, reference, tmp_path: Path) -> None:
    tools = browser
    _, seconds = speech
    whole_file, expected = reference
    tools.eval("document.getElementById('mic').click()")
    started = time.monotonic()
    tools.wait("live !== null && live.ws.readyState === 1", 15, "the realtime socket to open")
    tools.wait(
        "(() => { const li = [...document.querySelectorAll('#finals li')];"
        " return li.length && live && live.pending.size === 0 ? li.map(x => x.textContent) : null"
        "})()",
        seconds + 40,
        "a final transcript on the page",
    )
    # the whole clip has been played (fake capture runs in real time): no turn is left
    time.sleep(max(0.0, seconds - (time.monotonic() - started)))
    tools.wait("live.pending.size === 0", 30, "the last turn to finish")
    finals = tools.eval("[...document.querySelectorAll('#finals li')].map(x => x.textContent)")
    partials = tools.eval("partials.filter(t => t.trim())")
    status = tools.eval("document.getElementById('livestatus').textContent")
    assert " ".join(finals) == expected, (finals, expected, status)
    assert partials, "the page never showed partial text"
    tools.eval("document.getElementById('stop').click()")
    tools.wait("live === null", 20, "the live session to close")

    # the upload form: subtitles, shown and offered for download
    doc = tools.call("DOM.getDocument")
    node = tools.call("DOM.querySelector", nodeId=doc["root"]["nodeId"], selector="#file")
    tools.call("DOM.setFileInputFiles", nodeId=node["nodeId"], files=[str(CLIP)])
    tools.eval("document.getElementById('format').value = 'srt'")
    tools.eval("document.getElementById('send').click()")
    tools.wait("!document.getElementById('download').hidden", 60, "the upload's result")
    shown = tools.eval("document.getElementById('result').textContent")
    assert "-->" in shown and _words(whole_file) == _words(
        " ".join(
            line for line in shown.splitlines() if line and "-->" not in line and not line.isdigit()
        )
    ), shown
    name = tools.eval("document.getElementById('download').download")
    assert name == CLIP.stem + ".srt"
    downloaded = tools.eval("fetch(document.getElementById('download').href).then(r => r.text())")
    assert downloaded == shown

    import base64

    shot = tools.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
    png = _artifacts(tmp_path) / "web_demo.png"
    png.write_bytes(base64.b64decode(shot["data"]))
    assert png.stat().st_size > 10_000
    print(f"screenshot: {png}")


@pytest.mark.slow  # the file is played in real time
def test_demo_page_plays_a_file(browser, speech, reference) -> None:
    """The page's other live source: a chosen file decoded and played into /v1/realtime; the
    page closes the session by itself once the file ended and its last turn arrived."""
    tools = browser
    wav, seconds = speech
    _, expected = reference
    doc = tools.call("DOM.getDocument")
    node = tools.call("DOM.querySelector", nodeId=doc["root"]["nodeId"], selector="#playfile")
    tools.call("DOM.setFileInputFiles", nodeId=node["nodeId"], files=[str(wav)])
    tools.wait("live !== null", 10, "the live session to start")
    tools.wait("live === null", seconds + 40, "the page to end the session after the file")
    finals = tools.eval("[...document.querySelectorAll('#finals li')].map(x => x.textContent)")
    status = tools.eval("document.getElementById('livestatus').textContent")
    assert status == "idle" and " ".join(finals) == expected, (finals, expected, status)
    assert tools.eval("partials.filter(t => t.trim()).length") > 0
