"""Request validation (validation.py) and text hygiene (text.py): each rule, with its exact outcome."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fake_tensorrt_llm import FakeLLM, FakeSamplingParams

from orpheus_serve import token_format
from orpheus_serve.config import SamplingConfig, load_config
from orpheus_serve.engines.base import TokenEngine
from orpheus_serve.engines.sim_engine import SimEngine
from orpheus_serve.engines.torch_engine import TorchEngine
from orpheus_serve.engines.trtllm_engine import TrtLlmEngine, TrtLlmEngineSettings
from orpheus_serve.request.errors import InvalidRequestError
from orpheus_serve.request.text import TEXT_CHUNK_CHARS, has_speech, normalize_text
from orpheus_serve.request.types import SynthesisRequest
from orpheus_serve.request.validation import Limits, Range, field_range, validate_request
from orpheus_serve.scheduler.step import SEED_MAX, PrefillChunk, SamplingParams, StepPlan
from orpheus_serve.service.build import load_tokenizer


@pytest.fixture(scope="module")
def prompt_len(tiny_orpheus: Path) -> Callable[[str, str], int]:
    tokenizer = load_tokenizer(tiny_orpheus)
    return lambda voice, text: len(token_format.build_prompt_ids(tokenizer, voice, text))


@pytest.fixture(scope="module")
def limits() -> Limits:
    return Limits.from_config(load_config(env={}), max_seq_len=512, chunk_chars=TEXT_CHUNK_CHARS)


def test_bounds_are_the_config_fields_own_limits_and_the_engines() -> None:
    assert field_range(SamplingConfig, "temperature") == Range(0, 5)
    assert field_range(SamplingConfig, "top_p") == Range(0, 1, lo_open=True)
    assert field_range(SamplingConfig, "repetition_penalty") == Range(1.0, 3.0)
    assert field_range(SamplingConfig, "max_tokens") == Range(7)
    limits = Limits.from_config(load_config(env={}), max_seq_len=4096, chunk_chars=200)
    assert limits.top_k == Range(0, token_format.VOCAB_SIZE)  # the config says >= 0; the vocabulary says the rest
    assert (limits.max_text_chars, limits.max_prompt_tokens, limits.max_seq_len) == (4096, 8192, 4096)
    longform = Limits.from_config(load_config(profile="longform", env={},
                                              overrides={"profiles.longform.max_prompt_tokens": 4000}),
                                  max_seq_len=4096, chunk_chars=200)
    assert (longform.max_text_chars, longform.max_prompt_tokens) == (5000, 4000)
    assert str(Range(0, 1, lo_open=True)) == "(0, 1]" and str(Range(7)) == ">= 7"


def test_a_valid_request_comes_back_normalised_resolved_and_clamped(limits: Limits, prompt_len) -> None:
    req = SynthesisRequest(text="  \u201cHi\u201d <LAUGH> there\U0001F600 <b>friend</b>\u2026 ", voice="Alloy",
                           temperature=0, top_p=1, top_k=token_format.VOCAB_SIZE, repetition_penalty=3,
                           max_tokens=10**30, seed=SEED_MAX, constrained=False, request_id="a" * 128)
    out = validate_request(req, limits, prompt_len=prompt_len)
    assert out.text == '"Hi" <laugh> there friend...'
    assert out.voice == "tara"
    assert out.max_tokens == 512  # more than the context holds is clamped to it (it then ends with "length")
    assert replace(out, text=req.text, voice=req.voice, max_tokens=req.max_tokens) == req
    # Idempotent: the gateway validates, then the service validates again what the gateway passed on.
    assert validate_request(out, limits, prompt_len=prompt_len) == out


def bad(**fields: Any) -> SynthesisRequest:
    return SynthesisRequest(**{"text": "Hello there.", **fields})


@pytest.mark.parametrize(("request_", "param", "message"), [
    (bad(top_k=2**63), "top_k", "top_k must be an integer in [0, 156940]"),
    (bad(top_k=token_format.VOCAB_SIZE + 1), "top_k", "top_k must be an integer in [0, 156940]"),
    (bad(top_k=-1), "top_k", "top_k must be an integer"),
    (bad(top_k=True), "top_k", "top_k must be an integer"),
    (bad(top_k=4.0), "top_k", "top_k must be an integer"),
    (bad(seed=-1), "seed", "seed must be an integer in [0, 2**64 - 1]"),
    (bad(seed=2**64), "seed", "seed must be an integer in [0, 2**64 - 1]"),
    (bad(seed=False), "seed", "seed must be an integer"),
    (bad(temperature=-0.1), "temperature", "temperature must be a number in [0, 5]"),
    (bad(temperature=float("nan")), "temperature", "temperature must be a number in [0, 5]"),
    (bad(temperature=True), "temperature", "temperature must be a number"),
    (bad(top_p=0), "top_p", "top_p must be a number in (0, 1]"),
    (bad(top_p=float("inf")), "top_p", "top_p must be a number in (0, 1]"),
    (bad(repetition_penalty=0.9), "repetition_penalty", "repetition_penalty must be a number in [1, 3]"),
    (bad(max_tokens=6), "max_tokens", "max_tokens must be an integer >= 7"),
    (bad(max_tokens=70.0), "max_tokens", "max_tokens must be an integer"),
    (bad(constrained="yes"), "constrained", "constrained must be true or false"),
    (bad(request_id=""), "request_id", "1 to 128 printable ASCII"),
    (bad(request_id="x" * 129), "request_id", "1 to 128 printable ASCII"),
    (bad(request_id="line\nbreak"), "request_id", "1 to 128 printable ASCII"),
    (bad(request_id="caf\u00e9"), "request_id", "1 to 128 printable ASCII"),
    (bad(voice="bob"), "voice", "unknown voice 'bob'"),
    (bad(voice="\udfff"), "voice", "lone surrogate (U+DFFF at position 0)"),
    (bad(text="Hi \ud800 there"), "input", "input holds a lone surrogate (U+D800 at position 3)"),
    (bad(text=42), "input", "input must be a string"),
    (bad(text=" \n\t"), "input", "input text is empty"),
    (bad(text="\u200b\u200d"), "input", "input text is empty"),
    (bad(text="<laugh>"), "input", "input has nothing to speak"),
    (bad(text="<laugh> <sigh>!"), "input", "input has nothing to speak"),
    (bad(text="<foo></foo><break time='1s'/>"), "input", "input text is empty"),
    (bad(text="\U0001F600" * 10), "input", "input text is empty"),
    (bad(text="\U0001F600 ?! \u2026"), "input", "input has nothing to speak"),
    # 20 characters as sent, 360 after NFKC (U+FDFA is one character standing for 18).
    (bad(text="\ufdfa" * 228), "input", "input is 4104 characters after normalisation; at most 4096"),
    # 200 characters, 4 tokens each for this tokenizer: under the character limit, over the token one.
    (bad(text="\U00020000" * 2050), "input", "input is 8200 tokens after normalisation; at most 8192"),
])
def test_each_bad_field_is_refused_naming_its_parameter(request_: SynthesisRequest, param: str, message: str,
                                                        limits: Limits, prompt_len) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validate_request(request_, limits, prompt_len=prompt_len)
    assert info.value.param == param
    assert message in str(info.value), str(info.value)


def test_length_and_tokens_are_counted_after_normalisation(limits: Limits, prompt_len) -> None:
    # 250 emoji around a short text used to be ~1,000 prompt tokens under a 250-character limit: emoji are dropped.
    out = validate_request(bad(text="Hi " + "\U0001F600" * 300), limits, prompt_len=prompt_len)
    assert out.text == "Hi"
    # Exactly at the limit after normalisation passes, whatever the raw length was.
    text = "a" * 250
    assert validate_request(bad(text=f"  {text}\n\n"), limits, prompt_len=prompt_len).text == text


def test_a_chunk_that_leaves_no_room_for_audio_is_refused(prompt_len) -> None:
    small = Limits.from_config(load_config(env={}), max_seq_len=64, chunk_chars=TEXT_CHUNK_CHARS)
    with pytest.raises(InvalidRequestError, match="leaves no room for audio within max_seq_len=64") as info:
        validate_request(bad(text="\u4e2d" * 20), small, prompt_len=prompt_len)  # 60 text tokens + the prompt
    assert info.value.param == "input"


def test_text_hygiene() -> None:
    assert normalize_text("\uff28\uff45\uff4c\uff4c\uff4f \ufb01ne \u2460") == "Hello fine 1"  # NFKC
    assert normalize_text("a <Laugh> b <GASP> c </laugh> d <laugh/>") == "a <laugh> b <gasp> c d"
    assert normalize_text('<speak>Hi <break time="1s"/> <say-as interpret-as="x">A</say-as></speak>') == "Hi A"
    assert normalize_text("x < y, a <b c> d, 3<4") == "x < y, a <b c> d, 3<4"  # not markup: kept
    assert normalize_text("Thumbs\U0001F44D\U0001F3FD up, 1\ufe0f\u20e3 flag \U0001F1EB\U0001F1F7!") == \
        "Thumbs up, 1 flag!"
    assert normalize_text("\u00a9 2026, 25\u00b0C") == "2026, 25 C"
    # Removing an invisible character never assembles a tag that survives a second normalisation.
    for text in ("<fo\u200bo>", "<la\u00adugh>", "<<b>laugh>"):
        once = normalize_text(text)
        assert normalize_text(once) == once, text
    assert has_speech("<laugh> 42") and has_speech("\u4e2d") and not has_speech("<laugh> ... !?")


def chunk(sampling: SamplingParams) -> PrefillChunk:
    ids = (token_format.START_OF_HUMAN, token_format.BOS, 1000, 1001, 1002, *token_format.PROMPT_SUFFIX)
    return PrefillChunk(slot=0, request_id="r", prompt_ids=ids, start=0, end=len(ids), sampling=sampling)


@pytest.mark.parametrize(("sampling", "problem"), [
    (SamplingParams(seed=-1), "seed -1 is outside 0..2**64-1"),
    (SamplingParams(seed=2**64), f"seed {2**64} is outside 0..2**64-1"),
    (SamplingParams(top_k=2**63), f"top_k {2**63} is outside 0..156940"),
])
def test_every_backend_refuses_an_out_of_range_value_the_same_way(sampling: SamplingParams, problem: str,
                                                                  tiny_orpheus: Path) -> None:
    """Past the service's validation, each engine fails the session (never the step) with the same message."""
    trt = TrtLlmEngine(FakeLLM(), settings=TrtLlmEngineSettings(engine_dir="unused", num_slots=2, max_seq_len=256),
                       make_sampling_params=FakeSamplingParams)
    backends: dict[str, TokenEngine] = {
        "torch": TorchEngine(tiny_orpheus, num_slots=2, max_seq_len=64, cuda_graphs=False),
        "sim": SimEngine(2, 256, load_config(env={}).engine.sim.model_copy(update={"realtime": False})),
        "tensorrt": trt,
    }
    try:
        for name, engine in backends.items():
            out = engine.step(StepPlan(prefill=[chunk(sampling)]))
            assert out.failed == {0: f"invalid sampling parameters: {problem}"}, name
            assert not out.tokens, name
    finally:
        trt.close()
    # The two ends of the seed range are taken by all three.
    assert SEED_MAX == 2**64 - 1
