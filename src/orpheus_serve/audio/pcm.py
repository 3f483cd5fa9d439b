"""The one conversion between the decoder's float samples and 16-bit PCM (ARCHITECTURE §4).

The codec decodes float32 in [-1, 1] (not clipped); everything after it (the streams, the encoders,
WAV files) carries 16-bit signed little-endian mono PCM. Clients that ask for float samples (Cartesia's
`pcm_f32le`) and the word-timing envelope read that PCM back as float.
"""

from __future__ import annotations

import numpy as np

PCM16_FULL_SCALE = 32767.0  # float 1.0 -> the largest int16 (symmetric: -1.0 -> -32767)
PCM16_READ_SCALE = 32768.0  # int16 -> float in [-1, 1): -32768 reads as exactly -1.0


def float_to_pcm16(samples: np.ndarray) -> bytes:
    """float samples in [-1, 1] (clipped) -> 16-bit little-endian PCM, rounded to nearest."""
    return (np.clip(samples, -1.0, 1.0) * PCM16_FULL_SCALE).round().astype("<i2").tobytes()


def pcm16_to_float(pcm: bytes) -> np.ndarray:
    """16-bit little-endian PCM -> float32 samples in [-1, 1)."""
    return (np.frombuffer(pcm, dtype="<i2").astype("<f4") / np.float32(PCM16_READ_SCALE)).astype("<f4", copy=False)
