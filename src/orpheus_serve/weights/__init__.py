"""Model weights: where they are (with the tiny fallback) and the tiny random-weight models."""
