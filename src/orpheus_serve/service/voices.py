"""The voices this server speaks: Orpheus's built-in voices and custom voices (LoRA adapters).

A custom voice is a sub-folder of `voices.adapters_dir` holding a PEFT LoRA adapter
(engines/lora.py loads it) and, optionally, a `voice.json`:

    {"prompt_name": "maya",                 # the speaker name the adapter was trained with (prompt "maya: ...")
     "description": "warm, slow narrator",
     "sampling": {"temperature": 0.5, "top_p": 0.9, "repetition_penalty": 1.1}}

Without it the prompt name is the folder name. Clients ask for a custom voice by its folder
name, on every protocol; the request then runs with that adapter (ARCHITECTURE §6). The folder
is scanned on each lookup (a cheap directory listing), so a voice dropped in is served at once.
One catalog serves every listing: `/v1/audio/voices`, gRPC ListVoices, the Riva config, the
Cartesia and ElevenLabs voice lists and the playground's picker (`voice_list()`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import token_format
from ..engines.lora import ADAPTER_CONFIG, valid_adapter_name

logger = logging.getLogger(__name__)

VOICE_FILE = "voice.json"
# Defaults a voice.json may set; a request's own value wins.
VOICE_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


@dataclass(frozen=True, slots=True)
class Voice:
    name: str  # what clients ask for
    prompt_name: str  # the speaker name in the prompt
    adapter: str | None = None  # LoRA adapter (custom voice); None: built into the model
    description: str = ""
    aliases: tuple[str, ...] = ()
    sampling: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The entry of /v1/audio/voices (and of every other listing)."""
        entry: dict[str, Any] = {"id": self.name, "name": self.name if self.adapter else self.name.capitalize(),
                                 "aliases": list(self.aliases)}
        if self.adapter:
            entry.update(custom=True, description=self.description)
        return entry


def builtin_voices() -> list[Voice]:
    return [Voice(name=v, prompt_name=v,
                  aliases=tuple(sorted(a for a, t in token_format.OPENAI_VOICE_ALIASES.items() if t == v)))
            for v in token_format.VOICES]


def read_voice_file(folder: Path) -> tuple[str, str, dict[str, float]]:
    """(prompt name, description, sampling defaults) from an adapter folder's voice.json; ValueError if bad."""
    path = folder / VOICE_FILE
    if not path.is_file():
        return folder.name, "", {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    prompt_name = data.get("prompt_name", folder.name)
    if not isinstance(prompt_name, str) or not prompt_name.strip() or ":" in prompt_name:
        raise ValueError(f"{path}: prompt_name must be a non-empty name without ':'")
    description = data.get("description", "")
    sampling = data.get("sampling") or {}
    if not isinstance(description, str) or not isinstance(sampling, dict):
        raise ValueError(f"{path}: description must be a string and sampling an object")
    unknown = sorted(set(sampling) - set(VOICE_SAMPLING_KEYS))
    if unknown or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in sampling.values()):
        raise ValueError(f"{path}: sampling takes numbers for {', '.join(VOICE_SAMPLING_KEYS)} "
                         f"(got {', '.join(map(str, sampling)) or 'nothing'})")
    return prompt_name.strip(), description, {k: float(v) for k, v in sampling.items()}


class VoiceCatalog:
    """Built-in voices plus the adapters of `adapters_dir` (see the module docstring)."""

    def __init__(self, adapters_dir: str | Path | None = None) -> None:
        self.adapters_dir = Path(adapters_dir) if adapters_dir else None
        self._warned: set[str] = set()  # folders already reported as unusable (the folder is scanned often)

    def custom_voices(self) -> list[Voice]:
        if self.adapters_dir is None or not self.adapters_dir.is_dir():
            return []
        builtin = {v.lower() for v in (*token_format.VOICES, *token_format.OPENAI_VOICE_ALIASES)}
        voices = []
        for folder in sorted(self.adapters_dir.iterdir()):
            if not (folder.is_dir() and (folder / ADAPTER_CONFIG).is_file()):
                continue
            if not valid_adapter_name(folder.name) or folder.name.lower() in builtin:
                self._warn(folder, "its name is not usable as a voice name (letters, digits and '_.-', "
                                   "not a built-in voice)")
                continue
            try:
                prompt_name, description, sampling = read_voice_file(folder)
            except ValueError as exc:
                self._warn(folder, str(exc))
                continue
            voices.append(Voice(name=folder.name, prompt_name=prompt_name, adapter=folder.name,
                                description=description, sampling=sampling))
        return voices

    def _warn(self, folder: Path, reason: str) -> None:
        if str(folder) not in self._warned:
            self._warned.add(str(folder))
            logger.warning("adapter folder %s skipped: %s", folder, reason)

    def voices(self) -> list[Voice]:
        return [*builtin_voices(), *self.custom_voices()]

    def voice_list(self) -> list[dict[str, Any]]:
        """Every voice as the listings show it (id, name, aliases; custom voices with their description)."""
        return [v.as_dict() for v in self.voices()]

    def names(self) -> list[str]:
        return [v.name for v in self.voices()]

    def get(self, name: str | None) -> Voice:
        """The voice for a name, alias or custom voice (case-insensitive); UnknownVoiceError naming them all."""
        try:
            builtin = token_format.resolve_voice(name)
        except token_format.UnknownVoiceError:
            wanted = str(name).strip().lower()
            for voice in self.custom_voices():
                if voice.name.lower() == wanted:
                    return voice
            raise token_format.UnknownVoiceError(
                f"unknown voice {name!r}; available: {', '.join(self.names())} (OpenAI names "
                f"{', '.join(sorted(token_format.OPENAI_VOICE_ALIASES))} are accepted as aliases)") from None
        return Voice(name=builtin, prompt_name=builtin)

    def resolve(self, name: str | None) -> str:
        """The canonical name of a voice (what validation stores in the request)."""
        return self.get(name).name
