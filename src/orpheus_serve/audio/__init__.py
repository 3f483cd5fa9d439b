"""Audio out: the one PCM conversion and the response encodings (ARCHITECTURE §4)."""
