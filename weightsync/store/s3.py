"""S3 backend: a :class:`Store` over any S3-compatible service through botocore; conditional writes
as S3 preconditions, ages by the server's clock, credentials only from boto3's standard chain,
no retries inside (every error says whether it is ``retryable``; docs/DESIGN.md)."""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import fields
from email.utils import parsedate_to_datetime
from http import HTTPStatus
from typing import TypeVar
from urllib.parse import urlsplit

import botocore.exceptions
import botocore.session
import urllib3.exceptions
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, IncompleteReadError

from weightsync.errors import AlreadyExistsError, NotFoundError, PreconditionFailedError, StoreError, UsageError
from weightsync.store.base import Match, ObjectMeta, PutMode, Store, check_key
from weightsync.store.s3_client import S3Options, _make_client

MAX_PARTS = 10_000

_CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})
_RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
_RETRYABLE_CODES = frozenset(
    "SlowDown Throttling ThrottlingException TooManyRequests RequestTimeout "
    "RequestTimeoutException InternalError ServiceUnavailable".split()
)
# Transport failures: connection refused/reset/closed, connect and read timeouts, bodies cut short.
_TRANSPORT_ERRORS = (
    botocore.exceptions.ConnectionError,
    HTTPClientError,
    IncompleteReadError,
    urllib3.exceptions.HTTPError,
    ConnectionError,
    TimeoutError,
)
# The ``reason`` label of a retry (weightsync.store.retry.RETRY_REASONS), from the error's kind.
_THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests"})
_TIMEOUT_CODES = frozenset({"RequestTimeout", "RequestTimeoutException"})
_TIMEOUT_ERRORS = (
    TimeoutError,
    urllib3.exceptions.TimeoutError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ConnectTimeoutError,
)
_TRUNCATED_ERRORS = (
    IncompleteReadError,
    urllib3.exceptions.IncompleteRead,
    botocore.exceptions.ResponseStreamingError,
)
_CHECKSUM_FIELDS = tuple(f"Checksum{name}" for name in ("CRC32", "CRC32C", "CRC64NVME", "SHA1", "SHA256"))

T = TypeVar("T")
ReadPart = Callable[[int, int], bytes]  # (offset, length) -> the bytes of one part


def _server_now(response: dict) -> float:
    """The server's clock (its ``Date`` header, whole seconds), so that ages do not depend on this
    host's clock; this host's clock if the header is missing."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    return parsedate_to_datetime(date).timestamp() if date else time.time()


def _code_status(exc: ClientError) -> tuple[str, int]:
    """The S3 error code and HTTP status; HEAD errors have no body, so their code is the phrase."""
    code = str(exc.response.get("Error", {}).get("Code") or "Unknown")
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    if code == str(status):
        try:
            code = HTTPStatus(status).phrase.replace(" ", "")
        except ValueError:
            pass
    return code, status


def _status_reason(code: str, status: int) -> str:
    """The retry reason of a retryable S3 error response."""
    if status == 429 or code in _THROTTLE_CODES:
        return "throttled"
    if code in _TIMEOUT_CODES:
        return "timeout"
    return "server_error" if status >= 500 or code in _RETRYABLE_CODES else "other"


def _transport_reason(exc: BaseException) -> str:
    """The retry reason of a transport failure (no response, or a body cut short)."""
    if isinstance(exc, _TIMEOUT_ERRORS):
        return "timeout"
    return "truncated" if isinstance(exc, _TRUNCATED_ERRORS) else "connection"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class S3Store(Store):
    """Objects under ``s3://bucket/prefix/``; see the module docstring for semantics."""

    def __init__(self, bucket: str, prefix: str = "", options: S3Options | None = None):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.options = options or S3Options()
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._key_prefix = f"{self.prefix}/" if self.prefix else ""
        try:
            self._client = _make_client(self.options)
        except ValueError as exc:  # botocore: an endpoint that is not a URL (the flag, or AWS_ENDPOINT_URL)
            raise UsageError(f"cannot open {self.url}: {exc}") from None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **options) -> S3Store:
        """``s3://bucket[/prefix]``; ``options`` are :class:`S3Options` fields."""
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - a port that is not a number raises here, not later
        except ValueError as exc:
            raise UsageError(f"not an S3 store URL (s3://bucket/prefix): {url} ({exc})") from None
        if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
            raise UsageError(f"not an S3 store URL (s3://bucket/prefix): {url}")
        prefix = parts.path.strip("/")
        if prefix:
            try:
                check_key(prefix)
            except StoreError:
                raise UsageError(f"invalid prefix in S3 store URL: {url}") from None
        known = {f.name for f in fields(S3Options)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise UsageError(f"unknown S3 store options {unknown}; known: {sorted(known)}")
        return cls(parts.netloc, prefix, S3Options(**options))

    # -- error mapping -----------------------------------------------------------------------

    def _error(self, op: str, key: str, what: str, *, cls=StoreError, retryable=False, reason="other") -> StoreError:
        where = (
            f"{self.url}/{key}" if key and key != "''" else self.url
        )  # "s3://b/run/HEAD: GET: ...", never "GET HEAD"
        err = cls(f"{where}: {op}: {what}", key=key)
        err.retryable = retryable
        err.retry_reason = reason  # the retry counter's label, when retryable
        return err

    @contextmanager
    def _errors(self, op: str, key: str, conflict: type[StoreError] | None = None):
        """Turn botocore failures into one-line store errors.

        ``conflict`` is the error for a failed precondition (412): AlreadyExists or
        PreconditionFailed; None where the request had no precondition.
        """
        try:
            yield
        except ClientError as exc:
            raise self._client_error(op, key, exc, conflict) from exc
        except _TRANSPORT_ERRORS as exc:
            raise self._error(
                op,
                key,
                f"{type(exc).__name__}: {_one_line(exc)}",
                retryable=True,
                reason=_transport_reason(exc),
            ) from exc
        except BotoCoreError as exc:  # no credentials, invalid parameters...
            raise self._error(op, key, f"{type(exc).__name__}: {_one_line(exc)}") from exc
        except KeyError as exc:  # an answer without a field S3 servers send (a captive portal's page, no ETag)
            raise self._error(op, key, f"the answer has no {exc.args[0]}: is the endpoint an S3 server?") from exc
        except RecursionError as exc:  # botocore follows a 3xx answer by recursion
            raise self._error(op, key, "the endpoint redirects without end: is it an S3 server?") from exc

    def _client_error(self, op, key, exc: ClientError, conflict) -> StoreError:
        code, status = _code_status(exc)
        what = f"{code} ({status})"
        if conflict is not None and (status == 412 or code in _CONFLICT_CODES):
            return self._error(op, key, f"{what}: precondition failed", cls=conflict)
        if conflict is PreconditionFailedError and code == "NoSuchKey":  # If-Match on a missing key
            return self._error(op, key, f"{what}: precondition failed", cls=conflict)
        if code in ("NoSuchKey", "NotFound"):
            return self._error(op, key, what, cls=NotFoundError)
        retryable = status in _RETRYABLE_STATUS or code in _RETRYABLE_CODES
        return self._error(op, key, what, retryable=retryable, reason=_status_reason(code, status))

    # -- small objects -----------------------------------------------------------------------

    def _obj(self, key: str) -> dict[str, str]:
        """Bucket and full key of ``key``, as boto3 arguments; rejects invalid keys."""
        return {"Bucket": self.bucket, "Key": self._key_prefix + check_key(key)}

    def get(self, key: str) -> bytes:
        return self.get_with_etag(key)[0]

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        obj = self._obj(key)
        with self._errors("GET", key):
            resp = self._client.get_object(**obj)
            return resp["Body"].read(), resp["ETag"]

    def get_at_most(self, key: str, limit: int) -> bytes:
        obj = self._obj(key)
        with self._errors("GET", key):
            resp = self._client.get_object(**obj)
            body, length = resp["Body"], int(resp["ContentLength"])
            try:
                data = body.read(limit + 1)
            finally:
                body.close()  # the rest of a larger object is not read (its connection is dropped)
            if len(data) < min(limit + 1, length):  # a read of a given size does not check the length: a
                # body cut short comes back short (a retry, not a checksum error)
                raise IncompleteReadError(actual_bytes=len(data), expected_bytes=min(limit + 1, length))
            return data

    def get_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | None:
        """One ``GET`` with ``If-None-Match: etag``: ``None`` when the server answers ``304 Not
        Modified`` (no body; botocore raises it as a ClientError). A server that ignores the header
        answers ``200`` with the same ETag, which is taken as unchanged too."""
        if etag is None:
            return self.get_with_etag(key)
        obj = self._obj(key)
        with self._errors("GET", key):
            try:
                resp = self._client.get_object(**obj, IfNoneMatch=etag)
            except ClientError as exc:
                if _code_status(exc)[1] == 304:
                    return None
                raise
            if resp["ETag"] == etag:
                resp["Body"].close()
                return None
            return resp["Body"].read(), resp["ETag"]

    def get_range(self, key: str, start: int, length: int) -> bytes:
        obj = self._obj(key)
        if start < 0 or length < 0:
            raise self._error("GET", key, f"invalid range start={start} length={length}")
        if length == 0:
            if self.head(key) is None:
                raise self._error("GET", key, "NoSuchKey (404)", cls=NotFoundError)
            return b""
        with self._errors("GET", key):
            try:
                resp = self._client.get_object(**obj, Range=f"bytes={start}-{start + length - 1}")
            except ClientError as exc:
                if _code_status(exc)[1] == 416:  # start at or past the end of an existing object
                    return b""
                raise
            data = resp["Body"].read()
        # A server that ignores Range answers 200 with the whole object.
        return data if "ContentRange" in resp else data[start : start + length]

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        conditions, conflict = self._put_conditions(mode)
        view = memoryview(data).cast("B")
        if view.nbytes > self.options.multipart_threshold:
            self._put_multipart(key, view.nbytes, lambda off, n: bytes(view[off : off + n]), mode)
            return
        body = data if isinstance(data, (bytes, bytearray)) else view.tobytes()
        obj = self._obj(key)
        with self._errors("PUT", key, conflict):
            self._client.put_object(**obj, Body=body, **conditions)

    def put_if_match(self, key: str, data: bytes, etag: str | None) -> None:
        """One conditional PUT (never multipart: S3 caps a single PUT at 5 GiB)."""
        obj = self._obj(key)
        condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
        with self._errors("PUT", key, PreconditionFailedError):
            self._client.put_object(**obj, Body=bytes(data), **condition)

    def head(self, key: str) -> int | None:
        resp = self._head(key)
        return None if resp is None else int(resp["ContentLength"])

    def compare(self, key: str, data: bytes | memoryview) -> Match:
        """One ``HEAD``: the size, then the ``ETag``, which is the MD5 of the bytes for an object stored
        by one PUT unencrypted or with S3-managed keys (``AES256``); not for one stored in parts
        (``<md5>-<parts>``), encrypted with KMS (``aws:kms``, ``aws:kms:dsse``) or a customer's key,
        or in a directory bucket (``--x-s3``)."""
        resp = self._head(key)
        if resp is None:
            return "absent"
        if int(resp["ContentLength"]) != memoryview(data).nbytes:
            return "other"
        etag = str(resp.get("ETag", "")).strip('"').lower()
        md5 = (
            resp.get("ServerSideEncryption") in (None, "AES256")
            and not resp.get("SSECustomerAlgorithm")
            and not self.bucket.endswith("--x-s3")
            and re.fullmatch(r"[0-9a-f]{32}", etag)
        )
        if not md5:
            return "same-size"
        return "same" if hashlib.md5(data, usedforsecurity=False).hexdigest() == etag else "other"

    def _head(self, key: str) -> dict | None:
        """The ``head_object`` answer, or None if the object does not exist."""
        obj = self._obj(key)
        with self._errors("HEAD", key):
            try:
                return self._client.head_object(**obj)
            except ClientError as exc:
                if _code_status(exc)[1] == 404:
                    return None
                raise

    def list(self, prefix: str = "") -> Iterator[str]:
        # Sorted because not every server lists in order.
        return iter(sorted(meta.key for meta in self.list_meta(prefix)))

    def list_meta(self, prefix: str = "", *, offset: str | None = None) -> Iterator[ObjectMeta]:
        """One ``list_objects_v2`` request per page, lazily, in the server's order; ``offset`` is
        ``StartAfter``. Directory markers some servers list (keys ending in ``/``) are skipped."""
        skip = len(self._key_prefix)
        args = {"Bucket": self.bucket, "Prefix": self._key_prefix + prefix}
        if offset is not None:
            args["StartAfter"] = self._key_prefix + offset
        while True:
            with self._errors("LIST", prefix or "''"):
                page = self._client.list_objects_v2(**args)
            for obj in page.get("Contents", ()):
                key = obj["Key"][skip:]
                if key and not key.endswith("/"):
                    yield ObjectMeta(key, int(obj["Size"]), obj["LastModified"].timestamp())
            if not page.get("IsTruncated"):
                return
            args = {**args, "ContinuationToken": page["NextContinuationToken"]}

    def head_meta(self, key: str) -> ObjectMeta | None:
        resp = self._head(key)
        if resp is None:
            return None
        return ObjectMeta(key, int(resp["ContentLength"]), resp["LastModified"].timestamp())

    def now(self) -> float:
        """The ``Date`` of a ``HeadBucket`` answer (whole seconds)."""
        with self._errors("HEAD", "''"):
            return _server_now(self._client.head_bucket(Bucket=self.bucket))

    def sweep_incomplete(self, older_than: float) -> list[str]:
        """Abort the multipart uploads under the store's prefix initiated at least ``older_than``
        seconds ago by the server's clock (the bucket bills for their parts), whoever started them."""
        removed: list[str] = []
        args = {"Bucket": self.bucket, "Prefix": self._key_prefix}
        skip = len(self._key_prefix)
        while True:
            with self._errors("LIST multipart uploads", "''"):
                page = self._client.list_multipart_uploads(**args)
            now = _server_now(page)
            for upload in page.get("Uploads", ()):
                if now - upload["Initiated"].timestamp() < older_than:
                    continue
                key, upload_id = upload["Key"], upload["UploadId"]
                with self._errors("DELETE (abort multipart)", key[skip:]):
                    try:
                        self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
                    except ClientError as exc:
                        if _code_status(exc)[0] != "NoSuchUpload" and _code_status(exc)[1] != 404:
                            raise
                        continue  # aborted or completed meanwhile
                removed.append(f"{key[skip:]} ({upload_id})")
            if not page.get("IsTruncated"):
                return removed
            args = {**args, "KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def touch(self, key: str) -> None:
        """Copy the object onto itself (new LastModified, no data through this client)."""
        obj = self._obj(key)
        with self._errors("COPY", key):
            self._client.copy_object(
                CopySource={"Bucket": obj["Bucket"], "Key": obj["Key"]}, MetadataDirective="REPLACE", **obj
            )

    def delete(self, key: str) -> None:
        obj = self._obj(key)
        with self._errors("DELETE", key):
            try:
                self._client.delete_object(**obj)
            except ClientError as exc:
                if _code_status(exc)[1] != 404:
                    raise

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._client.close()

    # -- large objects -----------------------------------------------------------------------

    def _put_conditions(self, mode: str) -> tuple[dict[str, str], type[StoreError] | None]:
        if mode == "create":
            return {"IfNoneMatch": "*"}, AlreadyExistsError
        if mode == "overwrite":
            return {}, None
        raise UsageError(f"put mode must be 'create' or 'overwrite', got {mode!r}")

    def _put_multipart(self, key: str, size: int, read_part: ReadPart, mode: str) -> None:
        """Multipart upload; ``read_part(offset, length)`` runs on worker threads."""
        conditions, conflict = self._put_conditions(mode)
        if mode == "create" and self.head(key) is not None:  # skip a doomed upload early
            raise self._error("PUT", key, "object exists", cls=AlreadyExistsError)
        obj = self._obj(key)
        part_size = max(self.options.part_size, -(-size // MAX_PARTS))
        with self._errors("PUT (start multipart)", key):
            upload = self._client.create_multipart_upload(**obj, ChecksumAlgorithm="CRC32")
        obj["UploadId"] = upload["UploadId"]
        try:
            jobs = (
                self._part_job(key, obj, number, offset, min(part_size, size - offset), read_part)
                for number, offset in enumerate(range(0, size, part_size), start=1)
            )
            parts = self._run_bounded(jobs)
            with self._errors("PUT (complete multipart)", key, conflict):
                self._client.complete_multipart_upload(**obj, MultipartUpload={"Parts": parts}, **conditions)
        except BaseException:
            try:
                self._client.abort_multipart_upload(**obj)
            except (BotoCoreError, ClientError):
                pass  # best effort; a bucket lifecycle rule reaps what is left
            raise

    def _part_job(self, key, obj, number, offset, length, read_part) -> Callable[[], dict]:
        def upload() -> dict:
            body = read_part(offset, length)
            with self._errors(f"PUT (part {number})", key):
                resp = self._client.upload_part(**obj, PartNumber=number, Body=body, ChecksumAlgorithm="CRC32")
                part = {"PartNumber": number, "ETag": resp["ETag"]}
            part.update({k: resp[k] for k in _CHECKSUM_FIELDS if k in resp})
            return part

        return upload

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.options.max_concurrency, thread_name_prefix="s3store")
            return self._pool

    def _run_bounded(self, jobs: Iterable[Callable[[], T]]) -> list[T]:
        """Run ``jobs`` on the shared pool, at most ``max_parts_in_flight`` at a time.

        Jobs are created lazily, so buffers exist only for running jobs. After the first failure
        no new job starts; the first failure (in job order) is raised once all have finished.
        """
        slots = threading.BoundedSemaphore(self.options.max_parts_in_flight)
        failed = threading.Event()

        def run(job: Callable[[], T]) -> T:
            try:
                return job()
            except BaseException:
                failed.set()
                raise
            finally:
                slots.release()

        futures = []
        try:
            for job in jobs:
                slots.acquire()
                if failed.is_set():
                    slots.release()
                    break
                futures.append(self._executor().submit(run, job))
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        finally:
            wait(futures)
        return [future.result() for future in futures]
