"""Object storage (S3, GCS, Azure Blob) through obstore: ``s3://``, ``gs://`` and ``az://`` URLs.

Install with ``pip install 'savepoint[s3]'`` (or ``[gcs]``, ``[azure]``: each is obstore, the
Python binding of Rust's ``object_store``). ``import savepoint`` never imports obstore; this
module does, when a URL of one of these schemes is first resolved.

Namespace: paths are ``/bucket/key...`` (``s3://bucket/run/step-1`` is the path
``/bucket/run/step-1``); one obstore client per bucket, cached by the store. Directories are
prefixes: a directory exists while at least one object lies under ``prefix/``. ``mkdir`` and
``makedirs`` put an empty marker object, ``prefix/.savepoint-dir`` (object_store paths cannot end
in ``/``), so that an empty directory exists, as the commit transaction needs; ``list`` never shows
the marker. ``put_making_dir`` puts no marker: its object alone makes the new prefix exist. The capabilities are those of an object store: no rename, no hard links, no locks, no
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
object_store (0.14.2, in obstore 0.12.1) aborts the upload itself when a part or the completion
fails while ``finish`` completes it (obstore no longer exposes the upload then); one orphan remains
possible: when the answer to the request that *creates* an upload is lost, object_store's retry
creates a second one and the first, empty, stays open (obstore has no call to list or abort it).
Configure the bucket's lifecycle rule ``AbortIncompleteMultipartUpload`` as obstore's own
documentation advises. A completion whose answer was lost (it took effect, the client saw an
error, and S3 answers the retry with 404 NoSuchUpload) is a success when a HEAD finds the object
with this upload's size and, on S3, an ETag ending in ``-<parts>`` (the key was absent just
before the completion; nothing else writes a generation's keys).

Create-only puts (``put(exclusive=True)``, blobs smaller than a part, directory markers): a PUT
with ``If-None-Match: *``. obstore does not retry it after a timeout or a reset (it is not
idempotent), so this module does, up to the retry policy's ``max_retries``; and after any failure
it reads back what is at the key: its own bytes are a success (a lost answer: the put took effect,
the client saw an error, the retry got 412), other bytes are FileExistsError (another writer's),
nothing is a reason to send it again. Whether the server honours ``If-None-Match`` is probed once
per bucket, at its first create-only put: a probe object (``.savepoint-probe-<random>`` at the
bucket's root, never listed) is put create-only twice and deleted; if the second put succeeds, the
server ignores the precondition, a UserWarning says so once, and create-only puts of that bucket
become HEAD-then-put (two writers racing on one key between the HEAD and the PUT may both
succeed).

Timeouts and retries: obstore's ``timeout`` (30 s by default) bounds each request from connect
to the end of its response; it is a deadline per attempt, not a measure of progress, so it must
exceed the time a whole part (``part_size``) or read chunk (``read_chunk``) takes at the slowest
bandwidth expected: a part that stalls is cut off at the deadline and sent again (part uploads,
completions and reads are retried after a timeout; ``read_timeout``, off by default, bounds only
the gaps between reads of a response). ``retry_timeout`` bounds one request's retries as a whole.
Listings and GETs are retried here as well when their response body is cut off (obstore retries
only failures before the answer): an object's bytes, and the body of an error answer, which
obstore reads to build its error (a 404 for an object not there yet, cut off mid-body, is retried
and then read as "not there", never reported as a failure after one attempt). One budget, the
retry policy's ``max_retries`` attempts and ``retry_timeout``, covers obstore's retries and these.

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
100 ms to 15 s, for at most 60 s per request, obstore's retries and savepoint's together: an
endpoint that accepts connections and never answers fails a call in about a minute).
``sp.save("s3://...")`` uses :func:`shared`, one store per scheme configured from the environment;
a store configured by hand is passed as ``store.at("/bucket/run")``.

Errors: a missing object is FileNotFoundError; a refused precondition (the object exists, or changed)
is FileExistsError; a refused credential is PermissionError. A failed write (PUT, part upload,
completion, DELETE) is a :class:`~savepoint.errors.CheckpointWriteError` (an OSError, ``errno``
EIO), a failed read of a blob's bytes a CheckpointError, a failed HEAD or LIST an OSError (EIO);
every message names the object (``s3://bucket/key``, and the part), the attempts made ("after 4
attempts", from obstore's error and this module's own retries; "after obstore's retries (up to N
attempts)" where obstore's error does not say) and the cause (the status and S3's error code, or
the transport failure).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import re
import secrets
import threading
import time
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import obstore
import obstore.exceptions as oe
import obstore.store

from savepoint.errors import (
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    NotRegularFileError,
    ReplacedWhileReadingError,
)
from savepoint.storage.base import (
    Capabilities,
    PrefixPin,
    Stat,
    Store,
    pin_prefix,
    read_error,
)

if TYPE_CHECKING:
    from obstore import WritableFile

__all__ = [
    "DEFAULT_PART_SIZE",
    "MARKER",
    "MAX_PARTS",
    "MIN_PART_SIZE",
    "ObjectStore",
    "PROBE",
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
    "retry_timeout": timedelta(seconds=60),
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

# obstore's RetryError: "Error performing PUT <uri> in 12ms, after 2 retries, max_retries: 2,
# retry_timeout: 10s  - <cause>" (no "after ..." when the request was tried once).
_PERFORMING = re.compile(
    r"Error performing \S+ \S+ in [^,\n]*?(?:, after (?P<retries>\d+) retries[^\n]*?)?\s+- "
    r"(?P<cause>.*)",
    re.S,
)
PROBE = ".savepoint-probe-"  # the prefix of the object that tests a bucket's create-only puts

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
    """What went wrong, in one line: an obstore error's inner cause (the status and S3's error
    code, or the transport error's kind and reason), without its request line and debug dump."""
    text = str(exc).strip()
    first, _, debug = text.partition("Debug source:")
    found = _PERFORMING.search(first)
    cause = found.group("cause") if found else first
    code = re.search(r"<Code>([^<]*)</Code>", cause)
    cause = re.sub(r"(status code: \d{3}[^:<]*):.*", r"\1", cause, flags=re.S)
    lines = cause.strip().splitlines()
    cause = lines[0].strip() if lines else type(exc).__name__
    extra = [code.group(1)] if code else []
    kind = re.search(r"kind: (Timeout|Interrupted|Connect|Decode|Body)\b", debug)
    reason = re.search(r'message: "([^"]+)"', debug)
    if kind:
        extra.append({"Timeout": "timed out"}.get(kind.group(1), kind.group(1).lower()))
    if reason:
        extra.append(reason.group(1))
    if extra:
        cause += f" ({', '.join(extra)})"
    return cause if len(cause) <= 400 else cause[:400] + "..."


def _retries(exc: BaseException) -> int | None:
    """How many times obstore retried the request that failed with ``exc`` (0: it was tried
    once); None when the error does not say (it did not come from an HTTP request)."""
    found = _PERFORMING.search(str(exc).partition("Debug source:")[0])
    if found is None:
        return None
    return int(found.group("retries") or 0)


def _is_transport(exc: BaseException) -> bool:
    """Whether ``exc`` is a transport failure (a timeout, a reset, a lost response) rather than
    an answer of the server: the request may or may not have taken effect."""
    first, _, debug = str(exc).partition("Debug source:")
    if debug:
        return "inner: Http(" in debug or "kind: Interrupted" in debug or "kind: Timeout" in debug
    return "HTTP error:" in first  # an error converted without its debug dump


def _is_missing(exc: BaseException) -> bool:
    return isinstance(exc, (FileNotFoundError, oe.NotFoundError))


def _is_refused(exc: BaseException) -> bool:
    """A refused credential or request (401, 403): obstore says so for a GET or a HEAD, but a
    refused LIST reaches here as a generic error naming the status."""
    if isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError)):
        return True
    return re.search(r"status code: 40[13]\b", str(exc).partition("Debug source:")[0]) is not None


def _is_precondition(exc: BaseException) -> bool:
    return isinstance(exc, (oe.AlreadyExistsError, oe.PreconditionError, FileExistsError))


class _Counted(Exception):
    """A failure after ``attempts`` attempts, some of them savepoint's own retries."""

    def __init__(self, cause: BaseException, attempts: int) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.attempts = attempts


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
        self._probe_lock = threading.Lock()
        self._create_only: dict[str, bool] = {}  # bucket -> whether If-None-Match is honoured
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def config(self) -> dict[str, Any]:
        """The store options this store was built with (endpoint, region, credentials, ...), as
        obstore takes them; a copy (other clients of the same bucket, such as garbage collection's,
        are configured from it)."""
        return dict(self._config)

    @property
    def client_options(self) -> dict[str, Any]:
        """The HTTP client options this store uses (``allow_http``, ``timeout``, ...); a copy."""
        return dict(self._client_options)

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

    def _tries(self) -> int:
        """Attempts obstore makes of one request: its first and its retries."""
        return int(self._retry.get("max_retries", 10)) + 1

    def _error(
        self,
        exc: BaseException,
        bucket: str,
        key: str,
        what: str,
        *,
        attempts: int | None = None,
        write: bool = False,
        read: bool = False,
    ) -> OSError | CheckpointError:
        """The OSError for an obstore failure of ``what`` on ``bucket/key``: the message names the
        object, the attempts made (``attempts``, else what obstore's error says) and the cause. A
        failed write (``write``) is a CheckpointWriteError (an OSError, ``errno`` EIO): the layers
        above pass it on as it is, so its message reaches the caller; a failed read of a blob's
        bytes (``read``) is a CheckpointError, as the local store's is."""
        shown = self._shown(bucket, key)
        if _is_missing(exc):
            return FileNotFoundError(errno.ENOENT, f"No such object ({_cause(exc)})", shown)
        if _is_precondition(exc):
            return FileExistsError(errno.EEXIST, f"Object exists ({_cause(exc)})", shown)
        if _is_refused(exc):
            refused = PermissionError(errno.EACCES, f"{what} refused: {_cause(exc)}", shown)
            # The read side's refusals are CheckpointErrors (the Store contract), as local ones.
            return read_error(shown, refused) if read else refused
        if attempts is None:
            retries = _retries(exc)
            attempts = None if retries is None else retries + 1
        if attempts is not None:
            tried = f"after {attempts} attempt{'s' if attempts != 1 else ''}"
        else:
            tried = f"after obstore's retries (up to {self._tries()} attempts)"
        part = re.search(r"[?&]partNumber=(\d+)", str(exc).partition("Debug source:")[0])
        where = f"{shown} (part {part.group(1)})" if part else shown
        message = f"{what} {where} failed {tried}: {_cause(exc)}"
        if write and (part or "timed out" in message) and _is_transport(exc):
            # Each attempt of a part must finish within the client's timeout (obstore cannot
            # say how far a part got, so the deadline cannot follow its progress, and a timeout
            # of a part reaches here as "error sending request"): say which knob fits a slow link.
            timeout = self._client_options.get("timeout", "30s")
            message += (
                f"; an attempt of a part ({self.part_size >> 20} MiB, up to "
                f"{self.max_concurrency} at once) that does not finish within the client timeout "
                f"({timeout}) is cut off: on a slow link pass a larger timeout= or a smaller "
                "part_size= to the ObjectStore"
            )
        if write:
            return CheckpointWriteError(message, path=shown, errno=errno.EIO)
        if read:
            return CheckpointError(message, path=shown)
        return OSError(errno.EIO, message, shown)

    def _backoff(self, attempt: int) -> None:
        """Sleep before retrying, as obstore's backoff would (``attempt`` counts from 1)."""
        backoff = self._retry.get("backoff", {})
        first = backoff.get("init_backoff", timedelta(milliseconds=100)).total_seconds()
        most = backoff.get("max_backoff", timedelta(seconds=15)).total_seconds()
        time.sleep(min(most, first * float(backoff.get("base", 2)) ** (attempt - 1)))

    def _counted_error(
        self,
        exc: BaseException,
        bucket: str,
        key: str,
        what: str,
        *,
        write: bool = False,
        read: bool = False,
    ) -> OSError | CheckpointError:
        """:meth:`_error` of ``exc``, which may be a :class:`_Counted` failure."""
        if isinstance(exc, _Counted):
            return self._error(
                exc.cause, bucket, key, what, attempts=exc.attempts, write=write, read=read
            )
        return self._error(exc, bucket, key, what, write=write, read=read)

    def _read_retrying(self, call: Any) -> Any:
        """``call()``, retried on a transport failure: obstore retries a request that fails before
        its answer, but not one whose response body is cut off (a listing's, an object's, or the
        body of an error answer such as a 404's, which obstore reads to build its error)."""
        attempts = 0
        # One budget for obstore's retries and these: a server that accepts connections and
        # never answers fails a read after about retry_timeout, not retry_timeout per attempt.
        deadline = time.monotonic() + self._retry_budget()
        while True:
            try:
                return call()
            except Exception as exc:
                if _is_missing(exc) or not _is_transport(exc):
                    raise
                attempts += (_retries(exc) or 0) + 1
                if attempts >= self._tries() or time.monotonic() >= deadline:
                    raise _Counted(exc, attempts) from exc
                self._backoff(attempts)

    def _retry_budget(self) -> float:
        """Seconds of retries one request may take (the retry policy's ``retry_timeout``)."""
        limit = self._retry.get("retry_timeout")
        return limit.total_seconds() if isinstance(limit, timedelta) else 180.0

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

        def look() -> bool:
            stream = obstore.list(self._client(bucket), prefix=key or None, chunk_size=1)
            return any(len(chunk) for chunk in stream)

        try:
            return bool(self._read_retrying(look))
        except Exception as exc:
            if _is_missing(exc):
                return False
            raise self._counted_error(exc, bucket, key, "LIST") from exc

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
        """One PUT of ``data``; ``create``: a create-only put (see "Create-only puts" in the
        module docstring)."""
        client = self._client(bucket)
        if create and not self._honours_create_only(bucket):
            if self._head(bucket, key) is not None:
                shown = self._shown(bucket, key)
                raise FileExistsError(errno.EEXIST, "Object exists (found by HEAD)", shown)
            create = False  # the server would ignore If-None-Match: an overwrite, retried
        if not create:
            try:  # idempotent: obstore retries it after any failure
                obstore.put(client, key, data, mode="overwrite", use_multipart=False)
            except Exception as exc:
                raise self._error(exc, bucket, key, "PUT", write=True) from exc
            return
        attempts = 0
        while True:
            try:
                obstore.put(client, key, data, mode="create", use_multipart=False)
                return
            except Exception as exc:
                failed = exc
            attempts += (_retries(failed) or 0) + 1
            refused = isinstance(failed, (oe.PermissionDeniedError, oe.UnauthenticatedError))
            if refused or _is_missing(failed):
                raise self._error(failed, bucket, key, "PUT", write=True) from failed
            # The put may have taken effect although this client saw it fail (a lost response;
            # obstore's retry of it then met the object: 412): what is there says.
            try:
                there = self._get_all(bucket, key)
            except Exception:
                raise self._error(
                    failed, bucket, key, "PUT", attempts=attempts, write=True
                ) from failed
            if there is not None:
                if there == bytes(data):
                    return  # ours
                raise FileExistsError(errno.EEXIST, "Object exists", self._shown(bucket, key))
            if not (_is_transport(failed) or _is_precondition(failed)) or (
                attempts >= self._tries()
            ):
                raise self._error(
                    failed, bucket, key, "PUT", attempts=attempts, write=True
                ) from failed
            # Not there: it did not take effect (obstore does not retry a put that is not
            # idempotent after a timeout or a reset). Send it again.
            self._backoff(attempts)

    def _get_all(self, bucket: str, key: str) -> bytes | None:
        """The whole object; None when there is none."""
        try:
            return bytes(
                self._read_retrying(lambda: obstore.get(self._client(bucket), key).bytes())
            )
        except Exception as exc:
            if _is_missing(exc):
                return None
            raise

    def _honours_create_only(self, bucket: str) -> bool:
        """Whether the server of ``bucket`` honours ``If-None-Match: *``, probed once per bucket
        at its first create-only put: a probe object at the bucket's root is put create-only
        twice (the second must be refused), then deleted. A server that ignores it is warned
        about once; a probe that fails is tried again at the next create-only put (True
        meanwhile), one refused for want of permission is not (True)."""
        with self._probe_lock:
            known = self._create_only.get(bucket)
            if known is not None:
                return known
            probe = PROBE + secrets.token_hex(8)  # at the bucket's root: in no checkpoint
            client = self._client(bucket)
            try:
                obstore.put(client, probe, b"", mode="create", use_multipart=False)
                try:
                    obstore.put(client, probe, b"", mode="create", use_multipart=False)
                    honoured = False
                except Exception as exc:
                    if not _is_precondition(exc):
                        raise
                    honoured = True
            except Exception as exc:
                if isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError)):
                    self._create_only[bucket] = True  # may not write there: trust the server
                return True
            finally:
                with contextlib.suppress(Exception):
                    obstore.delete(client, probe)
            self._create_only[bucket] = honoured
        if not honoured:
            warnings.warn(
                f"the object store serving bucket {bucket!r} ({self._shown(bucket, '')}) ignores "
                "If-None-Match, so create-only puts are not atomic there: two writers racing on "
                "one checkpoint path may both believe they committed. savepoint checks with a "
                "HEAD before each create-only put instead, which leaves a small race.",
                UserWarning,
                stacklevel=2,
            )
        return honoured

    def _delete(self, bucket: str, keys: list[str]) -> None:
        client = self._client(bucket)
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = keys[start : start + _DELETE_BATCH]
            try:
                obstore.delete(client, batch)
            except Exception as exc:
                if not _is_missing(exc):
                    raise self._error(exc, bucket, batch[0], "DELETE", write=True) from exc
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

        def first() -> tuple[Any, bytes]:
            if self.prefetch:
                result = obstore.get(client, key, options={"range": (0, self.prefetch)})
                return result.meta, bytes(result.bytes())
            return obstore.get(client, key, options={"head": True}).meta, b""

        try:
            meta, head = self._read_retrying(first)
        except Exception as exc:
            if _is_missing(exc):
                if self._has_children(bucket, key):
                    raise NotRegularFileError(path, shown) from None
                raise self._error(exc, bucket, key, "GET", read=True) from None
            # An empty object answers a range with 416: its HEAD says so.
            found = None
            with contextlib.suppress(OSError):
                found = self._head(bucket, key)
            if found is None or found["size"] != 0:
                raise self._counted_error(exc, bucket, key, "GET", read=True) from exc
            meta, head = found, b""
        return _Reader(self, bucket, key, shown, int(meta["size"]), meta, head)

    def read_small(self, path: str, *, cap: int | None) -> bytes:
        bucket, key = self._split(path)
        shown = self.url(path)
        if not bucket:
            raise FileNotFoundError(errno.ENOENT, "No bucket in the path", shown)
        if not key:
            raise NotRegularFileError(path, shown)

        def whole() -> bytes:
            result = obstore.get(self._client(bucket), key)
            size = int(result.meta["size"])
            if cap is not None and size > cap:
                raise CorruptCheckpointError(
                    f"{shown} is {size} bytes, over the {cap}-byte cap", path=shown
                )
            return bytes(result.bytes())

        try:
            data: bytes = self._read_retrying(whole)
            return data
        except CorruptCheckpointError:
            raise
        except Exception as exc:
            if _is_missing(exc) and self._has_children(bucket, key):
                raise NotRegularFileError(path, shown) from None
            raise self._counted_error(exc, bucket, key, "GET", read=True) from None

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

    def put_making_dir(self, path: str, data: bytes, *, exclusive: bool = True) -> None:
        """One PUT, no marker first where the directory is missing: the object makes its prefix
        (and every missing parent) exist, so nobody sees the new directory without it."""
        bucket, key = self._split(path)
        if not key:
            raise IsADirectoryError(errno.EISDIR, "Is a bucket", self.url(path))
        directory = self._parent_key(key)
        if self._is_dir(bucket, directory):
            self.put(path, data, exclusive=exclusive)
            return
        while directory:  # as makedirs: no blob where a missing directory would be
            if self._head(bucket, directory) is not None:
                raise FileExistsError(
                    errno.EEXIST,
                    "File exists (not a directory)",
                    self._shown(bucket, directory),
                )
            if self._has_children(bucket, directory):
                break
            directory = self._parent_key(directory)
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
            found = self._read_retrying(
                lambda: obstore.list_with_delimiter(self._client(bucket), prefix=key or None)
            )
        except Exception as exc:
            if _is_missing(exc):
                return []
            raise self._counted_error(exc, bucket, key, "LIST") from exc
        names = {p.rsplit("/", 1)[-1] for p in found["common_prefixes"]}
        for meta in found["objects"]:
            if meta["path"] != key:  # a "key/" marker of another tool reads as "key"
                names.add(meta["path"].rsplit("/", 1)[-1])
        names.discard(MARKER)
        return sorted(n for n in names if not n.startswith(PROBE))

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

        def everything() -> list[str]:
            found = [key] if key else []
            for chunk in obstore.list(client, prefix=key or None, chunk_size=_DELETE_BATCH):
                found.extend(meta["path"] for meta in chunk)
            return found

        try:
            keys: list[str] = self._read_retrying(everything)
        except Exception as exc:
            if not _is_missing(exc):
                raise self._counted_error(exc, bucket, key, "LIST", write=True) from exc
            keys = [key] if key else []
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

    def pin(self, path: str) -> PrefixPin:
        return pin_prefix(self, path, lambda where: self._is_dir(*self._split(where)))


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
        options: Any = {**self._options, "range": (start, end)}
        client = self._store._client(self._bucket)
        try:
            data = memoryview(
                self._store._read_retrying(
                    lambda: obstore.get(client, self._key, options=options).bytes()
                )
            )
        except Exception as exc:
            if _is_missing(exc) or _is_precondition(exc):
                raise ReplacedWhileReadingError(
                    f"{self.name} was replaced or deleted since it was opened (reading bytes "
                    f"[{start}, {end})); load again",
                    path=self.name,
                ) from None
            raise self._store._counted_error(
                exc, self._bucket, self._key, "GET", read=True
            ) from exc
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
            raise self._store._error(exc, self._bucket, self._key, "upload of", write=True) from exc
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
                raise self._store._error(
                    exc, self._bucket, self._key, "upload of", write=True
                ) from exc
            # No conditional completion in object_store: check, then complete (the race is
            # described in the module docstring).
            if self._store._head(self._bucket, self._key) is not None:
                self._abort_upload()
                raise FileExistsError(errno.EEXIST, "File exists", self._shown)
            upload, self._upload = self._upload, None
            try:
                upload.close()  # the last part, then the completion
            except Exception as exc:
                # object_store aborts the upload itself when a part or the completion fails.
                # A completion whose answer was lost took effect all the same: what is there says.
                if not self._completed():
                    if _is_missing(exc) or _is_precondition(exc):
                        # The completion's retry found no upload, and the object is not this
                        # upload's: another writer's, or none.
                        raise CheckpointWriteError(
                            f"upload of {self._shown} failed: its completion was refused and "
                            f"the object there is not this upload's ({_cause(exc)})",
                            path=self._shown,
                            errno=errno.EIO,
                        ) from exc
                    raise self._store._error(
                        exc, self._bucket, self._key, "upload of", write=True
                    ) from exc
        self._buf = None
        self._state = "finished"

    def _completed(self) -> bool:
        """Whether the object is there as this upload completes it: its size, and on S3 its ETag's
        part count (``"<md5 of the parts' md5s>-<parts>"``). Nothing else writes the key between
        the HEAD just before the completion and now, unless two writers race on one key (which
        the commit protocol never does: data goes to a generation unique to the attempt)."""
        try:
            meta = self._store._head(self._bucket, self._key)
        except OSError:
            return False
        if meta is None or int(meta["size"]) != self._written:
            return False
        if self._store.scheme == "s3":
            return str(meta.get("e_tag") or "").strip('"').endswith(f"-{self.parts}")
        return True

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
