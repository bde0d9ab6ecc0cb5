"""Client-chosen ids (X-Request-Id, X-Session-Id, the OpenAI `user` field) at the edges.

An id is any string of at most MAX_ID_CHARS characters: OpenAI accepts any string in `user`, so
non-ASCII, spaces and control characters are allowed. Where an id must travel in an HTTP header
(a remote engine's X-Session-Id), ``header_safe`` turns it into one that cannot break or forge a
header, the same way every time, so the remote daemon sees one session per client session.
"""

from __future__ import annotations

import hashlib
from urllib.parse import quote

MAX_ID_CHARS = 256
# RFC 3986's unreserved characters and sub-delimiters, plus ":" (our key namespaces) and "@".
_SAFE = "-._~!$&'()*+,;=:@"
_KEEP = 200  # of a long encoding, the readable head kept before the hash


def header_safe(value: str) -> str:
    """``value`` as a header value of at most MAX_ID_CHARS printable ASCII characters:
    itself when it already is one; else percent-encoded UTF-8 ("%" is encoded too, so two
    different ids never encode alike), and past MAX_ID_CHARS its head and a hash of the whole."""
    encoded = quote(value, safe=_SAFE)
    if encoded == value and len(value) <= MAX_ID_CHARS:
        return value
    if len(encoded) <= MAX_ID_CHARS:
        return encoded
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{encoded[:_KEEP]}~{digest}"
