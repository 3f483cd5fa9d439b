"""Custom voices (LoRA adapters) through a real server: listings, requests by name, unknown voices, the admin
endpoints, and hot load/unload under running streams, with the engine core in the server's process and in
its own process (tiny model, CPU)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.request.types import SynthesisRequest
from orpheus_serve.service.build import build_service
from orpheus_serve.service.voices import VoiceCatalog
from orpheus_serve.weights.tiny import write_lora_adapter, write_lora_adapters
from tests.gateway_support import check_openai_error, start_server, tiny_config

KEY = "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = "Custom voices speak through their own adapter, in the same batch as the others."


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory: pytest.TempPathFactory, tiny_orpheus: Path) -> Path:
    out = tmp_path_factory.mktemp("voices")
    write_lora_adapters(out, tiny_orpheus, 3, seed=1)
    write_lora_adapter(out / "too-big", tiny_orpheus, seed=9, rank=16)  # over max_lora_rank 8: refused at load
    shutil.copytree(out / "voice0", out / "tara")  # a built-in voice's name: not a custom voice
    return out


def voice_server(tiny_orpheus: Path, tiny_snac: Path, voices_dir: Path, *, engine_process: bool,
                 api_keys: list[str] | None = None, **overrides: Any) -> ServerThread:
    """In one process the service records every session's tokens (what the engine generated, before the codec,
    whose float rounding depends on how frames of concurrent streams are grouped into its passes)."""
    config = tiny_config(tiny_orpheus, tiny_snac, **{
        "voices.adapters_dir": str(voices_dir), "voices.max_loras": 2, "voices.max_lora_rank": 8,
        "server.api_keys": [KEY] if api_keys is None else api_keys, "server.engine_process": engine_process,
        "sampling.max_tokens": 140, **overrides})
    if engine_process:
        return start_server(config)
    return ServerThread(config, build_service(config, record_tokens=True)).start()


def generated(server: ServerThread, response: httpx.Response) -> list[list[int]] | None:
    """The frames the engine generated for a response's request (in one process), None otherwise."""
    token_log = server.server.service.token_log
    if token_log is None:
        return None
    log = token_log.snapshot()
    request_id = response.headers["X-Request-Id"]
    return [log[key]["frames"] for key in sorted(k for k in log if k.startswith(f"{request_id}-"))]


def speak(base_url: str, voice: str, **extra: Any) -> httpx.Response:
    body = {"input": TEXT, "voice": voice, "response_format": "pcm", "temperature": 0, "seed": 7, **extra}
    return httpx.post(f"{base_url}/v1/audio/speech", json=body, headers=AUTH, timeout=120)


def admin(base_url: str, method: str, path: str = "", **kwargs: Any) -> httpx.Response:
    return httpx.request(method, f"{base_url}/v1/admin/adapters{path}", timeout=60, **kwargs)


def test_catalog_lists_builtin_then_custom_voices(voices_dir: Path) -> None:
    catalog = VoiceCatalog(voices_dir)
    names = catalog.names()
    assert names[:8] == ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]
    assert names[8:] == ["too-big", "voice0", "voice1", "voice2"]  # the folder named tara is no custom voice
    voice = catalog.get("VOICE1")
    assert (voice.name, voice.adapter, voice.prompt_name) == ("voice1", "voice1", "voice1")
    assert voice.sampling == {"temperature": 0.6, "top_p": 0.9}
    assert catalog.get("alloy").adapter is None and catalog.get("alloy").name == "tara"


@pytest.mark.parametrize("engine_process", [False, True], ids=["inproc", "core-process"])
def test_custom_voices_served_listed_and_managed(tiny_orpheus: Path, tiny_snac: Path, voices_dir: Path,
                                                 engine_process: bool) -> None:
    server = voice_server(tiny_orpheus, tiny_snac, voices_dir, engine_process=engine_process)
    base = server.base_url
    try:
        listed = httpx.get(f"{base}/v1/audio/voices", headers=AUTH).json()["voices"]
        custom = {v["id"]: v for v in listed if v.get("custom")}
        assert set(custom) == {"too-big", "voice0", "voice1", "voice2"}
        assert custom["voice0"]["description"].startswith("tiny random LoRA voice")
        assert all("custom" not in v for v in listed if v["id"] == "tara")

        if not engine_process:  # voice.json's sampling fills what a request leaves out
            service = server.server.service
            assert service.validate(SynthesisRequest(text="Hi there.", voice="voice1")).top_p == 0.9
            assert service.validate(SynthesisRequest(text="Hi there.", voice="voice1", top_p=0.5)).top_p == 0.5
            assert service.validate(SynthesisRequest(text="Hi there.", voice="tara")).top_p is None

        # Unknown voice: 400 naming the voices there are, custom ones included.
        error = check_openai_error(speak(base, "nobody"), 400)
        assert error["param"] == "voice" and "voice0" in error["message"] and "tara" in error["message"]

        # The admin endpoints need the key.
        assert admin(base, "GET").status_code == 401
        states = {a["name"]: a for a in admin(base, "GET", headers=AUTH).json()["adapters"]}
        assert states["voice0"]["state"] == "available" and states["voice0"]["sessions"] == 0

        # A request by name runs on its adapter (it is in the pool afterwards), and differs from the base model
        # given the same prompt name.
        custom_pcm = speak(base, "voice0")
        assert custom_pcm.status_code == 200 and len(custom_pcm.content) > 0
        states = {a["name"]: a for a in admin(base, "GET", headers=AUTH).json()["adapters"]}
        assert states["voice0"]["state"] == "resident" and states["voice0"]["rank"] == 8

        # A request for a custom voice whose adapter cannot be served: 400 with the reason, before it starts.
        bad = check_openai_error(speak(base, "too-big"), 400)
        assert bad["param"] == "voice" and "rank 16 is over" in bad["message"]

        # A bad adapter is refused at load with the reason; the server goes on serving.
        refused = check_openai_error(admin(base, "POST", "/too-big/load", headers=AUTH), 400)
        assert "rank 16 is over" in refused["message"]
        check_openai_error(admin(base, "POST", "/ghost/load", headers=AUTH), 400)
        loaded = admin(base, "POST", "/voice1/load", headers=AUTH).json()
        assert loaded["state"] in ("loaded", "resident") and loaded["target_modules"]
        assert admin(base, "POST", "/voice0/unload", headers=AUTH).json()["state"] == "available"
        again = speak(base, "voice0")  # loaded again on demand: the same tokens
        assert again.status_code == 200 and len(again.content) == len(custom_pcm.content)
        assert generated(server, again) == generated(server, custom_pcm)
    finally:
        server.stop()


def test_admin_endpoints_are_off_without_api_keys(tiny_orpheus: Path, tiny_snac: Path, voices_dir: Path) -> None:
    server = voice_server(tiny_orpheus, tiny_snac, voices_dir, engine_process=False, api_keys=[])
    try:
        check_openai_error(admin(server.base_url, "GET"), 403)
        check_openai_error(admin(server.base_url, "POST", "/voice0/load"), 403)
    finally:
        server.stop()


@pytest.mark.parametrize("engine_process", [False, True], ids=["inproc", "core-process"])
def test_hot_load_and_unload_leave_running_streams_byte_identical(tiny_orpheus: Path, tiny_snac: Path,
                                                                  voices_dir: Path, engine_process: bool) -> None:
    """Three concurrent greedy streams (two adapters and the base model) generate the same tokens with and
    without admin calls (loads, an unload of a voice in use, which waits for its stream) between their steps
    (tokens compared in one process; with the core apart, the lengths)."""
    server = voice_server(tiny_orpheus, tiny_snac, voices_dir, engine_process=engine_process)
    base = server.base_url
    voices = ["voice0", "voice1", "leo"]

    def run_all(during: list[tuple[str, str]]) -> list[httpx.Response]:
        results: dict[str, httpx.Response] = {}
        started = threading.Barrier(len(voices) + 1)

        def one(voice: str) -> None:
            started.wait()
            response = speak(base, voice)
            assert response.status_code == 200, response.text
            results[voice] = response

        threads = [threading.Thread(target=one, args=(v,)) for v in voices]
        for t in threads:
            t.start()
        started.wait()
        answers = [admin(base, "POST", path, headers=AUTH) for _, path in during]
        for t in threads:
            t.join(120)
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        return [results[v] for v in voices]

    try:
        quiet = run_all([])
        busy = run_all([("load", "/voice2/load"), ("unload", "/voice0/unload"), ("unload", "/voice1/unload"),
                        ("load", "/voice0/load"), ("unload", "/voice2/unload")])
        assert [len(r.content) for r in busy] == [len(r.content) for r in quiet]
        assert [generated(server, r) for r in busy] == [generated(server, r) for r in quiet]
        states = {a["name"]: a for a in admin(base, "GET", headers=AUTH).json()["adapters"]}
        assert all(a["sessions"] == 0 for a in states.values())
    finally:
        server.stop()


def test_more_voices_than_the_pool_holds_wait_for_an_entry_and_all_speak(tiny_orpheus: Path, tiny_snac: Path,
                                                                         voices_dir: Path) -> None:
    """Three custom voices at once with a pool of two (voices.max_loras): the third voice's sessions wait in
    the queue for a pool entry (the scheduler counts the voices in use) instead of failing, and each speaks
    exactly the tokens it speaks alone."""
    # Admission by free slots: on a CPU the capacity measure would let these sessions in one at a time.
    server = voice_server(tiny_orpheus, tiny_snac, voices_dir, engine_process=False,
                          **{"scheduler.admission": "slots"})
    base = server.base_url
    voices = ["voice0", "voice1", "voice2"] * 2  # six sessions, three voices, four slots
    try:
        alone = {v: generated(server, speak(base, v)) for v in set(voices)}
        results: dict[int, httpx.Response] = {}
        started = threading.Barrier(len(voices))

        def one(index: int, voice: str) -> None:
            started.wait()
            results[index] = speak(base, voice)

        threads = [threading.Thread(target=one, args=(i, v)) for i, v in enumerate(voices)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[i].status_code for i in range(len(voices))] == [200] * len(voices), \
            [results[i].text for i in range(len(voices)) if results[i].status_code != 200]
        assert [generated(server, results[i]) for i in range(len(voices))] == [alone[v] for v in voices]
        scheduler = httpx.get(f"{base}/v1/stats", headers=AUTH).json()["scheduler"]
        assert scheduler["adapter_waits"] > 0 and scheduler["failed"] == 0
    finally:
        server.stop()


def test_custom_voices_on_riva_grpc_and_cartesia(tiny_orpheus: Path, tiny_snac: Path, voices_dir: Path) -> None:
    """Riva's config lists a model per custom voice and `English-US.<name>` speaks with it; gRPC ListVoices
    lists them; Cartesia's voice id and ElevenLabs' /v1/voices take them."""
    import grpc
    from riva.client.proto import riva_tts_pb2 as rtts
    from riva.client.proto import riva_tts_pb2_grpc as rtts_grpc

    from orpheus_serve.api.cartesia import Voice as CartesiaVoice
    from orpheus_serve.api.cartesia import resolve_cartesia_voice
    from orpheus_serve.proto import orpheus_pb2 as pb
    from orpheus_serve.proto import orpheus_pb2_grpc as pb_grpc

    catalog = VoiceCatalog(voices_dir)
    assert resolve_cartesia_voice(CartesiaVoice(mode="id", id="Voice2"), catalog.resolve) == "voice2"

    server = voice_server(tiny_orpheus, tiny_snac, voices_dir, engine_process=False)
    metadata = (("authorization", f"Bearer {KEY}"),)
    try:
        with grpc.insecure_channel(server.grpc_address) as channel:
            riva = rtts_grpc.RivaSpeechSynthesisStub(channel)
            configs = riva.GetRivaSynthesisConfig(rtts.RivaSynthesisConfigRequest(), metadata=metadata).model_config
            custom = {c.model_name: dict(c.parameters) for c in configs if c.parameters.get("custom_voice")}
            assert set(custom) == {"orpheus-too-big", "orpheus-voice0", "orpheus-voice1", "orpheus-voice2"}
            assert custom["orpheus-voice1"]["subvoices"].startswith("voice1:")
            response = riva.Synthesize(rtts.SynthesizeSpeechRequest(
                text=TEXT, voice_name="English-US.voice1", sample_rate_hz=24000, language_code="en-US",
                custom_configuration={"temperature": "0", "seed": "7"}), metadata=metadata, timeout=120)
            assert len(response.audio) > 0
            listed = pb_grpc.SynthesizerStub(channel).ListVoices(pb.ListVoicesRequest(), metadata=metadata)
            assert {"voice0", "voice1", "voice2", "tara"} <= {v.id for v in listed.voices}
        # ElevenLabs' voice list and voice lookup take the custom voices too ("cloned"); an unknown id is 404.
        xi = {"xi-api-key": KEY}
        cards = httpx.get(f"{server.base_url}/v1/voices", headers=xi).json()
        by_id = {c["voice_id"]: c for c in cards["voices"]}
        assert {"voice0", "voice1", "voice2", "tara"} <= set(by_id) and cards["total_count"] == len(by_id)
        assert by_id["voice1"]["category"] == "cloned" and by_id["tara"]["category"] == "premade"
        one = httpx.get(f"{server.base_url}/v1/voices/Voice1", headers=xi)
        assert one.status_code == 200 and one.json()["voice_id"] == "voice1"
        missing = httpx.get(f"{server.base_url}/v1/voices/nobody", headers=xi)
        assert missing.status_code == 404 and "voice1" in missing.text
        spoken = httpx.post(f"{server.base_url}/v1/text-to-speech/voice2?output_format=pcm_24000", headers=xi,
                            json={"text": TEXT, "seed": 7}, timeout=120)
        assert spoken.status_code == 200 and len(spoken.content) > 0
        states = {a["name"]: a["state"] for a in admin(server.base_url, "GET", headers=AUTH).json()["adapters"]}
        assert states["voice1"] == "resident"  # the Riva request ran on its adapter
        assert states["voice2"] == "resident"  # and the ElevenLabs one on its own
    finally:
        server.stop()
