"""Incremental text: one context's text arriving in pieces, cut into generation chunks (ARCHITECTURE §5b).

A voice agent's LLM writes its reply token by token. `TextStream` takes those
pieces as they come (`push`), and the service takes generation chunks from it
(`take`) whenever it can start one: at first as soon as a chunk can be cut,
later the moment the previous chunk has finished generating. Cutting lazily,
at the moment a chunk can start, packs whatever text has arrived by then into
one chunk, so the first chunk is short (first audio fast) and later ones are
whole sentences (natural prosody), with no tuning per client.

A chunk can be cut:

- at the last sentence end in the buffer (`. ! ?` followed by a space);
- failing that, at the last clause boundary (`, ; : -` followed by a space)
  with at least `stream_input.min_chunk_chars` before it;
- failing that, once the oldest buffered text has waited
  `stream_input.max_buffer_delay_ms`, after the last complete word (a word is
  complete once a space follows it: a token such as "Hel" may go on as "lo");
- at `flush()` or `end()`: everything buffered, whatever it ends with.

Pieces are concatenated as they arrive (the client sends its own spaces, as
the Cartesia protocol specifies), and each cut is normalised and split to at
most `TEXT_CHUNK_CHARS` exactly as a whole text is. A cut with nothing to say
(only punctuation or tags) is dropped, except that a flush always yields a
marker so its client hears when the flushed text's audio is out.

Everything here runs on the event loop; a `TextStream` belongs to one
request. A whole text is a `TextStream` that is complete from the start, so
the service has one code path for both.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from ..config import StreamInputConfig
from .errors import InvalidRequestError
from .text import TEXT_CHUNK_CHARS, clause_ends, has_speech, sentence_ends, split_text
from .types import TextChunk
from .validation import check_unicode

log = logging.getLogger(__name__)


class TextStream:
    """Text that arrives in pieces, cut into generation chunks (see the module docstring)."""

    def __init__(self, settings: StreamInputConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._clock = clock
        self._buffer = ""  # raw text not yet cut
        self._ready: deque[TextChunk] = deque()  # cut, not yet taken
        self._ready_chars = 0
        self._pending_since: float | None = None  # when the oldest uncut text arrived
        self._last_activity = clock()
        self._flushes = 0
        self._ended = False
        self._changed = asyncio.Event()

    @classmethod
    def complete(cls, chunks: list[str]) -> TextStream:
        """A whole text, already split into its chunks (text.speech_chunks), with nothing more to come."""
        stream = cls(StreamInputConfig(max_buffered_chars=max(200, sum(len(c) for c in chunks))))
        stream._ready.extend(TextChunk(c) for c in chunks)
        stream._ready_chars = sum(len(c) for c in chunks)
        stream._ended = True
        return stream

    # ------------------------------------------------------------ the client's side

    @property
    def ended(self) -> bool:
        return self._ended

    def push(self, text: str) -> None:
        """Append raw text as it is (the client sends its own spaces). InvalidRequestError if it cannot be."""
        if not isinstance(text, str):
            raise InvalidRequestError("text must be a string", param="text")
        check_unicode(text, "text")
        if self._ended:
            raise InvalidRequestError("this context has ended; open a new one for more text", param="text")
        waiting = len(self._buffer) + self._ready_chars + len(text)
        if waiting > self._settings.max_buffered_chars:
            raise InvalidRequestError(
                f"{waiting} characters would wait for synthesis in this context; at most "
                f"{self._settings.max_buffered_chars} may (stream_input.max_buffered_chars)", param="text")
        if not text:
            return
        now = self._clock()
        self._buffer += text
        if self._pending_since is None:
            self._pending_since = now
        self._last_activity = now
        self._changed.set()

    def flush(self) -> int:
        """Cut everything buffered into chunks now; the id that the last of them (or a marker) carries."""
        self._flushes += 1
        self._cut(len(self._buffer), flush_id=self._flushes)
        self._last_activity = self._clock()
        self._changed.set()
        return self._flushes

    def end(self) -> None:
        """No more text: what is buffered becomes the last chunks. Idempotent."""
        if self._ended:
            return
        self._cut(len(self._buffer))
        self._ended = True
        self._changed.set()

    # ------------------------------------------------------------ the service's side

    @property
    def exhausted(self) -> bool:
        """Ended, and every chunk taken."""
        return self._ended and not self._ready

    def take(self) -> TextChunk | None:
        """The next chunk if one can be cut now, else None (see `exhausted` and `wait`)."""
        now = self._clock()
        if not self._ready and self._buffer:
            cut = self._cut_point(now)
            if cut is not None:
                self._cut(cut)
        if not self._ready and not self._ended and now - self._last_activity >= self._settings.idle_timeout_s:
            log.info("a context got no text for %.0f s (stream_input.idle_timeout_s); ending it",
                     self._settings.idle_timeout_s)
            self.end()
        if not self._ready:
            return None
        chunk = self._ready.popleft()
        self._ready_chars -= len(chunk.text)
        return chunk

    async def wait(self) -> None:
        """Until text arrives, a flush or the end, or the moment `take` can cut by time."""
        if self._ready or self._ended:
            return
        now = self._clock()
        deadline = self._last_activity + self._settings.idle_timeout_s
        if self._pending_since is not None and self._word_end() is not None:
            deadline = min(deadline, self._pending_since + self._settings.max_buffer_delay_ms / 1000)
        self._changed.clear()
        waiter = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait({waiter}, timeout=max(0.0, deadline - now))
        finally:
            waiter.cancel()

    # ------------------------------------------------------------ cutting

    def _cut_point(self, now: float) -> int | None:
        text = self._buffer
        ends = sentence_ends(text)
        if ends:
            return ends[-1]
        clauses = [e for e in clause_ends(text) if len(text[:e].strip()) >= self._settings.min_chunk_chars]
        if clauses:
            return clauses[-1]
        overdue = (self._pending_since is not None
                   and now - self._pending_since >= self._settings.max_buffer_delay_ms / 1000)
        if overdue or len(text) > TEXT_CHUNK_CHARS:
            return self._word_end()
        return None

    def _word_end(self) -> int | None:
        """Offset just past the last complete word (one a space follows), or None."""
        stripped = self._buffer.lstrip()
        space = stripped.rfind(" ")
        if space <= 0:
            return None
        return len(self._buffer) - len(stripped) + space

    def _cut(self, end: int, *, flush_id: int | None = None) -> None:
        piece, self._buffer = self._buffer[:end], self._buffer[end:]
        self._pending_since = self._clock() if self._buffer.strip() else None
        if not self._buffer.strip():
            self._buffer = ""
        chunks = [c for c in split_text(piece, max_chars=TEXT_CHUNK_CHARS) if has_speech(c)]
        for k, text in enumerate(chunks):
            self._append(TextChunk(text, flush_id if k == len(chunks) - 1 else None))
        if flush_id is not None and not chunks:
            if self._ready and self._ready[-1].flush_id is None:
                last = self._ready.pop()
                self._ready_chars -= len(last.text)
                self._append(TextChunk(last.text, flush_id))
            else:
                self._append(TextChunk("", flush_id))

    def _append(self, chunk: TextChunk) -> None:
        self._ready.append(chunk)
        self._ready_chars += len(chunk.text)
