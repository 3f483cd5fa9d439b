"""A measured card, replayed on the host: the GPU kit's results as the sim engine's and sim codec's costs.

`profile.py` reads a kit result folder (scripts/gpu: engine.json, codec.json, serve.json) into a
`CardProfile`; `card.py` is the `ModelledCard` that one engine-core process's sim engine and sim codec share
(one device timeline, the interpreter time each spends launching work). ARCHITECTURE §8.
"""

from .card import ModelledCard
from .profile import UNMEASURED_LABEL, CardProfile, ProfileError, format_inputs, load_profile

__all__ = ["UNMEASURED_LABEL", "CardProfile", "ModelledCard", "ProfileError", "format_inputs", "load_profile"]
