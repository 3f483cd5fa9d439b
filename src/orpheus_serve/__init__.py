"""orpheus-serve: streaming Orpheus text-to-speech at high concurrency."""

__version__ = "0.1.0"
