"""Text hygiene for the model's input, and splitting of long text into sentence chunks.

`normalize_text` turns whatever a client sends into the text the model is
prompted with. In order:

1. Typography to plain ASCII (curly quotes, dashes, ellipses, odd spaces),
   then Unicode NFKC (compatibility forms: full-width letters, ligatures,
   superscripts, `™` -> `TM`), then the ASCII mapping once more for what
   NFKC produced.
2. Characters with nothing to say are removed: control characters become a
   space; invisible format characters (soft hyphens, zero-width joiners, BOM)
   and surrogates are dropped; emoji and other pictographic symbols (Unicode
   category So: emoji, dingbats, `©`, `°`, ...), private-use and unassigned
   code points become a space, and the modifiers that only decorate an emoji
   (variation selectors, skin tones, enclosing keycaps) are dropped. Emoji
   are dropped rather than read out because the model has never been trained
   on their names, and each one costs several prompt tokens.
3. Markup: the emotion tags the released model honours (`<laugh> <chuckle>
   <sigh> <cough> <sniffle> <groan> <yawn> <gasp>`, any case) are kept, in
   lower case; any other tag (`<b>`, `</b>`, `<break time="1s"/>`, `<foo>`)
   is removed, its content kept. Text such as `x < y` or `a <b c> d` (no
   name=value attributes) is not markup and stays.
4. Whitespace runs (newlines included) collapse to one space; no space
   before , ; : . ! ?

The result is idempotent: normalising it again changes nothing.
`has_speech` says whether normalised text has anything to say (a letter or a
digit outside the tags); text that is only tags, punctuation or emoji has not.

Orpheus is prompted with one chunk at a time; a chunk should be a few whole
sentences so its prosody is natural, and short enough that its first audio
comes fast and the model stays stable. `split_text` packs whole sentences
into chunks of at most `max_chars`; a sentence longer than that is cut at
clause boundaries (, ; : and dashes), then between words, and a single
word longer than the limit is cut between characters. An emotion tag such as
`<laugh>` is never cut.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable

from ..token_format import EMOTION_TAGS

_TRANSLATE = str.maketrans(
    {
        "\u2018": "'",  # ‘
        "\u2019": "'",  # ’
        "\u201a": "'",  # ‚
        "\u201b": "'",  # ‛
        "\u2032": "'",  # ′
        "\u201c": '"',  # “
        "\u201d": '"',  # ”
        "\u201e": '"',  # „
        "\u201f": '"',  # ‟
        "\u2033": '"',  # ″
        "\u00ab": '"',  # «
        "\u00bb": '"',  # »
        "\u2010": "-",  # hyphen
        "\u2011": "-",  # non-breaking hyphen
        "\u2012": "-",  # figure dash
        "\u2013": "-",  # en dash: ranges such as 1990–1995
        "\u2212": "-",  # minus sign
        "\u2014": " - ",  # em dash: a pause between clauses
        "\u2015": " - ",  # horizontal bar
        "\u2026": "...",  # ellipsis
        "\u00a0": " ",  # no-break space
        "\u202f": " ",  # narrow no-break space
        "\u2009": " ",  # thin space
        "\u200b": "",  # zero-width space
        "\u200c": "",  # zero-width non-joiner
        "\u200d": "",  # zero-width joiner
        "\u2060": "",  # word joiner
        "\ufeff": "",  # byte-order mark
    }
)
# Decorations of an emoji or of a glyph, dropped with it: variation selectors, emoji skin tones.
_DROPPED_MODIFIERS = frozenset(
    [*map(chr, range(0xFE00, 0xFE10)), *map(chr, range(0xE0100, 0xE01F0)), *map(chr, range(0x1F3FB, 0x1F400))]
)
_SPACE_RUN = re.compile(r"\s+")
_SPACE_BEFORE_PUNCT = re.compile(r" +([,;:.!?])")

# Emotion tags are atomic when text is cut (only known ones survive normalisation).
_TAG = re.compile(r"<[A-Za-z_][A-Za-z0-9_-]*>")
# XML/HTML-like markup: <name>, </name>, <name/>, <name attr="v" ...>. Attributes must be name=value, so
# prose such as "a <b c> d" is not taken for a tag.
_MARKUP = re.compile(
    r"</?([A-Za-z_][\w:.-]*)(?:\s+[\w:.-]+\s*=\s*(?:\"[^\"<>]*\"|'[^'<>]*'|[^\s\"'<>/=]+))*\s*/?>"
)
_KNOWN_TAGS = frozenset(EMOTION_TAGS)

# A sentence ends with . ! ? (possibly repeated, possibly followed by closing quotes or brackets)
# and then whitespace.
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*(?=\s)")
# A clause ends after , ; : or before a spaced dash.
_CLAUSE_END = re.compile(r"[,;:]+[\"')\]]*(?=\s)|(?<=\s)-(?=\s)")
_ABBREVIATIONS = frozenset(
    ("mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "approx", "dept", "inc", "ltd")
)


def normalize_text(text: str) -> str:
    """The model's input for `text`: see the module docstring for every step."""
    text = unicodedata.normalize("NFKC", text.translate(_TRANSLATE)).translate(_TRANSLATE)
    # Characters first, markup second: removing an invisible character can never assemble a tag afterwards.
    text = "".join(map(_clean_char, text))
    text = _MARKUP.sub(_keep_known_tag, text)
    text = _SPACE_RUN.sub(" ", text).strip()
    return _SPACE_BEFORE_PUNCT.sub(r"\1", text)


def _clean_char(ch: str) -> str:
    if ch.isascii():
        return " " if ch < " " or ch == "\x7f" else ch
    if ch in _DROPPED_MODIFIERS:
        return ""
    category = unicodedata.category(ch)
    if category in ("Cf", "Cs", "Me"):  # invisible format characters, lone surrogates, enclosing keycaps
        return ""
    if category in ("Cc", "So", "Co", "Cn"):  # controls separate words; emoji and symbols go; so does noise
        return " "
    return ch


def _keep_known_tag(match: re.Match[str]) -> str:
    tag = match.group().lower()
    return tag if tag in _KNOWN_TAGS else " "


def has_speech(text: str) -> bool:
    """Whether normalised `text` has a letter or a digit outside its emotion tags."""
    return any(unicodedata.category(ch)[0] in "LN" for ch in _TAG.sub(" ", text))


def split_text(text: str, max_chars: int = 200) -> list[str]:
    """Normalised `text` as chunks of at most `max_chars` characters, whole sentences where they fit."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    text = normalize_text(text)
    if not text:
        return []
    longest_tag = max((len(m.group()) for m in _TAG.finditer(text)), default=0)
    if longest_tag > max_chars:
        raise ValueError(f"max_chars={max_chars} is shorter than the tag of {longest_tag} characters in the text")
    pieces: list[str] = []
    for sentence in _split_at(text, _SENTENCE_END, _is_sentence_end):
        pieces += _fit_sentence(sentence, max_chars)
    return _pack(pieces, max_chars)


def sentence_ends(text: str) -> list[int]:
    """Offsets just past each sentence end in `text` (punctuation followed by a space; never inside a tag,
    never the dot of an abbreviation or an initial). Raw or normalised text alike."""
    return _ends(text, _SENTENCE_END, _is_sentence_end)


def clause_ends(text: str) -> list[int]:
    """Offsets just past each clause boundary in `text` (, ; : or a dash, followed by a space)."""
    return _ends(text, _CLAUSE_END)


def _ends(text: str, pattern: re.Pattern[str], accept: Callable[[str, re.Match[str]], bool] | None = None
          ) -> list[int]:
    tags = [(m.start(), m.end()) for m in _TAG.finditer(text)]
    return [m.end() for m in pattern.finditer(text)
            if not any(a < m.end() < b for a, b in tags) and (accept is None or accept(text, m))]


def _is_sentence_end(text: str, match: re.Match[str]) -> bool:
    """False for the dot of an abbreviation or an initial ("Dr. Smith", "J. R. R. Tolkien", "e.g. this")."""
    if not match.group().startswith(".") or match.group().startswith(".."):
        return True
    following = text[match.end() :].lstrip()[:1]
    if following.islower():  # a sentence does not start in lower case: "at 5 p.m. on Monday"
        return False
    word = text[: match.start()].rsplit(" ", 1)[-1].lower().lstrip("(\"'")
    if word in _ABBREVIATIONS:
        return False
    return not (len(word) == 1 and word.isalpha())


def _always(text: str, match: re.Match[str]) -> bool:
    return True


def _split_at(
    text: str, pattern: re.Pattern[str], accept: Callable[[str, re.Match[str]], bool] = _always
) -> list[str]:
    """`text` cut after each accepted match of `pattern`, pieces stripped, none empty, none inside a tag."""
    tags = [(m.start(), m.end()) for m in _TAG.finditer(text)]
    pieces: list[str] = []
    start = 0
    for match in pattern.finditer(text):
        end = match.end()
        if any(a < end < b for a, b in tags) or not accept(text, match):
            continue
        piece = text[start:end].strip()
        if piece:
            pieces.append(piece)
        start = end
    rest = text[start:].strip()
    if rest:
        pieces.append(rest)
    return pieces


def _fit_sentence(sentence: str, max_chars: int) -> list[str]:
    """One sentence as pieces of at most max_chars: clauses, then words, then characters."""
    if len(sentence) <= max_chars:
        return [sentence]
    pieces: list[str] = []
    for clause in _split_at(sentence, _CLAUSE_END):
        if len(clause) <= max_chars:
            pieces.append(clause)
            continue
        for word in _words(clause):
            pieces += [word] if len(word) <= max_chars else _cut_word(word, max_chars)
    return _pack(pieces, max_chars)


def _words(text: str) -> list[str]:
    return text.split(" ")


def _cut_word(word: str, max_chars: int) -> list[str]:
    """A run without spaces longer than max_chars, cut between characters but never inside a tag."""
    atoms: list[str] = []
    pos = 0
    for m in _TAG.finditer(word):
        atoms += list(word[pos : m.start()])
        atoms.append(m.group())
        pos = m.end()
    atoms += list(word[pos:])
    out: list[str] = []
    current = ""
    for atom in atoms:
        if current and len(current) + len(atom) > max_chars:
            out.append(current)
            current = ""
        current += atom
    if current:
        out.append(current)
    return out


def _pack(pieces: list[str], max_chars: int) -> list[str]:
    """Join consecutive pieces with a space while the result fits in max_chars."""
    chunks: list[str] = []
    current = ""
    for piece in pieces:
        if not current:
            current = piece
        elif len(current) + 1 + len(piece) <= max_chars:
            current = f"{current} {piece}"
        else:
            chunks.append(current)
            current = piece
    if current:
        chunks.append(current)
    return chunks


TEXT_CHUNK_CHARS = 200  # sentence chunks the model handles well; long text is split into these


def speech_chunks(text: str) -> list[str]:
    """`text` normalised and split into the chunks generated one after another (one session each)."""
    return split_text(normalize_text(text), max_chars=TEXT_CHUNK_CHARS)
