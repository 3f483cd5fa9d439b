"""Clients of the server's three protocols (`protocols`) and the per-stream measurements they record
(`records`). The command-line client and the benchmarks use them; nothing in the server does."""
