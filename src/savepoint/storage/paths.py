"""Path arguments: local paths and ``file://`` URLs are accepted; other URLs are refused.

Every public entry point that takes a path passes it through :func:`local_path` first. Without
it, ``sp.save("s3://bucket/run")`` would quietly write ``./s3:/bucket/run`` on the local disk.
No object-store backend exists yet, so a URL with any other scheme raises
:class:`~savepoint.errors.UnsupportedStorageError` before anything is created.
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlsplit

from savepoint.errors import UnsupportedStorageError

__all__ = ["local_path"]

# RFC 3986 scheme followed by "://". A relative path with a colon later ("runs/a:b") or a first
# component such as "a:b" without "//" does not match and stays a local path.
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_PLANNED = "s3, gs, az"


def local_path(path: str | os.PathLike[str], *, what: str = "path") -> str:
    """Return ``path`` as a local filesystem path string (unchanged when it is not a URL).

    ``file:///abs/path`` (or ``file://localhost/abs/path``) becomes ``/abs/path``, percent-escapes
    decoded. Any other ``scheme://...`` raises UnsupportedStorageError (also ValueError) naming the
    scheme; ``what`` names the argument in the message ("checkpoint path", "run directory", ...).
    A ``pathlib.Path`` built from a URL has already collapsed ``//`` to ``/`` and is a local path.
    """
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str or os.PathLike[str], not {type(text).__name__}")
    match = _URL.match(text)
    if match is None:
        return text
    scheme = match.group(1).lower()
    if scheme == "file":
        parts = urlsplit(text)
        if parts.netloc in ("", "localhost") and not parts.query and not parts.fragment:
            local = unquote(parts.path)
            if local.startswith("/"):
                return local
        raise UnsupportedStorageError(
            f"{what} {text!r}: a file:// URL must name an absolute path on this machine, "
            f"as in file:///abs/path (no host other than localhost, no query or fragment)",
            path=text,
            scheme=scheme,
        )
    raise UnsupportedStorageError(
        f"{what} {text!r}: savepoint does not support {scheme}:// URLs yet; it reads and writes "
        f"local paths only. Object stores ({_PLANNED}) are planned. For now pass a local path, "
        f"or mount the bucket (s3fs, gcsfuse, blobfuse2, ...) and pass a path inside the mount.",
        path=text,
        scheme=scheme,
    )
