"""Generated gRPC stubs of orpheus.proto (regenerate with scripts/gen_proto.sh), and the one mapping
between the proto's `AudioFormat` values and the server's format names (audio.AUDIO_FORMATS)."""

from __future__ import annotations

from ..audio.encoding import AUDIO_FORMATS
from . import orpheus_pb2 as pb

# AUDIO_FORMAT_<NAME> for every format name; UNSPECIFIED means the default, pcm.
AUDIO_FORMAT_NUMBERS: dict[str, int] = {fmt: pb.AudioFormat.Value(f"AUDIO_FORMAT_{fmt.upper()}") for fmt in AUDIO_FORMATS}
AUDIO_FORMAT_NAMES: dict[int, str] = {pb.AUDIO_FORMAT_UNSPECIFIED: "pcm",
                                      **{number: fmt for fmt, number in AUDIO_FORMAT_NUMBERS.items()}}
