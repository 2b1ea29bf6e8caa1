"""Object storage (S3, GCS, Azure Blob) through obstore: ``s3://``, ``gs://`` and ``az://`` URLs.

Install with ``pip install 'savepoint[s3]'`` (or ``[gcs]``, ``[azure]``: each is obstore, the
Python binding of Rust's ``object_store``). ``import savepoint`` never imports obstore; this
module does, when a URL of one of these schemes is first resolved.

Namespace: paths are ``/bucket/key...`` (``s3://bucket/run/step-1`` is the path
``/bucket/run/step-1``); one obstore client per bucket, cached by the store. Directories are
prefixes: a directory exists while at least one object lies under ``prefix/``. ``mkdir`` and
``makedirs`` put an empty marker object, ``prefix/.savepoint-dir`` (object_store paths cannot end
in ``/``), so that an empty directory exists, as the commit transaction needs; ``list`` never shows
the marker. The capabilities are those of an object store: no rename, no hard links, no locks, no
zero-copy views; ``create_only_put`` (``If-None-Match: *``) and ``durable``. Saves therefore commit
manifest-last (:mod:`savepoint.commit`): data blobs under a generation prefix unique to the attempt,
the manifest last with a create-only put.

Writing: a blob smaller than one part is buffered and sent in one create-only PUT at ``finish``.
A larger one is sent as a multipart upload through ``obstore.open_writer`` (part uploads run
concurrently in obstore while ``write`` returns); the part size is ``part_size`` (16 MiB by
default, at least 5 MiB, the S3 minimum for every part but the last), grown for a large declared
size so that a blob needs fewer than 10,000 parts. ``abort``, and every failure this module sees
(a failed part, a refused ``finish``), abort the multipart upload. object_store has no
conditional completion of a multipart upload, so the create-only promise of ``create_blob`` is
checked with a HEAD at ``create_blob`` and again just before the upload completes: a writer that
creates the same key between that HEAD and the completion is overwritten (the race). The commit
protocol does not depend on it: data blobs go to a generation prefix unique to the attempt, and the
commit point, the manifest, is a ``put(exclusive=True)``, which is atomic (``If-None-Match: *``).
One gap is object_store's: when a part upload fails while ``finish`` completes the upload, the
upload is left open (obstore no longer exposes it to abort). Configure the bucket's lifecycle rule
``AbortIncompleteMultipartUpload`` as obstore's own documentation advises.

Reading: ``open_blob`` is one ranged GET of the first ``prefetch`` bytes (1 MiB) that also returns
the size, ETag and version. A blob no larger than that is served from memory from then on (so it
stays readable after it is replaced or deleted, as the protocol promises); the rest of a larger
blob is read with ranged GETs that carry ``If-Match: <etag>`` (and the version id where the bucket
is versioned), large reads split into ``read_chunk`` pieces fetched concurrently. If the object
was replaced or deleted since it was opened, a read raises CorruptCheckpointError naming it
instead of returning bytes of another version.

Configuration: obstore's own, from the environment and from keyword arguments.
``ObjectStore("s3")`` reads ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL`` (an
S3-compatible server: MinIO, R2, moto), ``AWS_ALLOW_HTTP=true`` (a plain-http endpoint),
``AWS_SKIP_SIGNATURE``, ``AWS_PROFILE`` and the other ``AWS_*`` variables obstore documents; ``gs``
reads ``GOOGLE_SERVICE_ACCOUNT`` / ``GOOGLE_APPLICATION_CREDENTIALS`` and ``GOOGLE_*``; ``az``
reads ``AZURE_STORAGE_ACCOUNT_NAME``, ``AZURE_STORAGE_ACCOUNT_KEY`` and ``AZURE_*``. Keyword
arguments override them: ``ObjectStore("s3", endpoint="http://127.0.0.1:9000", region="us-east-1",
access_key_id=..., secret_access_key=..., allow_http=True)``; HTTP client options
(``allow_http``, ``timeout``, ``connect_timeout``, ``proxy_url``, ...) go to the client, the rest
to the store's config. ``retry`` replaces the retry policy (obstore's ``RetryConfig``: by default
10 retries of 5xx answers, connection errors and resets, with exponential backoff and jitter from
100 ms to 15 s, for at most 3 minutes). ``sp.save("s3://...")`` uses :func:`shared`, one store
per scheme configured from the environment; a store configured by hand is passed as
``store.at("/bucket/run")``.

Errors: a missing object is FileNotFoundError; a refused precondition (the object exists, or changed)
is FileExistsError; a refused credential is PermissionError; anything else is an OSError (EIO)
whose message names the object (``s3://bucket/key``) and the cause.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import obstore
import obstore.exceptions as oe
import obstore.store

from savepoint.errors import CorruptCheckpointError, NotRegularFileError
from savepoint.storage.base import Capabilities, Stat, Store

if TYPE_CHECKING:
    from obstore import WritableFile

__all__ = [
    "DEFAULT_PART_SIZE",
    "MARKER",
    "MAX_PARTS",
    "MIN_PART_SIZE",
    "ObjectStore",
    "part_size_for",
    "shared",
]

MiB = 1024 * 1024
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PART_SIZE = 5 * 1024 * MiB  # S3's maximum
DEFAULT_PART_SIZE = 16 * MiB
MAX_PARTS = 10_000  # S3's limit; part_size_for keeps a declared size under it
MARKER = ".savepoint-dir"  # the object that makes an empty directory exist
_DELETE_BATCH = 1000

DEFAULT_RETRY: dict[str, Any] = {
    "max_retries": 10,
    "backoff": {
        "init_backoff": timedelta(milliseconds=100),
        "max_backoff": timedelta(seconds=15),
        "base": 2,
    },
    "retry_timeout": timedelta(minutes=3),
}

# obstore's ClientConfig keys: these keyword arguments configure the HTTP client, not the store.
_CLIENT_KEYS = frozenset(
    {
        "allow_http",
        "allow_invalid_certificates",
        "connect_timeout",
        "default_content_type",
        "default_headers",
        "http1_only",
        "http2_keep_alive_interval",
        "http2_keep_alive_timeout",
        "http2_keep_alive_while_idle",
        "http2_only",
        "pool_idle_timeout",
        "pool_max_idle_per_host",
        "proxy_url",
        "proxy_ca_certificate",
        "proxy_excludes",
        "randomize_addresses",
        "read_timeout",
        "root_certificate",
        "timeout",
        "user_agent",
    }
)

SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "az": "az"}
_ENV_PREFIX = {"s3": "AWS", "gs": "GOOGLE", "az": "AZURE"}


def part_size_for(size: int | None, preferred: int = DEFAULT_PART_SIZE) -> int:
    """The part size for a blob of ``size`` bytes (None: unknown): ``preferred`` (at least
    :data:`MIN_PART_SIZE`), grown to a whole number of MiB so that the blob needs fewer than
    :data:`MAX_PARTS` parts. OSError(EFBIG) past what S3 allows (5 GiB parts)."""
    part = max(preferred, MIN_PART_SIZE)
    if size is not None and size > 0:
        need = -(-size // (MAX_PARTS - 1))  # ceil: at most MAX_PARTS - 1 parts
        if need > part:
            part = -(-need // MiB) * MiB
    if part > MAX_PART_SIZE:
        raise OSError(errno.EFBIG, f"a blob of {size} bytes is larger than object storage takes")
    return part


def _cause(exc: BaseException) -> str:
    """The first line of an obstore error (they carry a long debug dump after it)."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 400 else line[:400] + "..."


def _is_missing(exc: BaseException) -> bool:
    return isinstance(exc, (FileNotFoundError, oe.NotFoundError))


def _is_precondition(exc: BaseException) -> bool:
    return isinstance(exc, (oe.AlreadyExistsError, oe.PreconditionError, FileExistsError))


class ObjectStore(Store):
    """S3, GCS or Azure Blob storage through obstore (see the module docstring).

    ``scheme``: ``"s3"``, ``"gs"`` or ``"az"``. ``part_size``: the preferred multipart part size;
    ``max_concurrency``: parts uploaded, and ranges read, at once per blob; ``prefetch``: bytes read
    by ``open_blob``; ``read_chunk``: the size of the ranged GETs a large read is split into;
    ``retry``: obstore's RetryConfig; other keyword arguments: obstore's store and client options.
    """

    def __init__(
        self,
        scheme: str,
        *,
        part_size: int = DEFAULT_PART_SIZE,
        max_concurrency: int = 8,
        prefetch: int = 1 * MiB,
        read_chunk: int = 16 * MiB,
        retry: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        canonical = SCHEMES.get(scheme.lower())
        if canonical is None:
            raise ValueError(f"ObjectStore takes s3, gs or az, not {scheme!r}")
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size {part_size} is under the {MIN_PART_SIZE}-byte minimum")
        self.scheme = canonical
        self.capabilities = Capabilities(
            atomic_rename=False,
            create_only_put=True,
            direct_io=False,
            hard_links=False,
            zero_copy=False,
            durable=True,
            locks=False,
        )
        self.part_size = part_size
        self.max_concurrency = max(1, max_concurrency)
        self.prefetch = max(0, prefetch)
        self.read_chunk = max(MiB, read_chunk)
        self._retry = dict(DEFAULT_RETRY if retry is None else retry)
        self._client_options = {k: v for k, v in options.items() if k in _CLIENT_KEYS}
        if self._client_options:
            # obstore reads no client option from the environment once any is given: keep
            # the environment's (AWS_ALLOW_HTTP, ...) for those not given here.
            prefix = _ENV_PREFIX[canonical]
            for name in _CLIENT_KEYS - self._client_options.keys():
                value = os.environ.get(f"{prefix}_{name.upper()}")
                if value is not None:
                    self._client_options[name] = value
        self._config = {k: v for k, v in options.items() if k not in _CLIENT_KEYS}
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    # -- internals -----------------------------------------------------------------------------

    def _split(self, path: str) -> tuple[str, str]:
        """(bucket, key) of ``path``; the key is "" for a bucket (or the root, bucket "")."""
        parts = self.abspath(path).lstrip("/").split("/", 1)
        return parts[0], (parts[1] if len(parts) > 1 else "")

    def _client(self, bucket: str) -> Any:
        with self._lock:
            client = self._clients.get(bucket)
            if client is None:
                options: dict[str, Any] = {
                    "config": dict(self._config) or None,
                    "client_options": dict(self._client_options) or None,
                    "retry_config": self._retry,
                }
                client = obstore.store.from_url(f"{self.scheme}://{bucket}", **options)
                self._clients[bucket] = client
            return client

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.max_concurrency, thread_name_prefix="savepoint-objectstore"
                )
            return self._pool

    def _shown(self, bucket: str, key: str) -> str:
        return self.url(f"/{bucket}/{key}" if key else f"/{bucket}")

    def _error(self, exc: BaseException, bucket: str, key: str, what: str) -> OSError:
        """The OSError for an obstore failure of ``what`` on ``bucket/key``."""
        shown = self._shown(bucket, key)
        if _is_missing(exc):
            return FileNotFoundError(errno.ENOENT, f"No such object ({_cause(exc)})", shown)
        if _is_precondition(exc):
            return FileExistsError(errno.EEXIST, f"Object exists ({_cause(exc)})", shown)
        if isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError)):
            return PermissionError(errno.EACCES, f"{what} refused: {_cause(exc)}", shown)
        return OSError(errno.EIO, f"{what} {shown} failed: {_cause(exc)}", shown)

    def _head(self, bucket: str, key: str) -> dict[str, Any] | None:
        """The object's metadata; None when there is none."""
        if not key:
            return None
        try:
            return dict(obstore.head(self._client(bucket), key))
        except Exception as exc:
            if _is_missing(exc):
                return None
            raise self._error(exc, bucket, key, "HEAD") from exc

    def _has_children(self, bucket: str, key: str) -> bool:
        """Whether any object lies under ``key/`` (the whole bucket for key "")."""
        try:
            stream = obstore.list(self._client(bucket), prefix=key or None, chunk_size=1)
            return any(len(chunk) for chunk in stream)
        except Exception as exc:
            if _is_missing(exc):
                return False
            raise self._error(exc, bucket, key, "LIST") from exc

    def _is_dir(self, bucket: str, key: str) -> bool:
        return not key or self._has_children(bucket, key)

    def _parent_key(self, key: str) -> str:
        return key.rsplit("/", 1)[0] if "/" in key else ""

    def _need_parent(self, path: str, bucket: str, key: str) -> None:
        """FileNotFoundError unless the directory ``key`` would be created in exists."""
        if not bucket:
            raise FileNotFoundError(errno.ENOENT, "No bucket in the path", path)
        if not self._is_dir(bucket, self._parent_key(key)):
            raise FileNotFoundError(errno.ENOENT, "No such directory", self.url(path))

    def _put(self, bucket: str, key: str, data: Any, *, create: bool) -> None:
        try:
            obstore.put(
                self._client(bucket),
                key,
                data,
                mode="create" if create else "overwrite",
                use_multipart=False,
            )
        except Exception as exc:
            raise self._error(exc, bucket, key, "PUT") from exc

    def _delete(self, bucket: str, keys: list[str]) -> None:
        client = self._client(bucket)
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = keys[start : start + _DELETE_BATCH]
            try:
                obstore.delete(client, batch)
            except Exception as exc:
                if not _is_missing(exc):
                    raise self._error(exc, bucket, batch[0], "DELETE") from exc
                for one in batch:  # a store that reports a missing key in a batch: one by one
                    with contextlib.suppress(FileNotFoundError, oe.NotFoundError):
                        obstore.delete(client, one)

    # -- blobs ---------------------------------------------------------------------------------

    def open_blob(self, path: str, *, copy_on_write: bool = False) -> _Reader:
        bucket, key = self._split(path)
        shown = self.url(path)
        if not bucket:
            raise FileNotFoundError(errno.ENOENT, "No bucket in the path", shown)
        if not key:
            raise NotRegularFileError(path, shown)
        client = self._client(bucket)
        try:
            if self.prefetch:
                result = obstore.get(client, key, options={"range": (0, self.prefetch)})
            else:
                result = obstore.get(client, key, options={"head": True})
            meta = result.meta
            head = bytes(result.bytes()) if self.prefetch else b""
        except Exception as exc:
            if _is_missing(exc):
                if self._has_children(bucket, key):
                    raise NotRegularFileError(path, shown) from None
                raise self._error(exc, bucket, key, "GET") from None
            # An empty object answers a range with 416: its HEAD says so.
            found = self._head(bucket, key)
            if found is None or found["size"] != 0:
                raise self._error(exc, bucket, key, "GET") from exc
            meta, head = found, b""  # type: ignore[assignment]
        return _Reader(self, bucket, key, shown, int(meta["size"]), meta, head)

    def read_small(self, path: str, *, cap: int | None) -> bytes:
        bucket, key = self._split(path)
        shown = self.url(path)
        if not bucket:
            raise FileNotFoundError(errno.ENOENT, "No bucket in the path", shown)
        if not key:
            raise NotRegularFileError(path, shown)
        try:
            result = obstore.get(self._client(bucket), key)
            size = int(result.meta["size"])
            if cap is not None and size > cap:
                raise CorruptCheckpointError(
                    f"{shown} is {size} bytes, over the {cap}-byte cap", path=shown
                )
            return bytes(result.bytes())
        except CorruptCheckpointError:
            raise
        except Exception as exc:
            if _is_missing(exc) and self._has_children(bucket, key):
                raise NotRegularFileError(path, shown) from None
            raise self._error(exc, bucket, key, "GET") from None

    def create_blob(self, path: str, *, size: int | None = None, direct: bool = True) -> _Writer:
        bucket, key = self._split(path)
        if not key:
            raise IsADirectoryError(errno.EISDIR, "Is a bucket", self.url(path))
        self._need_parent(path, bucket, key)
        if self._head(bucket, key) is not None:
            raise FileExistsError(errno.EEXIST, "File exists", self.url(path))
        if self._has_children(bucket, key):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", self.url(path))
        return _Writer(self, bucket, key, size, part_size_for(size, self.part_size))

    def put(self, path: str, data: bytes, *, exclusive: bool = True) -> None:
        bucket, key = self._split(path)
        if not key:
            raise IsADirectoryError(errno.EISDIR, "Is a bucket", self.url(path))
        self._need_parent(path, bucket, key)
        if self._has_children(bucket, key):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", self.url(path))
        self._put(bucket, key, bytes(data), create=exclusive)

    def remove(self, path: str) -> None:
        bucket, key = self._split(path)
        if self._head(bucket, key) is None:
            if self._is_dir(bucket, key):
                raise IsADirectoryError(errno.EISDIR, "Is a directory", self.url(path))
            raise FileNotFoundError(errno.ENOENT, "No such object", self.url(path))
        self._delete(bucket, [key])

    # -- directories ---------------------------------------------------------------------------

    def stat(self, path: str) -> Stat | None:
        bucket, key = self._split(path)
        if not key:
            return Stat("dir", 0, ("dir", self.scheme, bucket, ""), 0.0)
        meta = self._head(bucket, key)
        if meta is not None:
            identity = ("object", meta.get("e_tag"), meta.get("version"))
            return Stat("file", int(meta["size"]), identity, meta["last_modified"].timestamp())
        if self._has_children(bucket, key):
            return Stat("dir", 0, ("dir", self.scheme, bucket, key), 0.0)
        return None

    def list(self, path: str) -> list[str]:
        bucket, key = self._split(path)
        if not bucket:
            return []
        try:
            found = obstore.list_with_delimiter(self._client(bucket), prefix=key or None)
        except Exception as exc:
            if _is_missing(exc):
                return []
            raise self._error(exc, bucket, key, "LIST") from exc
        names = {p.rsplit("/", 1)[-1] for p in found["common_prefixes"]}
        for meta in found["objects"]:
            if meta["path"] != key:  # a "key/" marker of another tool reads as "key"
                names.add(meta["path"].rsplit("/", 1)[-1])
        names.discard(MARKER)
        return sorted(names)

    def makedirs(self, path: str) -> None:
        bucket, key = self._split(path)
        if not bucket:
            raise FileNotFoundError(errno.ENOENT, "No bucket in the path", path)
        missing: list[str] = []
        while key:
            if self._head(bucket, key) is not None:
                raise FileExistsError(errno.EEXIST, "File exists (not a directory)", self.url(path))
            if self._has_children(bucket, key):
                break
            missing.append(key)
            key = self._parent_key(key)
        for dir_key in reversed(missing):
            with contextlib.suppress(FileExistsError):
                self._put(bucket, f"{dir_key}/{MARKER}", b"", create=True)

    def mkdir(self, path: str) -> None:
        bucket, key = self._split(path)
        if not key:
            raise FileExistsError(errno.EEXIST, "File exists (a bucket)", self.url(path))
        self._need_parent(path, bucket, key)
        if self._head(bucket, key) is not None or self._has_children(bucket, key):
            raise FileExistsError(errno.EEXIST, "File exists", self.url(path))
        self._put(bucket, f"{key}/{MARKER}", b"", create=True)

    def remove_tree(self, path: str) -> None:
        bucket, key = self._split(path)
        if not bucket:
            return
        client = self._client(bucket)
        keys = [key] if key else []
        try:
            for chunk in obstore.list(client, prefix=key or None, chunk_size=_DELETE_BATCH):
                keys.extend(meta["path"] for meta in chunk)
        except Exception as exc:
            if not _is_missing(exc):
                raise self._error(exc, bucket, key, "LIST") from exc
        # The marker last: the directory exists until everything in it is gone.
        keys.sort(key=lambda k: k.endswith("/" + MARKER))
        self._delete(bucket, keys)

    def sync_dir(self, path: str) -> None:
        """Nothing to make durable (every PUT is); a missing directory is the caller's error."""
        bucket, key = self._split(path)
        if not self._is_dir(bucket, key):
            if self._head(bucket, key) is not None:
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory", self.url(path))
            raise FileNotFoundError(errno.ENOENT, "No such directory", self.url(path))

    def pin(self, path: str) -> _Pinned:
        st = self.stat(path)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, "No such directory", self.url(path))
        if st.kind != "dir":
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", self.url(path))
        return _Pinned(self, self.abspath(path), st.identity)


class _Reader:
    """Ranged reads of one version of one object (see the module docstring)."""

    def __init__(
        self,
        store: ObjectStore,
        bucket: str,
        key: str,
        name: str,
        size: int,
        meta: Any,
        head: bytes,
    ) -> None:
        self.name = name
        self.size = size
        self._store = store
        self._bucket = bucket
        self._key = key
        self._options: dict[str, Any] = {}
        if meta.get("e_tag"):
            self._options["if_match"] = meta["e_tag"]
        if meta.get("version"):
            self._options["version"] = meta["version"]
        self._head = head  # the first bytes of the object (all of it when it is small)

    def _fetch(self, start: int, dst: memoryview) -> None:
        end = start + len(dst)
        try:
            options: Any = {**self._options, "range": (start, end)}
            result = obstore.get(self._store._client(self._bucket), self._key, options=options)
            data = memoryview(result.bytes())
        except Exception as exc:
            if _is_missing(exc) or _is_precondition(exc):
                raise CorruptCheckpointError(
                    f"{self.name} was replaced or deleted since it was opened (reading bytes "
                    f"[{start}, {end})); load again",
                    path=self.name,
                ) from None
            raise self._store._error(exc, self._bucket, self._key, "GET") from exc
        if len(data) != len(dst):
            raise CorruptCheckpointError(
                f"{self.name}: asked for bytes [{start}, {end}), got {len(data)}", path=self.name
            )
        dst[:] = data

    def read(self, offset: int, out: Any) -> None:
        dst = memoryview(out).cast("B")
        n = len(dst)
        if offset < 0:
            raise ValueError(f"negative offset {offset} into {self.name}")
        if offset + n > self.size:
            raise EOFError(f"wanted {n} bytes at {offset} of {self.name}, it has {self.size}")
        cached = max(0, min(n, len(self._head) - offset))
        if cached:
            dst[:cached] = memoryview(self._head)[offset : offset + cached]
        if cached == n:
            return
        start, rest = offset + cached, dst[cached:]
        chunk = self._store.read_chunk
        if len(rest) <= chunk:
            self._fetch(start, rest)
            return
        pieces = [(start + i, rest[i : i + chunk]) for i in range(0, len(rest), chunk)]
        futures = [self._store._executor().submit(self._fetch, s, d) for s, d in pieces]
        try:
            for future in futures:
                future.result()
        finally:
            for future in futures:
                future.cancel()
            concurrent.futures.wait(futures)

    def view(self, start: int, end: int) -> np.ndarray[Any, Any] | None:
        if not 0 <= start <= end <= self.size:
            raise EOFError(f"wanted bytes [{start}, {end}) of {self.name}, it has {self.size}")
        return None

    def close(self) -> None:
        self._head = b""


class _Writer:
    """A blob being uploaded: one PUT when it is smaller than a part, else a multipart upload."""

    alignment = 1

    def __init__(
        self, store: ObjectStore, bucket: str, key: str, size: int | None, part_size: int
    ) -> None:
        self._store = store
        self._bucket = bucket
        self._key = key
        self._size = size
        self.part_size = part_size
        self._limit = size if size is not None else part_size * (MAX_PARTS - 1)
        self._buf: bytearray | None = None
        self._fill = 0
        self._written = 0
        self._upload: WritableFile | None = None
        self.parts = 0  # parts handed to the multipart upload so far
        self._state = "open"  # "open", "finished", "aborted"

    @property
    def _shown(self) -> str:
        return self._store._shown(self._bucket, self._key)

    def _need_open(self, what: str) -> None:
        if self._state != "open":
            raise ValueError(f"{what} after the writer of {self._shown} was {self._state}")

    def _ship(self) -> None:
        """Hand the full buffer to the multipart upload (started by the first part)."""
        assert self._buf is not None
        try:
            if self._upload is None:
                self._upload = obstore.open_writer(
                    self._store._client(self._bucket),
                    self._key,
                    buffer_size=self.part_size,
                    max_concurrency=self._store.max_concurrency,
                )
            # obstore keeps a reference to the buffer (no copy): it is never touched again.
            self._upload.write(memoryview(self._buf)[: self._fill])
        except Exception as exc:
            self._abort_upload()
            raise self._store._error(exc, self._bucket, self._key, "upload of") from exc
        self.parts += 1
        self._buf = None
        self._fill = 0

    def write(self, data: memoryview) -> None:
        self._need_open("write")
        src = memoryview(data).cast("B")
        if self._size is not None:
            src = src[: max(0, self._size - self._written)]  # padding past the size is cut
        elif self._written + len(src) > self._limit:
            self._abort_upload()
            raise OSError(
                errno.EFBIG,
                f"{self._shown}: over {self._limit} bytes with part size {self.part_size} "
                "(declare the size to create_blob for larger blobs)",
                self._shown,
            )
        while len(src):
            if self._buf is not None and self._fill == len(self._buf):
                self._ship()  # full, and more is coming: this is not the last part
            if self._buf is None:
                self._buf = bytearray(self.part_size)
            n = min(len(src), len(self._buf) - self._fill)
            self._buf[self._fill : self._fill + n] = src[:n]
            self._fill += n
            self._written += n
            src = src[n:]

    def finish(self) -> None:
        self._need_open("finish")
        if self._size is not None and self._written < self._size:
            raise ValueError(
                f"{self._shown}: {self._written} bytes written of the {self._size} announced"
            )
        rest = memoryview(self._buf)[: self._fill] if self._buf is not None else b""
        if self._upload is None:
            self._store._put(self._bucket, self._key, rest, create=True)
        else:
            try:
                if self._fill:
                    self._upload.write(rest)
                    self.parts += 1
            except Exception as exc:
                self._abort_upload()
                raise self._store._error(exc, self._bucket, self._key, "upload of") from exc
            # No conditional completion in object_store: check, then complete (the race is
            # described in the module docstring).
            if self._store._head(self._bucket, self._key) is not None:
                self._abort_upload()
                raise FileExistsError(errno.EEXIST, "File exists", self._shown)
            upload, self._upload = self._upload, None
            try:
                upload.close()
            except Exception as exc:
                # object_store aborts the upload when the completion is refused.
                raise self._store._error(exc, self._bucket, self._key, "upload of") from exc
        self._buf = None
        self._state = "finished"

    def _abort_upload(self) -> None:
        upload, self._upload = self._upload, None
        if upload is not None:
            with contextlib.suppress(Exception):
                upload.__exit__(RuntimeError, RuntimeError("aborted"), None)

    def abort(self) -> None:
        self._abort_upload()
        self._buf = None
        if self._state == "finished":
            with contextlib.suppress(Exception):
                self._store._delete(self._bucket, [self._key])
        self._state = "aborted"


class _Pinned:
    """A prefix, pinned: under the manifest-last layout generations are never overwritten, so the
    prefix itself is stable; ``identity()`` is None once nothing is under it any more."""

    def __init__(self, store: ObjectStore, path: str, identity: Any) -> None:
        self.path = path
        self._store = store
        self._identity = identity

    def __enter__(self) -> _Pinned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _path(self, name: str) -> str:
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if ".." in parts or not parts:
            shown = self._store.url(Store.join(self.path, name))
            raise FileNotFoundError(errno.ENOENT, "No such object in the directory", shown)
        return Store.join(self.path, *parts)

    def open_blob(self, name: str, *, copy_on_write: bool = False) -> _Reader:
        return self._store.open_blob(self._path(name))

    def read_small(self, name: str, *, cap: int | None) -> bytes:
        return self._store.read_small(self._path(name), cap=cap)

    def identity(self) -> Any:
        bucket, key = self._store._split(self.path)
        return self._identity if self._store._is_dir(bucket, key) else None

    def close(self) -> None:
        pass


_SHARED: dict[str, ObjectStore] = {}
_SHARED_LOCK = threading.Lock()


def shared(scheme: str) -> ObjectStore:
    """The store behind every URL of ``scheme`` (``s3``, ``gs``, ``az``) in this process,
    configured from the environment."""
    canonical = SCHEMES.get(scheme.lower())
    if canonical is None:
        raise ValueError(f"no object store for {scheme}:// URLs")
    with _SHARED_LOCK:
        store = _SHARED.get(canonical)
        if store is None:
            store = _SHARED[canonical] = ObjectStore(canonical)
        return store
