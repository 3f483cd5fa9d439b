"""Built-in benchmark texts: short (voice-agent turns), medium and long, drawn with a seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

SHORT = [
    "Sure, I can help with that.",
    "Your order has shipped and should arrive on Tuesday.",
    "Could you repeat the last part, please?",
    "The meeting moved to three o'clock.",
    "Thanks for waiting, I have your results now.",
    "Great, that's all set. Anything else?",
]
MEDIUM = [
    "I checked the schedule, and the next train to the airport leaves at ten past nine from platform four. "
    "It takes about forty minutes, so you should arrive well before your flight.",
    "Your account balance is three hundred and twelve dollars. The last payment was received on the fifth, "
    "and the next statement will be issued at the end of the month.",
    "To reset the device, hold the power button for ten seconds until the light blinks twice, then release it "
    "and wait for the chime before you try to connect again.",
]
LONG = [
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who "
    "repaired every clock in the valley. Every morning he opened his shop at seven, brewed a pot of strong tea, "
    "and listened to the ticking of a hundred clocks, each a little out of step with the others. The villagers "
    "said he could tell the time by sound alone. One winter evening, a stranger arrived carrying a clock that "
    "had no hands at all, and asked the old man whether he could make it tell the time again.",
]


@dataclass(frozen=True, slots=True)
class Workload:
    texts: tuple[str, ...]
    voices: tuple[str, ...]


def make_workload(n: int, *, seed: int = 0, mix: tuple[float, float, float] = (0.6, 0.3, 0.1),
                  max_chars: int | None = None, voices: tuple[str, ...] = ("tara", "leah", "leo", "zoe")) -> Workload:
    """n texts drawn from the short/medium/long sets with the given mix, reproducibly; texts longer
    than `max_chars` (the server profile's limit) are left out of their pool."""
    rng = random.Random(seed)
    pools = [[t for t in pool if max_chars is None or len(t) <= max_chars] for pool in (SHORT, MEDIUM, LONG)]
    weights = [w if pool else 0.0 for w, pool in zip(mix, pools, strict=True)]
    texts, chosen_voices = [], []
    for _ in range(n):
        pool = rng.choices(pools, weights=weights)[0]
        texts.append(rng.choice(pool))
        chosen_voices.append(rng.choice(voices))
    return Workload(tuple(texts), tuple(chosen_voices))
