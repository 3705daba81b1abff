"""S3Store on a real SeaweedFS: what the shared contract cannot show.

Races between processes, credentials, error mapping, incomplete uploads, restarts. The contract
itself (tests/unit/test_store_contract.py) also runs against SeaweedFS.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from seaweed import free_port

from weightsync.errors import NotFoundError, StoreError, UsageError
from weightsync.store import open_store
from weightsync.store.retry import RetryingStore, RetryPolicy
from weightsync.store.s3 import S3Options, S3Store

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]

# A racer: reads "key tag payload" lines, tries put_if_match, answers "win" or "lost".
RACER = textwrap.dedent(
    """
    import sys
    from weightsync.errors import PreconditionFailedError
    from weightsync.store import open_store

    store = open_store(sys.argv[1])
    store.head("warm-up")  # open the connection before the first round
    print("ready", flush=True)
    for line in sys.stdin:
        key, tag, payload = line.split()
        try:
            store.put_if_match(key, payload.encode(), None if tag == "-" else tag)
            print("win", flush=True)
        except PreconditionFailedError:
            print("lost", flush=True)
    """
)


def _one_line(err: Exception) -> str:
    text = str(err)
    assert "\n" not in text and text.startswith("s3://")
    return text


@pytest.mark.integration
def test_processes_racing_put_if_match_have_one_winner(s3_url):
    store = open_store(s3_url)
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, s3_url],
            cwd=REPO,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    try:
        assert [p.stdout.readline().strip() for p in racers] == ["ready", "ready"]
        for round_ in range(4):
            key = f"head-{round_ // 2}"
            if round_ % 2:  # compare-and-swap on the current tag
                tag = store.get_with_etag(key)[1]
            else:  # create-if-absent
                tag = "-"
            for i, p in enumerate(racers):
                p.stdin.write(f"{key} {tag} r{round_}-p{i}\n")
                p.stdin.flush()
            answers = [p.stdout.readline().strip() for p in racers]
            assert sorted(answers) == ["lost", "win"], answers
            assert store.get(key) == f"r{round_}-p{answers.index('win')}".encode()
    finally:
        for p in racers:
            p.stdin.close()
            p.wait(timeout=30)
    assert [p.returncode for p in racers] == [0, 0]


@pytest.mark.integration
@pytest.mark.parametrize(
    "variable, value, code",
    [
        ("AWS_SECRET_ACCESS_KEY", "not-the-secret", "SignatureDoesNotMatch (403)"),
        ("AWS_ACCESS_KEY_ID", "nobody", "InvalidAccessKeyId (403)"),
    ],
)
def test_wrong_credentials_fail_clearly(s3_url, monkeypatch, variable, value, code):
    open_store(s3_url).put("secret", b"x")
    monkeypatch.setenv(variable, value)
    store = open_store(s3_url)
    for op, call in [
        ("PUT", lambda: store.put("secret", b"y")),
        ("GET", lambda: store.get("secret")),
    ]:
        with pytest.raises(StoreError) as info:
            call()
        err = info.value
        assert type(err) is StoreError and err.key == "secret" and err.retryable is False
        assert _one_line(err) == f"{store.url}/secret: {op}: {code}"
        assert err.__cause__ is not None
    with pytest.raises(StoreError, match=r"/secret: HEAD: Forbidden \(403\)"):
        store.head("secret")


@pytest.mark.integration
def test_missing_bucket_is_not_a_missing_key(s3_env):
    store = open_store("s3://no-such-bucket/p")
    with pytest.raises(StoreError) as info:
        store.get("k")
    assert not isinstance(info.value, NotFoundError)
    assert _one_line(info.value) == "s3://no-such-bucket/p/k: GET: NoSuchBucket (404)"
    with pytest.raises(StoreError, match="^s3://no-such-bucket/p: LIST: NoSuchBucket"):
        list(store.list())


@pytest.mark.integration
def test_not_found_message(s3_url):
    with pytest.raises(NotFoundError) as info:
        open_store(s3_url).get("chunks/ab/ab12")
    assert _one_line(info.value) == f"{s3_url}/chunks/ab/ab12: GET: NoSuchKey (404)"


@pytest.fixture
def fake_credentials(monkeypatch, tmp_path):
    """Credentials that sign requests, for tests that never reach a server."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "fake")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)


def test_unreachable_endpoint_is_retryable(fake_credentials):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    store = S3Store.from_url("s3://bucket/p", endpoint_url=endpoint, region="us-east-1", connect_timeout=1)
    sent = []
    store._client.meta.events.register("before-send.s3", lambda **kw: sent.append(1))
    with pytest.raises(StoreError) as info:
        store.head("k")
    assert info.value.retryable is True
    assert len(sent) == 1  # botocore itself does not retry
    assert "/p/k: HEAD: EndpointConnectionError: Could not connect" in _one_line(info.value)
    retries = []
    wrapped = RetryingStore(store, RetryPolicy(attempts=3, base_delay=0.0), on_retry=lambda *a: retries.append(a))
    with pytest.raises(StoreError, match="gave up after 3 attempts") as info:
        wrapped.get("k")
    assert info.value.__cause__.retryable is True and len(retries) == 2


@pytest.mark.integration
def test_endpoint_option_and_localhost_endpoint(s3_env, s3_url, monkeypatch):
    port = s3_env.endpoint.rsplit(":", 1)[1]
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    with open_store(s3_url, endpoint_url=s3_env.endpoint) as store:
        store.put("k", b"explicit")
    # An endpoint boto3 finds itself must get path-style addressing (bucket.localhost fails).
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://localhost:{port}")
    with open_store(s3_url) as store:
        assert store.get("k") == b"explicit"


@pytest.mark.integration
def test_sweep_incomplete_aborts_old_multipart_uploads_under_the_prefix(s3_url, seaweed):
    """Uploads a killed writer (any client) left: aborted once old enough by the server's clock;
    those of another prefix are not ours."""
    bucket, prefix = s3_url[len("s3://") :].split("/", 1)
    client = seaweed.client()
    ours = client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/chunks/ab/ab12")["UploadId"]
    client.upload_part(Bucket=bucket, Key=f"{prefix}/chunks/ab/ab12", UploadId=ours, PartNumber=1, Body=b"x")
    theirs = client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}-other/k")["UploadId"]
    try:
        with open_store(s3_url) as store:
            store.put("chunks/ab/ab13", b"complete")
            assert store.sweep_incomplete(3600.0) == []  # young: maybe in flight
            time.sleep(1.1)
            assert store.sweep_incomplete(0.0) == [f"chunks/ab/ab12 ({ours})"]
            assert store.sweep_incomplete(0.0) == []
            assert list(store.list()) == ["chunks/ab/ab13"]
        uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", ())
        assert [u["UploadId"] for u in uploads] == [theirs]
    finally:
        client.abort_multipart_upload(Bucket=bucket, Key=f"{prefix}-other/k", UploadId=theirs)


def test_options_are_validated(fake_credentials):
    with pytest.raises(UsageError, match="unknown S3 store options"):
        S3Store.from_url("s3://bucket/p", endpoint="http://x")
    with pytest.raises(UsageError, match="part_size"):
        S3Options(part_size=MiB)
    with pytest.raises(UsageError, match="max_parts_in_flight"):
        S3Options(max_concurrency=4, max_parts_in_flight=8)
    for url in ["s3:///p", "s3://bucket/a/../b", "http://bucket/p"]:
        with pytest.raises(UsageError):
            S3Store.from_url(url)
    store = S3Store.from_url("s3://bucket/a/b/", endpoint_url="http://127.0.0.1:1", region="us-east-1")
    assert store.url == "s3://bucket/a/b" and store.options.max_concurrency == 64
    with pytest.raises(UsageError, match="put mode"):
        store.put("k", b"", mode="append")  # type: ignore[arg-type]


@pytest.mark.integration
@pytest.mark.slow
def test_objects_survive_a_server_restart(s3_url, s3_env):
    store = open_store(s3_url)
    store.put("durable", b"kept")
    s3_env.stop()
    with pytest.raises(StoreError) as info:
        store.get("durable")
    assert info.value.retryable is True
    s3_env.start()
    assert store.get("durable") == b"kept"
