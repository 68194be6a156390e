"""Text from outside the agent (a program's stderr, the names a source reports) made safe to show:
no terminal escape sequences, control characters or bidi overrides."""

from __future__ import annotations

import re

_ESCAPES = (
    r"\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC ... BEL or ST (unterminated: to the end)
    r"|\x1b\[[0-?]*[ -/]*[@-~]?"  # CSI: parameters, intermediates, final byte
    r"|\x1b[ -/]*[0-~]?"  # any other escape sequence
    # C0 but tab and newline, DEL, C1; the bidi marks, embeddings, overrides and isolates, and
    # the line and paragraph separators, which make a text read other than it is.
    r"|[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]"
)
_IN_LINES = re.compile(_ESCAPES)
# The longest label text kept: far over any name, uuid or error a source gives, far under what a
# source inventing a megabyte uuid a sample would make the agent hold (its absent devices).
MAX_LABEL_CHARS = 1024
_IN_LINE = re.compile(_ESCAPES + r"|[\t\n]")


def printable(text: str, lines: bool = False) -> str:
    """The text without escape sequences and control characters; with `lines`, tab and newline
    are kept."""
    if text.isprintable():  # the common case, checked in C
        return text
    return (_IN_LINES if lines else _IN_LINE).sub("", text)


def label_text(text: str) -> str:
    """`printable` text that also encodes to UTF-8 (lone surrogates, bytes a decoder could not
    read, as a JSON escape can carry, become '?'), cut at MAX_LABEL_CHARS."""
    if not text.isprintable():
        text = printable(text).encode("utf-8", "replace").decode("utf-8")
    return text if len(text) <= MAX_LABEL_CHARS else text[:MAX_LABEL_CHARS]
