"""Text from Redis made safe to show. Anyone who can write to the server can plant a key, a
value's header or a record with any characters in it: shown raw, an ANSI escape sequence acts
on the reader's terminal and a newline forges a line of the log. Every tool and log line that
shows such text passes it through :func:`printable` (``shown`` for rich's tables).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.text import Text

# of one name or field shown: enough for any real name, and a planted one cannot flood a
# terminal or a log line
SHOWN_CHARS = 300


def printable(value: object, limit: int | None = SHOWN_CHARS) -> str:
    """``str(value)`` as a terminal or a log may show it: control and other unprintable
    characters -- ANSI escapes, newlines, bytes that were not UTF-8 -- spelled as Python
    escapes, and past ``limit`` characters cut, saying how many."""
    text = str(value)
    cut = ""
    if limit is not None and len(text) > limit:
        text, cut = text[:limit], f"... ({len(text) - limit} more characters)"
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
    return text + cut


# Redis and Valkey repeat a refused command's first arguments in their error ("unknown command
# 'HELLO', with args beginning with: '3' 'AUTH' 'default' '<password>'": a server with HELLO
# renamed echoed the URL's password into kvstore's exception, a review's)
_ECHOED_ARGS = re.compile(r"(with args beginning with:).*", re.IGNORECASE | re.DOTALL)


def without_echoed_args(message: str) -> str:
    """A server's error text without the arguments it repeats of the command it refused:
    they may be a password (the handshake's ``HELLO ... AUTH``) or a key."""
    return _ECHOED_ARGS.sub(r"\1 (not shown)", message)


def shown(value: object, limit: int | None = SHOWN_CHARS, style: str = "") -> Text:
    """``value`` as rich text (:func:`printable`), never as markup: a name like ``[/x]`` or
    ``[bold]`` is shown as it is instead of failing the whole output or styling it."""
    from rich.text import Text  # rich is the CLIs' extra: the store itself does not need it

    return Text(printable(value, limit), style=style)
