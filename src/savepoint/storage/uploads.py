"""Open multipart uploads on S3: list and abort those under a prefix (garbage collection).

A save that dies during a multipart upload (a blob of more than one part, see
:mod:`savepoint.storage.objectstore`) leaves the upload open: its parts are stored, and billed,
but belong to no object, and ``list`` never shows them. obstore (object_store) can neither list
nor abort an upload it did not start, so this module uses boto3 when it is installed. Without
boto3, :func:`client_for` raises :class:`UploadsUnavailable` saying so, and garbage collection
reports that open uploads were not checked (a bucket lifecycle rule
``AbortIncompleteMultipartUpload`` removes them in any case, as obstore's documentation advises).

Configuration follows the store's: an :class:`~savepoint.storage.objectstore.ObjectStore`
configured by hand (``endpoint=``, ``region=``, ``access_key_id=``, ``secret_access_key=``,
``session_token=``, ``skip_signature=``, ``virtual_hosted_style_request=``, in any of the spellings
obstore takes: ``aws_endpoint``, ``AWS_REGION``, ...) is read through its options; anything not
given there comes from the same ``AWS_*`` environment variables obstore reads
(``AWS_ENDPOINT_URL``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_SKIP_SIGNATURE``, ``AWS_PROFILE``). Only
S3 is handled: GCS and Azure have their own mechanisms (resumable uploads expire; uncommitted
blocks are dropped after a week).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.util
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from savepoint.storage.base import Store

__all__ = [
    "OpenUpload",
    "UploadsUnavailable",
    "abort",
    "client_for",
    "close",
    "list_open",
    "s3_options",
]


class UploadsUnavailable(Exception):
    """Open uploads cannot be checked on this store; the message says why."""


@dataclass(frozen=True)
class OpenUpload:
    """A multipart upload that was started and neither completed nor aborted."""

    bucket: str
    key: str
    upload_id: str
    initiated: dt.datetime  # timezone-aware (UTC)


# The spellings obstore accepts for each S3 option this module needs (lower case, without a
# leading "aws_"), mapped to one name.
_ALIASES = {
    "endpoint": "endpoint",
    "endpoint_url": "endpoint",
    "region": "region",
    "default_region": "region",
    "access_key_id": "access_key_id",
    "secret_access_key": "secret_access_key",
    "session_token": "session_token",
    "token": "session_token",
    "skip_signature": "skip_signature",
    "virtual_hosted_style_request": "virtual_hosted_style_request",
}
_ENV = {
    "endpoint": ("AWS_ENDPOINT_URL", "AWS_ENDPOINT"),
    "region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
    "access_key_id": ("AWS_ACCESS_KEY_ID",),
    "secret_access_key": ("AWS_SECRET_ACCESS_KEY",),
    "session_token": ("AWS_SESSION_TOKEN", "AWS_TOKEN"),
    "skip_signature": ("AWS_SKIP_SIGNATURE",),
    "virtual_hosted_style_request": ("AWS_VIRTUAL_HOSTED_STYLE_REQUEST",),
}


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def s3_options(store: Store, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The S3 options of ``store`` that a boto3 client needs (see the module docstring): the
    store's own (an ObjectStore configured by hand), else the environment's."""
    env = os.environ if environ is None else environ
    # An ObjectStore says how it was configured (ObjectStore.config / client_options); any other
    # store is configured from the environment alone.
    given: dict[str, Any] = {}
    for name in ("client_options", "config"):
        source = getattr(store, name, None)
        if isinstance(source, Mapping):
            given.update({str(k): v for k, v in source.items()})
    found: dict[str, Any] = {}
    for name, value in given.items():
        key = name.lower()
        key = key[4:] if key.startswith("aws_") else key
        if key in _ALIASES and value is not None:
            found[_ALIASES[key]] = value
    for option, variables in _ENV.items():
        if option not in found:
            for variable in variables:
                if env.get(variable):
                    found[option] = env[variable]
                    break
    return found


def client_for(store: Store) -> Any:
    """A boto3 S3 client configured as ``store`` is; close it after use. Raises
    :class:`UploadsUnavailable` where open uploads cannot be checked (not S3, no boto3)."""
    if store.scheme != "s3":
        raise UploadsUnavailable(
            f"open uploads are checked on S3 only, not on {store.scheme}:// storage (its "
            "incomplete uploads expire by themselves)"
        )
    if importlib.util.find_spec("boto3") is None:
        raise UploadsUnavailable(
            "boto3 is not installed (obstore can neither list nor abort multipart uploads; "
            "pip install boto3, or configure the bucket's lifecycle rule "
            "AbortIncompleteMultipartUpload)"
        )
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    options = s3_options(store)
    kwargs: dict[str, Any] = {}
    if options.get("endpoint"):
        kwargs["endpoint_url"] = str(options["endpoint"])
    if options.get("region"):
        kwargs["region_name"] = str(options["region"])
    for name in ("access_key_id", "secret_access_key", "session_token"):
        if options.get(name):
            kwargs[f"aws_{name}"] = str(options[name])
    config: dict[str, Any] = {}
    if _truthy(options.get("skip_signature", False)):
        config["signature_version"] = UNSIGNED
    if "endpoint_url" in kwargs:
        # obstore addresses a custom endpoint path-style unless told otherwise.
        virtual = _truthy(options.get("virtual_hosted_style_request", False))
        config["s3"] = {"addressing_style": "virtual" if virtual else "path"}
    if config:
        kwargs["config"] = Config(**config)
    return boto3.client("s3", **kwargs)


def list_open(client: Any, bucket: str, prefix: str) -> list[OpenUpload]:
    """Every open multipart upload of ``bucket`` whose key starts with ``prefix``."""
    return list(_pages(client, bucket, prefix))


def _pages(client: Any, bucket: str, prefix: str) -> Iterator[OpenUpload]:
    marker: dict[str, str] = {}
    while True:
        page = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix, **marker)
        for upload in page.get("Uploads", []):
            initiated = upload["Initiated"]
            if initiated.tzinfo is None:
                initiated = initiated.replace(tzinfo=dt.timezone.utc)
            yield OpenUpload(bucket, upload["Key"], upload["UploadId"], initiated)
        if not page.get("IsTruncated"):
            return
        marker = {
            "KeyMarker": page.get("NextKeyMarker", ""),
            "UploadIdMarker": page.get("NextUploadIdMarker", ""),
        }


def abort(client: Any, upload: OpenUpload) -> None:
    """Abort ``upload`` (its parts are deleted); one already gone is fine."""
    try:
        client.abort_multipart_upload(
            Bucket=upload.bucket, Key=upload.key, UploadId=upload.upload_id
        )
    except Exception as exc:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code")
        if code != "NoSuchUpload":
            raise


def close(client: Any) -> None:
    """Close a client made by :func:`client_for` (its pool keeps sockets open)."""
    with contextlib.suppress(Exception):
        client.close()
