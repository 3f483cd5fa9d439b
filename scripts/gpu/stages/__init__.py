"""The GPU proof kit's stages, one module each (check, engine: also base and compiled, codec, serve), the pieces
they share (common) and the runner that sets one up, runs it and writes its verdict (runner)."""
