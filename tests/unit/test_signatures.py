"""Signed versions (docs/FORMAT.md section 7) on a memory store: what a reader with trusted keys
refuses, what it accepts, the stored document's form, key files, and a fixed test vector that pins
the signed message.

The attacker here can write the whole store but holds no trusted private key: they rewrite
manifests and recompute their checksums, move and edit signatures, delete them, or sign with a key
of their own."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.rsa import generate_private_key

from weightsync.errors import FormatError, SignatureError, UsageError, VersionError
from weightsync.format.keys import signature_key, version_key
from weightsync.format.manifest import Manifest, manifest_from_json, manifest_to_json
from weightsync.format.signatures import (
    MAX_DOCUMENT_BYTES,
    Signature,
    Signatures,
    key_id,
    signatures_from_json,
    signatures_to_json,
    signed_message,
)
from weightsync.store import MemoryStore
from weightsync.store.repo import Repo, open_repo
from weightsync.store.signing import (
    Keyring,
    SigningKey,
    parse_public_keys,
    parse_signing_key,
    read_public_keys,
    read_signing_key,
    write_key_pair,
)

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden" / "store"
TEST_SEED = bytes(range(32))  # a public test key: never trust it anywhere


def _manifest(version: int, parent: int | None, stats: int = 0) -> Manifest:
    keyframe = parent is None
    return Manifest(version, parent, keyframe, 0 if keyframe else 1, (), (), stats={"changed": stats})


@pytest.fixture
def keys():
    return SigningKey.generate(), SigningKey.generate()


@pytest.fixture
def signed(keys):
    """A store with versions 0..2, each signed by the first key: (store, signing key)."""
    store = MemoryStore()
    writer = Repo(store)
    writer.init()
    for v in range(3):
        writer.commit(_manifest(v, None if v == 0 else v - 1), writer.head()[1], keys[0])
    return store, keys[0]


def reader(store, *keys) -> Repo:
    return Repo(store, trusted_keys=Keyring(tuple(k.public() for k in keys)))


def refusal(repo: Repo, version: int) -> str:
    with pytest.raises(SignatureError) as err:
        repo.manifest(version)
    assert err.value.version == version and "\n" not in str(err.value)
    return err.value.reason


def test_signed_versions_verify_and_unsigned_stores_need_no_keys(signed):
    store, key = signed
    repo = reader(store, key)
    assert [repo.manifest(v).version for v in range(3)] == [0, 1, 2]
    assert [m.version for m in repo.chain(2)] == [0, 1, 2]
    plain = MemoryStore()
    Repo(plain).init()
    Repo(plain).commit(_manifest(0, None), None)  # no key: no signature written, none read
    assert Repo(plain).manifest(0).version == 0
    assert list(plain.list("signatures/")) == []
    assert "not signed" in refusal(reader(plain, key), 0)


def test_a_rewritten_manifest_with_recomputed_checksums_is_refused(signed):
    store, key = signed
    forged = replace(manifest_from_json(store.get(version_key(2))), stats={"changed": 666})
    store.put(version_key(2), manifest_to_json(forged))  # a valid manifest: its checksum recomputed
    assert manifest_from_json(store.get(version_key(2))).stats == {"changed": 666}
    assert Repo(store).manifest(2).stats == {"changed": 666}  # a reader without keys takes it
    assert "not the one signed" in refusal(reader(store, key), 2)
    doc = json.loads(store.get(signature_key(2)))
    doc["manifest_sha256"] = hashlib.sha256(store.get(version_key(2))).hexdigest()
    store.put(signature_key(2), json.dumps(doc).encode())  # the digest updated too: the signature fails
    assert "does not verify" in refusal(reader(store, key), 2)


def test_a_signature_moved_to_another_version_is_refused(signed):
    store, key = signed
    Repo(store).commit(_manifest(3, 2, stats=1), Repo(store).head()[1])  # the attacker's unsigned version
    repo = reader(store, key)
    assert "not signed" in refusal(repo, 3)
    store.put(signature_key(3), store.get(signature_key(2)))
    assert "those of version 2" in refusal(repo, 3)
    doc = json.loads(store.get(signature_key(2)))
    doc["version"] = 3
    doc["manifest_sha256"] = hashlib.sha256(store.get(version_key(3))).hexdigest()
    store.put(signature_key(3), json.dumps(doc).encode())
    assert "does not verify" in refusal(repo, 3)
    store.put(version_key(3), store.get(version_key(2)))  # version 2's signed manifest replayed as 3
    store.put(signature_key(3), store.get(signature_key(2)))
    assert "those of version 2" in refusal(repo, 3)
    store.put(signature_key(3), json.dumps({**json.loads(store.get(signature_key(2))), "version": 3}).encode())
    assert "does not verify" in refusal(repo, 3)  # the message names the version


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d[: len(d) // 2],  # truncated document
        lambda d: b"",
        lambda d: b"null",
        lambda d: b"[" * 100000 + b"]" * 100000,
        lambda d: d.replace(b'"ed25519"', b'"ed448"'),
        lambda d: json.dumps({**json.loads(d), "signatures": []}).encode(),
        lambda d: json.dumps({**json.loads(d), "signatures": json.loads(d)["signatures"] * 17}).encode(),
        lambda d: json.dumps({**json.loads(d), "format_version": 2}).encode(),
        lambda d: json.dumps({**json.loads(d), "version": -1}).encode(),
        lambda d: json.dumps({**json.loads(d), "version": True}).encode(),
        lambda d: b" " * (MAX_DOCUMENT_BYTES + 1),
    ],
)
def test_malformed_signatures_are_refused(signed, damage):
    store, key = signed
    store.put(signature_key(1), damage(store.get(signature_key(1))))
    assert refusal(reader(store, key), 1).startswith(("malformed signatures", "its signatures are those"))


@pytest.mark.parametrize(
    "signature",
    [
        lambda s: s[:-4],  # truncated: 61 bytes
        lambda s: s + "AAAA",  # 67 bytes
        lambda s: s[:-2] + "!=",  # not base64
        lambda s: "",
        lambda s: 12,
        lambda s: base64.b64encode(bytes(64)).decode(),  # the right length, zeros
        lambda s: base64.b64encode(bytes([base64.b64decode(s)[0] ^ 1]) + base64.b64decode(s)[1:]).decode(),
    ],
)
def test_truncated_and_altered_signature_bytes_are_refused(signed, signature):
    store, key = signed
    doc = json.loads(store.get(signature_key(1)))
    doc["signatures"][0]["signature"] = signature(doc["signatures"][0]["signature"])
    store.put(signature_key(1), json.dumps(doc).encode())
    reason = refusal(reader(store, key), 1)
    assert reason.startswith("malformed signatures") or "does not verify" in reason


def test_an_unknown_key_is_refused_and_named(signed, keys):
    store, key = signed
    mallory = SigningKey.generate()
    store.put(signature_key(1), mallory.sign(1, store.get(version_key(1))))  # a well-formed signature of another key
    reason = refusal(reader(store, key), 1)
    assert f"unknown key {mallory.key_id} only" in reason and key.key_id in reason
    assert reader(store, mallory).manifest(1).version == 1  # its own key's reader would take it
    doc = json.loads(store.get(signature_key(1)))
    doc["signatures"][0]["key_id"] = key.key_id  # claims the trusted key's id
    store.put(signature_key(1), json.dumps(doc).encode())
    assert f"key {key.key_id} does not verify" in refusal(reader(store, key), 1)


def test_rotation_trusts_both_keys_then_the_new_one(signed, keys):
    store, old = signed
    new = keys[1]
    Repo(store).commit(_manifest(3, 2), Repo(store).head()[1], new)  # the publisher moved to the new key
    both = reader(store, old, new)
    assert [both.manifest(v).version for v in range(4)] == [0, 1, 2, 3]
    assert "unknown key" in refusal(reader(store, new), 2)  # old versions need the old key
    assert reader(store, new).manifest(3).version == 3
    assert "unknown key" in refusal(reader(store, old), 3)
    two = json.loads(store.get(signature_key(2)))  # a document may hold several signatures
    two["signatures"] += json.loads(new.sign(2, store.get(version_key(2))))["signatures"]
    store.put(signature_key(2), json.dumps(two).encode())
    assert reader(store, new).manifest(2).version == 2 and reader(store, old).manifest(2).version == 2


def test_a_refused_manifest_is_never_cached_nor_chained(signed):
    store, key = signed
    store.delete(signature_key(1))
    repo = reader(store, key)
    assert "not signed" in refusal(repo, 1)
    with pytest.raises(SignatureError):
        repo.chain(2)  # a delta on a refused parent
    assert "not signed" in refusal(repo, 1)  # checked again, not cached
    Repo(store).commit(Manifest(3, 2, True, 0, (), ()), Repo(store).head()[1], key)  # a signed keyframe after it
    assert [m.version for m in repo.chain(3, back_to=0)] == [3]  # the walk back stops at the refused one
    assert [m.version for m in repo.chain(3, back_to=2)] == [2, 3]


def test_the_committer_signs_the_manifest_it_finds_when_it_lost_its_answer(keys):
    """A retried commit finds its own manifest stored (same files, same parent, other bytes): the
    signature is made of the stored bytes, which is what readers check."""
    store = MemoryStore()
    repo = Repo(store)
    repo.init()
    first = _manifest(0, None, stats=1)
    store.put(version_key(0), manifest_to_json(first), mode="create")  # the earlier attempt's manifest, no head
    repo.commit(_manifest(0, None, stats=2), None, keys[0])
    assert reader(store, keys[0]).manifest(0).stats == {"changed": 1}


def test_a_commit_the_head_overtook_removes_its_manifest_and_signature(keys):
    store = MemoryStore()
    repo = Repo(store)
    repo.init()
    repo.commit(_manifest(0, None), None, keys[0])
    stale = repo.head()[1]
    repo.commit(_manifest(2, 0), stale, keys[0])
    with pytest.raises(VersionError):
        repo.commit(_manifest(1, 0), stale, keys[0])
    assert store.head(version_key(1)) is None and store.head(signature_key(1)) is None


def test_open_repo_takes_key_files_and_refuses_an_empty_list(tmp_path, signed):
    store, key = signed
    (tmp_path / "k.pub").write_text(key.public().openssh() + "\n")
    repo = open_repo(store, trusted_keys=[tmp_path / "k.pub"])
    assert repo.trusted_keys.ids == (key.key_id,) and repo.manifest(2).version == 2
    assert open_repo(repo) is repo and open_repo(repo, trusted_keys=repo.trusted_keys) is repo
    other = open_repo(repo, trusted_keys=[SigningKey.generate()])  # reopened: a cache of its own
    assert "unknown key" in refusal(other, 2)
    with pytest.raises(UsageError, match="trusts nothing"):
        open_repo(store, trusted_keys=[])


# --- the stored document and the signed message -------------------------------------------------------
def test_document_round_trip_and_key_ids():
    sig = Signature("0123456789abcdef", bytes(range(64)))
    doc = Signatures(7, "ab" * 32, (sig,))
    data = signatures_to_json(doc)
    assert signatures_from_json(data) == doc
    assert json.loads(data)["format"] == "weightsync.signatures"
    assert key_id(bytes(32)) == hashlib.sha256(bytes(32)).hexdigest()[:16]
    with pytest.raises(FormatError):
        signed_message(-1, bytes(32))
    with pytest.raises(FormatError):
        signed_message(0, b"a manifest, not its digest")


def test_fixed_vector_pins_the_signed_message_and_the_signature():
    """Ed25519 is deterministic: this test key signing the golden store's version 0 gives these bytes.
    A change of the message layout (domain, version encoding, digest) fails here."""
    manifest = (GOLDEN / "versions" / "00000000000000000000.json").read_bytes()
    key = SigningKey.of(Ed25519PrivateKey.from_private_bytes(TEST_SEED))
    message = signed_message(0, hashlib.sha256(manifest).digest())
    assert message[:23] == b"weightsync-manifest-v1\x00" and message[23:31] == bytes(8) and len(message) == 63
    assert message[31:] == hashlib.sha256(manifest).digest()
    assert key.key_id == "56475aa75463474c"
    doc = json.loads(key.sign(0, manifest))
    assert doc["signatures"][0]["signature"] == (
        "lWLjNXj2i1YnU87P+fyuCjao1gBsmNl1BlN83sur0KMPTxJ9cWpP7p5F0XTz7iaajyhKDzOzLQAwm7RVNMbODA=="
    )
    Keyring((key.public(),)).verify("golden v0", 0, manifest, key.sign(0, manifest))
    assert signed_message(1, bytes(32))[23:31] == (1).to_bytes(8, "little")


# --- key files ----------------------------------------------------------------------------------------
def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_overwrites(tmp_path):
    key = write_key_pair(tmp_path / "k")
    assert (os.stat(tmp_path / "k").st_mode & 0o777) == 0o600
    assert read_signing_key(tmp_path / "k").key_id == key.key_id
    (pub,) = read_public_keys(tmp_path / "k.pub")
    assert pub.key_id == key.key_id and (tmp_path / "k.pub").read_text().endswith(f"weightsync:{key.key_id}\n")
    before = (tmp_path / "k").read_bytes()
    for existing in ("k", "k.pub"):
        with pytest.raises(UsageError, match="exists"):
            write_key_pair(tmp_path / existing.removesuffix(".pub"))
    assert (tmp_path / "k").read_bytes() == before
    (tmp_path / "only.pub").write_text("x")
    with pytest.raises(UsageError, match="exists"):
        write_key_pair(tmp_path / "only")
    assert not (tmp_path / "only").exists()


def test_key_files_in_the_standard_formats(tmp_path):
    private = Ed25519PrivateKey.generate()
    want = SigningKey.of(private).key_id
    nothing = serialization.NoEncryption()
    pkcs8 = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, nothing)
    openssh = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, nothing)
    assert parse_signing_key(pkcs8, "k").key_id == want == parse_signing_key(openssh, "k").key_id
    pem_pub = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    ssh_pub = private.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    other = SigningKey.generate().public().openssh().encode()
    keys = parse_public_keys(b"# run 1\n\n" + pem_pub + ssh_pub + b" a comment\n" + other + b"\n", "f")
    assert [k.key_id for k in keys][:2] == [want, want] and len(keys) == 3


def test_ssh_keygen_keys_work(tmp_path):
    if subprocess.run(["which", "ssh-keygen"], capture_output=True).returncode:
        pytest.skip("no ssh-keygen")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", tmp_path / "id"], check=True)
    key = read_signing_key(tmp_path / "id")
    assert [k.key_id for k in read_public_keys(tmp_path / "id.pub")] == [key.key_id]


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "not a PEM or OpenSSH private key"),
        (b"ssh-ed25519 AAAA x", "holds a public key"),
        (b"-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n", "not a usable private key"),
        (
            Ed25519PrivateKey.generate().private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.BestAvailableEncryption(b"pw"),
            ),
            "encrypted",
        ),
        (
            generate_private_key(65537, 2048).private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
            "a RSA key",
        ),
    ],
    ids=["empty", "public", "bad-pem", "encrypted", "rsa"],  # not the generated keys: xdist's workers must agree
)
def test_bad_signing_keys_are_refused_with_one_line(data, message):
    with pytest.raises(UsageError, match=message) as err:
        parse_signing_key(data, "key.pem")
    assert "\n" not in str(err.value) and "key.pem" in str(err.value)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "no public key"),
        (b"# only a comment\n", "no public key"),
        (SigningKey.generate().pem(), "holds a private key"),
        (b"ssh-ed25519 AAAA", "not an Ed25519 public key"),
        (b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQC x", "not an Ed25519 public key"),
        (b"garbage", "not an Ed25519 public key"),
    ],
    ids=["empty", "comment", "private", "short-ssh", "ssh-rsa", "garbage"],
)
def test_bad_public_key_files_are_refused_with_one_line(data, message):
    with pytest.raises(UsageError, match=message) as err:
        parse_public_keys(data, "trusted.pub")
    assert "\n" not in str(err.value) and "trusted.pub" in str(err.value)


def test_unreadable_key_files(tmp_path):
    with pytest.raises(UsageError, match="cannot read signing key"):
        read_signing_key(tmp_path / "missing")
    with pytest.raises(UsageError, match="cannot read public key file"):
        read_public_keys(tmp_path)


# --- the flags and variables that configure keys ---------------------------------------------------------
def _parse(argv: list, env: dict[str, str]):
    from weightsync import cli

    return cli.build_parser(env).parse_args([str(a) for a in argv])


def test_daemons_take_their_keys_from_their_variables(tmp_path):
    from weightsync.service.flags import publisher_config, subscriber_config

    key = write_key_pair(tmp_path / "k")
    other = write_key_pair(tmp_path / "o")
    env = {"WEIGHTSYNC_SIGNING_KEY": str(tmp_path / "k"), "WEIGHTSYNC_STORE": str(tmp_path / "s")}
    cfg = publisher_config(_parse(["publisher", "--watch", tmp_path], env), env)
    assert cfg.publish.signing_key.key_id == key.key_id and "SigningKey" not in repr(cfg)
    env = {"WEIGHTSYNC_TRUSTED_KEY": f"{tmp_path / 'k.pub'}:{tmp_path / 'o.pub'}", "WEIGHTSYNC_STORE": "s"}
    cfg = subscriber_config(_parse(["subscriber", "--target", tmp_path / "t"], env), env)
    assert cfg.store.trusted_keys.ids == (key.key_id, other.key_id)
    args = _parse(["subscriber", "--target", tmp_path / "t", "--trusted-key", tmp_path / "o.pub"], env)
    assert subscriber_config(args, env).store.trusted_keys.ids == (other.key_id,)  # the flag wins
    assert subscriber_config(_parse(["subscriber", "--store", "s", "--target", "t"], {}), {}).store.trusted_keys is None


@pytest.mark.parametrize(
    "command, var, value, message",
    [
        ("subscriber", "WEIGHTSYNC_TRUSTED_KEY", "", "WEIGHTSYNC_TRUSTED_KEY is set but names no key file"),
        ("subscriber", "WEIGHTSYNC_TRUSTED_KEY", " : ", "WEIGHTSYNC_TRUSTED_KEY is set but names no key file"),
        ("subscriber", "WEIGHTSYNC_TRUSTED_KEY", "/nonexistent.pub", "WEIGHTSYNC_TRUSTED_KEY: cannot read"),
        ("publisher", "WEIGHTSYNC_SIGNING_KEY", "", "WEIGHTSYNC_SIGNING_KEY is empty: refusing to publish unsigned"),
        ("publisher", "WEIGHTSYNC_SIGNING_KEY", "/nonexistent", "WEIGHTSYNC_SIGNING_KEY: cannot read signing key"),
    ],
)
def test_a_key_variable_given_but_unusable_stops_the_daemon(tmp_path, command, var, value, message):
    """A missing Secret must not turn signing or checking off."""
    from weightsync.service.flags import publisher_config, subscriber_config

    env = {var: value, "WEIGHTSYNC_STORE": "s"}
    argv = [command, "--watch", tmp_path] if command == "publisher" else [command, "--target", tmp_path]
    build = publisher_config if command == "publisher" else subscriber_config
    with pytest.raises(UsageError, match=message):
        build(_parse(argv, env), env)


def test_the_mirror_checks_its_source_only(tmp_path):
    from weightsync import cli

    key = write_key_pair(tmp_path / "k")
    args = _parse(["mirror", "--from", "a", "--to", "b", "--trusted-key", tmp_path / "k.pub"], {})
    assert cli._side_store(args, "from").trusted_keys.ids == (key.key_id,)
    assert cli._side_store(args, "to").trusted_keys is None
