"""The playground in a real headless Chromium, against a real server on loopback.

The server runs as `bash scripts/serve.sh` does on a checkout without weights: the torch engine on
the tiny random-weight models it falls back to (so the page must show its warning), SNAC noise
off, on CPU. The page runs under its own Content-Security-Policy, plays through its AudioWorklet,
and reports what reached the audio graph through `window.orpheusPlayground.snapshot()`, whose
player figures are counted on the audio thread by the worklet itself.

A screenshot after an utterance is left in results/browser/playground.png; with
UPDATE_SCREENSHOTS=1 it also replaces docs/images/playground.png, the one the README shows.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from orpheus_serve.api.gateway import voice_list
from orpheus_serve.api.launch import ServerThread
from orpheus_serve.audio.encoding import decode_audio
from orpheus_serve.token_format import SAMPLES_PER_FRAME
from tests.browser_support import ARTIFACTS, CHROMIUM_ARGS, ROOT, Tab, chromium_path, open_tab, sync_playwright
from tests.gateway_support import sim_config, start_server, stats, tiny_config, wait_for
from tests.pace import MachinePace

pytestmark = pytest.mark.browser

KEY = "playground-test-key"
SPEAK_TEXT = "Hey there! <laugh> This is Orpheus, streaming from your own server."
# ~200 characters: the budget is text-proportional, so this runs for many seconds of audio.
LONG_TEXT = ("This sentence is long enough that the request is still being generated when the listener "
             "decides to press Stop, which must cancel it on the server and silence the page at once, "
             "whatever is still buffered.")


@pytest.fixture(scope="module")
def server(tiny_orpheus: Path, tiny_snac: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    # Paths that hold no checkpoint: the server falls back to the tiny models and says so.
    absent = tmp_path_factory.mktemp("no-weights")
    config = tiny_config(tiny_orpheus, tiny_snac, **{
        "engine.model_path": str(absent / "orpheus"), "codec.path": str(absent / "snac"),
        "sampling.max_tokens": 2100})
    srv = start_server(config)
    assert srv.server.service.model_info.tiny
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed_server(tiny_orpheus: Path) -> Iterator[ServerThread]:
    srv = start_server(sim_config(tiny_orpheus, **{"server.api_keys": [KEY]}))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    executable = chromium_path()
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def tab(browser: Any, server: ServerThread, pace: MachinePace) -> Iterator[Tab]:
    tab = open_tab(browser, f"{server.base_url}/", slowness=pace.stretch())
    tab.wait("document.querySelectorAll('#voice option[value]:not([value=\"\"])').length", 20, "voices listed")
    yield tab
    tab.page.context.close()


def _played_s(tab: Tab) -> float:
    player = tab.snapshot()["player"]
    return 0.0 if player is None else player["played"] / player["sampleRate"]


def _speak(tab: Tab, text: str) -> None:
    tab.page.fill("#text", text)
    tab.page.click("#speak")


def _last_job(tab: Tab) -> dict[str, Any]:
    return tab.snapshot()["jobs"][-1]


def test_page_loads_clean_with_voices_from_the_server(tab: Tab, server: ServerThread) -> None:
    page = tab.page
    options = page.eval_on_selector_all("#voice option", "options => options.map(o => o.value)")
    assert options == [v["id"] for v in voice_list()]
    assert page.input_value("#voice") == "tara"
    # The server serves the tiny random-weight model: the page says so.
    assert page.is_visible("#tiny-banner")
    assert "noise" in page.inner_text("#tiny-banner")
    assert page.is_hidden("#error-banner") and page.is_hidden("#cancel-ack")
    assert page.inner_text("#model-line").startswith("Model orpheus-tiny")
    # The server panel fills from /v1/stats within a poll or two.
    tab.wait("/^\\d+$/.test(document.getElementById('s-active').textContent)", 5, "server panel filled")
    assert page.inner_text("#readiness") == "server ready"
    assert page.inner_text("#s-kv") == f"0 / {server.server.config.scheduler.max_concurrent_sessions}"
    # The server's own warning, naming the missing checkpoints, is one click away.
    assert page.is_hidden("#tiny-text")
    page.click("#tiny-banner summary")
    assert "not found" in page.inner_text("#tiny-text")
    page.click("#tiny-banner summary")
    # Every compatible API, with the addresses a client of this server would use.
    endpoints = page.eval_on_selector_all("#endpoints dt", "terms => terms.map(t => t.textContent)")
    assert endpoints == ["OpenAI", "Native WebSocket", "Cartesia", "ElevenLabs", "gRPC", "Monitoring"]
    panel = page.inner_text("#endpoints")
    for needed in (f"{server.base_url}/v1", f"{server.base_url.replace('http', 'ws')}/v1/audio/stream",
                   f"{server.base_url.replace('http', 'ws')}/tts/websocket", "/tts/bytes", "/tts/sse",
                   "/v1/text-to-speech/{voice_id}", "stream-input", "multi-stream-input", "/v1/voices",
                   "orpheus.v1.Synthesizer", "RivaSpeechSynthesis", "/metrics", "/v1/stats"):
        assert needed in panel, (needed, panel)
    for link in page.eval_on_selector_all("#endpoints a", "links => links.map(a => a.href)"):
        assert httpx.get(link).status_code == 200, link
    assert page.eval_on_selector_all("#tags button", "chips => chips.map(c => c.textContent)") == [
        "<laugh>", "<chuckle>", "<sigh>", "<cough>", "<sniffle>", "<groan>", "<yawn>", "<gasp>"]

    # Every control has an accessible name.
    unnamed = tab.js("""[...document.querySelectorAll('input, select, textarea, button, meter')]
        .filter(el => !(el.labels && el.labels.length) && !el.getAttribute('aria-label')
                      && !(el.tagName === 'BUTTON' && el.textContent.trim()))
        .map(el => el.id || el.outerHTML)""")
    assert unnamed == []
    # Keyboard: a chip inserts its tag where the caret is; Tab reaches Speak, with a visible focus ring.
    page.fill("#text", "Hello there.")
    page.focus("#text")
    page.keyboard.press("End")
    page.keyboard.press("Tab")
    page.keyboard.press("Tab")  # the second chip, <chuckle>
    page.keyboard.press("Enter")
    assert page.input_value("#text") == "Hello there. <chuckle>"
    for _ in range(20):
        if tab.js("document.activeElement.id") == "speak":
            break
        page.keyboard.press("Tab")
    assert tab.js("document.activeElement.id") == "speak"
    focus = tab.js("""(() => { const el = document.activeElement, style = getComputedStyle(el);
        return {visible: el.matches(':focus-visible'), outline: style.outlineStyle, width: style.outlineWidth}; })()""")
    assert focus["visible"] and focus["outline"] != "none" and focus["width"] != "0px", focus
    assert tab.errors == []


TYPED = ["Hello there. How", "Hello there. How are you? I owe 3.5",
         'Hello there. How are you? I owe 3.5 euros! She said "stop." Then',
         'Hello there. How are you? I owe 3.5 euros! She said "stop." Then a line\nand…']
TTFB_METRICS = "\n".join([
    "# TYPE orpheus:time_to_first_byte_seconds histogram",
    *(f'orpheus:time_to_first_byte_seconds_bucket{{le="{le}",protocol="rest"}} {n}'
      for le, n in (("0.1", 0.0), ("0.2", 1.0), ("0.3", 2.0), ("+Inf", 2.0))),
    # Label order differs between exporters; the page must not care.
    *(f'orpheus:time_to_first_byte_seconds_bucket{{protocol="ws",le="{le}"}} {n}'
      for le, n in (("0.1", 0.0), ("0.2", 1.0), ("0.3", 2.0), ("+Inf", 3.0))),
    'orpheus:time_to_first_byte_seconds_count{protocol="ws"} 3.0',
])


def test_sentence_cutting_and_ttfb_percentiles_in_the_page(tab: Tab) -> None:
    """The page's own helpers, imported into the page as modules (under its policy)."""
    results = tab.page.evaluate("""async ([typed, metrics]) => {
        const load = (name) => import(new URL(`playground/static/js/${name}`, document.baseURI).href);
        const { SentenceCutter } = await load("sentences.js");
        const { histogramBuckets, histogramQuantile } = await load("server-panel.js");
        const cutter = new SentenceCutter();
        const steps = typed.map((text) => cutter.take(text));
        const last = typed[typed.length - 1];
        const pending = cutter.pendingEndsSentence(last);
        steps.push(cutter.take(last, { final: true }));
        const buckets = histogramBuckets(metrics, "orpheus:time_to_first_byte_seconds");
        return { steps, pending, buckets: buckets.map(([bound, count]) => [String(bound), count]),
                 p50: histogramQuantile(0.5, buckets), p95: histogramQuantile(0.95, buckets),
                 empty: histogramQuantile(0.5, []) };
    }""", [TYPED, TTFB_METRICS])
    # "3." may still become "3.5": a boundary needs whitespace after it; closing quotes stay with the sentence.
    assert results["steps"] == [["Hello there."], ["How are you?"], ["I owe 3.5 euros!", 'She said "stop."'],
                                ["Then a line"], ["and…"]]
    assert results["pending"] is True
    assert results["buckets"] == [["0.1", 0], ["0.2", 2], ["0.3", 4], ["Infinity", 5]]
    # Rank 2.5 of 5 falls a quarter of the way into (0.2, 0.3], which holds observations 3 and 4.
    assert results["p50"] == pytest.approx(0.225)
    assert results["p95"] == 0.3  # past the last finite bound, that bound is all that is known
    assert results["empty"] is None
    assert tab.errors == []


def test_speak_streams_audio_through_the_worklet_and_the_server_counts_it(tab: Tab, server: ServerThread) -> None:
    before = stats(server)
    started = time.perf_counter()
    _speak(tab, SPEAK_TEXT)
    tab.wait("window.orpheusPlayground.snapshot().jobs.some(j => j.state === 'done')", 60, "request done")
    elapsed_s = time.perf_counter() - started
    tab.wait("(() => { const p = window.orpheusPlayground.snapshot().player;"
             " return p.played > 1.2 * p.sampleRate; })()", 30, "more than a second played")
    snapshot = tab.snapshot()
    player, job = snapshot["player"], snapshot["jobs"][-1]
    assert player["kind"] == "worklet"
    # Counted by the AudioWorklet on the audio thread: samples that went out into the audio graph.
    assert player["played"] > player["sampleRate"]
    assert tab.js("window.orpheusPlayground.playback.player.context.currentTime") > 1.0
    assert player["received"] * 2 == job["bytes"] == job["metrics"]["bytes"]

    # The page shows the time to first audio, below the request's total time.
    ttfb_text = tab.page.inner_text("#m-ttfb")
    assert re.fullmatch(r"\d+ ms", ttfb_text), ttfb_text
    ttfb_ms = float(tab.page.get_attribute("#m-ttfb", "data-ms"))
    total_ms = float(tab.page.get_attribute("#m-total", "data-ms"))
    assert 0 < ttfb_ms < total_ms <= elapsed_s * 1000
    assert re.fullmatch(r"\d+\.\d\d \(\d+\.\d× real time\)", tab.page.inner_text("#m-rtf"))
    assert tab.page.inner_text("#m-underruns") != "—"

    # The server counted it, as a WebSocket request that completed.
    wait_for(lambda: stats(server)["gateway"]["requests"]["ws"].get("ok", 0)
             == before["gateway"]["requests"]["ws"].get("ok", 0) + 1, tab.window(5), "request counted")
    after = stats(server)
    assert after["scheduler"]["total_sessions"] > before["scheduler"]["total_sessions"]
    assert after["requests"]["requests_completed"] == before["requests"].get("requests_completed", 0) + 1
    # ...and the page's server panel shows it.
    tab.wait(f"document.getElementById('s-completed').textContent === '{after['requests']['requests_completed']}'",
             5, "panel updated")

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "playground.png"
    assert tab.page.is_hidden("#error-banner")
    # The screenshot goes into the README: nothing of this machine's folders in what it shows.
    visible = tab.page.inner_text("body")
    assert server.server.service.model_info.model_path not in visible
    assert not re.search(r"/tmp/|pytest-|/home/|/root/", visible), visible
    tab.page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    if os.environ.get("UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(shot, ROOT / "docs" / "images" / "playground.png")
    assert tab.errors == []


def test_stop_cancels_on_the_server_and_the_audio_stops(tab: Tab, server: ServerThread) -> None:
    before = stats(server)
    _speak(tab, LONG_TEXT)
    tab.wait("(() => { const p = window.orpheusPlayground.snapshot().player;"
             " return p && p.played > 0.3 * p.sampleRate; })()", 30, "playing")
    job = _last_job(tab)
    assert job["state"] == "streaming"  # still being generated
    tab.page.click("#stop")
    tab.wait("!document.getElementById('cancel-ack').hidden", 10, "cancel acknowledged")
    ack_text = tab.page.inner_text("#cancel-ack")
    assert f"request {job['id']} cancelled" in ack_text, ack_text
    stopped = _last_job(tab)
    assert stopped["state"] == "cancelled" and stopped["ack"]["cancelled"] is True
    assert stopped["ack"]["request_id"] == job["id"]

    # The server's cancelled counters rise, and its slot is free again.
    wait_for(lambda: stats(server)["requests"].get("requests_cancelled", 0)
             == before["requests"].get("requests_cancelled", 0) + 1, tab.window(5), "service counted the cancel")
    wait_for(lambda: stats(server)["gateway"]["requests"]["ws"].get("cancelled", 0)
             == before["gateway"]["requests"]["ws"].get("cancelled", 0) + 1, tab.window(5), "gateway counted the cancel")
    wait_for(lambda: stats(server)["scheduler"]["active_sessions"] == 0, tab.window(5), "session gone")
    # Nothing more arrives on the socket, and nothing more is played.
    settled = tab.snapshot()
    time.sleep(1.0)
    later = tab.snapshot()
    assert later["socketBytes"] == settled["socketBytes"]
    assert later["player"]["played"] == settled["player"]["played"]
    assert later["player"]["buffered"] == 0 and later["player"]["state"] == "idle"
    # It stopped early: less audio than the request's token budget would have made.
    budget_tokens = server.server.config.sampling.max_tokens
    assert stopped["bytes"] < budget_tokens // 7 * SAMPLES_PER_FRAME * 2
    assert tab.page.is_disabled("#stop")
    assert tab.errors == []


def _live_jobs(tab: Tab) -> list[dict[str, Any]]:
    return [j for j in tab.snapshot()["jobs"] if j["origin"] == "live"]


def test_typing_streams_each_sentence_into_one_context_as_it_is_finished(tab: Tab, server: ServerThread) -> None:
    page = tab.page
    before = stats(server)["gateway"]["requests"]["ws"]
    page.click("#live-text")
    page.keyboard.type("Hello there, and welcome to the show. ")
    # Sent while the person is still typing: the context opens with the first sentence.
    tab.wait("window.orpheusPlayground.snapshot().jobs.some(j => j.origin === 'live' && j.state !== 'queued')",
             10, "context opened")
    page.keyboard.type("How are you")
    time.sleep(0.3)
    (context,) = _live_jobs(tab)
    assert context["contextId"] == context["id"] and context["flushes"] == 1  # no boundary yet
    assert context["text"] == "Hello there, and welcome to the show. "
    page.keyboard.type("? ")
    tab.wait("(() => { const live = window.orpheusPlayground.snapshot().jobs.filter(j => j.origin === 'live');"
             " return live.length === 1 && live[0].flushed === 2; })()", 60, "both sentences spoken")
    # One request for both sentences: one context, open until it idles out or is stopped; the server cut
    # its text into one generation chunk per flushed sentence, spoken back to back.
    (context,) = _live_jobs(tab)
    assert context["text"] == "Hello there, and welcome to the show. How are you? "
    assert context["state"] == "streaming" and context["flushes"] == 2 and context["bytes"] > 0
    tab.wait("window.orpheusPlayground.snapshot().jobs.filter(j => j.origin === 'live')[0].chunks.length === 2",
             10, "both chunks' timings")
    assert _live_jobs(tab)[0]["chunks"] == ["Hello there, and welcome to the show.", "How are you?"]
    assert stats(server)["gateway"]["active_streams"]["ws"] == 1
    utterance = tab.snapshot()["utterance"]
    assert utterance["jobs"] == [context["id"]] and utterance["bytes"] == context["bytes"]
    items = page.eval_on_selector_all("#live-list li", "items => items.map(i => i.dataset.state)")
    assert items == ["spoken", "spoken"]
    assert re.fullmatch(r"spoken · first audio \d+ ms", page.inner_text("#live-list li .state"))
    # Everything flushed has played out: the page's player ran dry without counting an underrun for it.
    tab.wait("window.orpheusPlayground.snapshot().player.state === 'idle'", 30, "played out")
    assert tab.snapshot()["streaming"] is True  # still the context's stream, waiting for more text

    # Clear stops the context: the server counts one request, cancelled, for both sentences.
    page.click("#live-clear")
    wait_for(lambda: stats(server)["gateway"]["requests"]["ws"].get("cancelled", 0) == before.get("cancelled", 0) + 1,
             tab.window(5), "the context's request counted")
    assert stats(server)["gateway"]["active_streams"]["ws"] == 0
    assert _live_jobs(tab)[0]["state"] == "cancelled"
    assert page.eval_on_selector_all("#live-list li", "items => items.length") == 0
    # The next sentence opens a new context.
    page.keyboard.type("Back again. ")
    tab.wait("window.orpheusPlayground.snapshot().jobs.filter(j => j.origin === 'live' && j.flushed === 1)"
             ".length === 1 && window.orpheusPlayground.snapshot().jobs.filter(j => j.origin === 'live').length === 2",
             60, "a second context spoke")
    assert tab.errors == []


def test_downloads_the_last_utterance_as_wav_and_any_format_through_rest(tab: Tab) -> None:
    page = tab.page
    _speak(tab, "Hello there.")
    tab.wait("window.orpheusPlayground.snapshot().jobs.some(j => j.state === 'done')", 60, "request done")
    page.keyboard.press("Escape")  # stop playing out the buffer; the utterance stays downloadable
    tab.wait("!window.orpheusPlayground.snapshot().streaming", 10, "stopped")
    utterance = tab.snapshot()["utterance"]
    with page.expect_download() as download:
        page.click("#dl-wav")
    wav = Path(download.value.path()).read_bytes()
    assert download.value.suggested_filename.startswith("orpheus-tara-") and wav[:4] == b"RIFF"
    channels, rate = struct.unpack_from("<HI", wav, 22)
    assert (channels, rate) == (1, utterance["sampleRate"])
    assert struct.unpack_from("<I", wav, 40)[0] == utterance["bytes"] == len(wav) - 44
    samples, wav_rate = decode_audio(wav, "wav")
    assert wav_rate == 24000 and len(samples) == utterance["bytes"] // 2

    page.select_option("#dl-format", "flac")
    with page.expect_download() as download:
        page.click("#dl-rest")
    flac = Path(download.value.path()).read_bytes()
    assert download.value.suggested_filename.endswith(".flac") and flac[:4] == b"fLaC"
    samples, rate = decode_audio(flac, "flac")
    assert rate == 24000 and len(samples) > 2048
    assert tab.errors == []


def test_plays_through_scheduled_buffers_where_there_is_no_audio_worklet(browser: Any, server: ServerThread,
                                                                        pace: MachinePace) -> None:
    """Pages served over plain http to another machine get no AudioWorklet; ?player=scheduled is that path."""
    tab = open_tab(browser, f"{server.base_url}/playground?player=scheduled", slowness=pace.stretch())
    try:
        tab.wait("document.querySelectorAll('#voice option').length === 8", 20, "voices listed")
        _speak(tab, "Hello there, and welcome.")
        tab.wait("(() => { const p = window.orpheusPlayground.snapshot().player;"
                 " return p && p.played > 0.5 * p.sampleRate; })()", 60, "playing")
        assert tab.snapshot()["player"]["kind"] == "scheduled"
        assert tab.page.inner_text("#player-kind") == "scheduled buffers"
        assert tab.errors == []
    finally:
        tab.page.context.close()


def test_api_key_wrong_one_reads_clearly_and_right_one_works(browser: Any, keyed_server: ServerThread,
                                                             pace: MachinePace) -> None:
    tab = open_tab(browser, f"{keyed_server.base_url}/", slowness=pace.stretch())
    page = tab.page
    try:
        # The page and its files are open; the API needs the key, and the page says so.
        tab.wait("!document.getElementById('error-banner').hidden", 10, "key requested")
        assert "needs an API key" in page.inner_text("#error-banner")

        page.fill("#api-key", "not-the-key")
        page.click("#key-save")
        tab.wait("document.getElementById('error-text').textContent.includes('incorrect API key provided')",
                 10, "wrong key reported")
        assert "rejected the API key" in page.inner_text("#error-text")
        assert page.get_attribute("#api-key", "aria-invalid") == "true"
        # Speak with the wrong key: the WebSocket handshake is refused and the page explains why.
        page.click("#error-close")
        _speak(tab, "Hello.")
        tab.wait("window.orpheusPlayground.snapshot().jobs.some(j => j.state === 'failed')", 10, "refused")
        assert "incorrect API key provided" in _last_job(tab)["error"]
        assert "incorrect API key provided" in page.inner_text("#error-text")

        page.fill("#api-key", KEY)
        page.click("#key-save")
        tab.wait("document.querySelectorAll('#voice option').length === 8", 10, "voices with the right key")
        assert page.is_hidden("#error-banner")
        assert tab.js("sessionStorage.getItem('orpheus-serve.api-key')") == KEY
        assert page.input_value("#api-key") == ""  # not left on screen
        _speak(tab, "Hello.")
        tab.wait("window.orpheusPlayground.snapshot().jobs.some(j => j.state === 'done')", 30, "spoken")
        assert _last_job(tab)["bytes"] > 0
        tab.wait("/^\\d+$/.test(document.getElementById('s-active').textContent)", 5, "statistics with the key")
        assert httpx.get(f"{keyed_server.base_url}/v1/stats").status_code == 401  # the key really is required
    finally:
        page.context.close()
