"""The split server (engine core in a process of its own, the shipped default) and the one-process server
give the same audio and the same tokens for the same greedy requests: over REST, WebSocket, gRPC and a
context of text streamed in (SNAC noise off, temperature 0). Both run the same core (core.client.CoreRuntime);
this checks that the wire between them changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orpheus_serve.api.launch import ServerThread
from orpheus_serve.client import protocols as api_client
from orpheus_serve.service.build import build_service
from tests.gateway_support import tiny_config

TEXT = "The split server and the single process agree, sample for sample."
GREEDY: dict[str, Any] = {"temperature": 0.0, "seed": 7, "max_tokens": 56}


@pytest.fixture(scope="module")
def servers(tiny_orpheus: Path, tiny_snac: Path, one_torch_thread: None) -> Iterator[dict[bool, ServerThread]]:
    """engine_process -> its server, both with token logs (read from the core over the wire when split)."""
    started: dict[bool, ServerThread] = {}
    try:
        for split in (True, False):
            config = tiny_config(tiny_orpheus, tiny_snac, **{"server.engine_process": split,
                                                             "scheduler.admission": "slots"})
            started[split] = ServerThread(config, build_service(config, record_tokens=True)).start()
        yield started
    finally:
        for server in started.values():
            server.stop()


async def _one(server: ServerThread, protocol: str) -> api_client.ClientResult:
    if protocol == "context":
        return await api_client.synthesize_ws_context(server.base_url, TEXT, tokens_per_s=200.0, **GREEDY)
    return await api_client.synthesize(protocol, TEXT, url=server.base_url, grpc_addr=server.grpc_address, **GREEDY)


@pytest.mark.parametrize("protocol", ["rest", "ws", "grpc", "context"])
def test_split_and_one_process_servers_give_the_same_audio_and_tokens(servers: dict[bool, ServerThread],
                                                                       protocol: str) -> None:
    results = {split: asyncio.run(_one(server, protocol)) for split, server in servers.items()}
    for split, result in results.items():
        assert result.status == "ok" and result.audio, (split, result.error)
    # Same length; samples within 2 LSB of PCM16: the core process runs SNAC with torch's default threads,
    # this one with one (one_torch_thread), and a convolution's sums then round differently.
    split_pcm, inproc_pcm = (np.frombuffer(bytes(results[split].audio), dtype=np.int16).astype(np.int32)
                             for split in (True, False))
    assert split_pcm.size == inproc_pcm.size
    assert int(np.abs(split_pcm - inproc_pcm).max()) <= 2
    # Every entry so far (one per text chunk, in submission order): both servers took the same requests.
    logs = {split: [(entry["text"], entry["prompt_ids"], entry["frames"], entry["finish_reason"])
                    for entry in server.server.service.token_log.snapshot().values()]
            for split, server in servers.items()}
    assert logs[True] == logs[False]
    assert logs[True] and all(frames for _, _, frames, _ in logs[True])
