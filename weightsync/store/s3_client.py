"""Building the boto3/botocore S3 client of an :class:`~weightsync.store.s3.S3Store`, and its settings.

Credentials and the endpoint come only from botocore's standard chain (or ``endpoint_url``); this
module never reads the environment itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from urllib.parse import urlsplit

import botocore.session
from botocore.config import Config

from weightsync.errors import UsageError

MiB = 1 << 20
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PART_SIZE = 5 * 1024 * MiB


@dataclass(frozen=True)
class S3Options:
    """Connection and transfer settings of an :class:`S3Store`.

    Memory bound: a multipart upload holds at most ``max_parts_in_flight * part_size`` bytes of
    part buffers besides the caller's data (8 x 16 MiB = 128 MiB by default).
    ``max_concurrency`` bounds the store's connection pool and worker threads, shared by all
    transfers of this store.
    """

    endpoint_url: str | None = None
    region: str | None = None
    max_concurrency: int = 64
    multipart_threshold: int = 64 * MiB
    part_size: int = 16 * MiB
    max_parts_in_flight: int = 8
    connect_timeout: float = 10.0
    read_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise UsageError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not 1 <= self.max_parts_in_flight <= self.max_concurrency:
            raise UsageError(
                f"max_parts_in_flight must be in 1..max_concurrency ({self.max_concurrency}), "
                f"got {self.max_parts_in_flight}"
            )
        if not MIN_PART_SIZE <= self.part_size <= MAX_PART_SIZE:
            raise UsageError(f"part_size must be in 5 MiB..5 GiB, got {self.part_size}")
        if self.multipart_threshold < 1:
            raise UsageError(f"multipart_threshold must be >= 1, got {self.multipart_threshold}")
        if self.connect_timeout <= 0 or self.read_timeout <= 0:
            raise UsageError("connect_timeout and read_timeout must be > 0")


@functools.cache
def _shared_loader():
    """botocore's API-model loader, shared: parsing the S3 model anew costs ~0.15 s a client."""
    return botocore.session.get_session().get_component("data_loader")


def _make_client(options: S3Options):
    """An S3 client: s3v4, no botocore retries, pool sized for ``max_concurrency``.

    Each store gets a fresh botocore session (boto3's engine), so credentials and endpoint
    come from the standard chain at the time the store is opened.
    """
    session = botocore.session.get_session()
    session.register_component("data_loader", _shared_loader())

    def build(path_style: bool):
        config = Config(
            signature_version="s3v4",
            s3={"addressing_style": "path"} if path_style else {},
            max_pool_connections=options.max_concurrency,
            connect_timeout=options.connect_timeout,
            read_timeout=options.read_timeout,
            # One attempt: RetryingStore retries. (botocore's "max_attempts" counts retries, not
            # attempts: max_attempts=1 would still retry once, after a sleep.)
            retries={"total_max_attempts": 1, "mode": "standard"},
            tcp_keepalive=True,
        )
        return session.create_client("s3", endpoint_url=options.endpoint_url, region_name=options.region, config=config)

    client = build(path_style=options.endpoint_url is not None)
    host = urlsplit(client.meta.endpoint_url).hostname or ""
    if options.endpoint_url is None and not host.endswith(".amazonaws.com"):
        client.close()
        client = build(path_style=True)  # a custom endpoint that boto3 found (AWS_ENDPOINT_URL)
    return client
