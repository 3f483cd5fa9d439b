"""The request tally behind /v1/stats and the Prometheus collectors (ARCHITECTURE §8)."""
