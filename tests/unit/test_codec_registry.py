"""The codec registry: the format's ids (docs/FORMAT.md "Payloads"), one interface, and a codec
added by one module."""

from __future__ import annotations

import numpy as np
import pytest

from weightsync.codec import CodecConfig, decode_tensor, encode_tensor, registry
from weightsync.codec.abc import Codec
from weightsync.codec.payload import _encode_payload
from weightsync.errors import FormatError


def test_the_ids_are_the_formats():
    ids = {"full": 1, "sparse": 2, "dense": 3, "ac": 4, "ans": 5}
    for name, cid in ids.items():
        codec = registry.get(name)
        assert isinstance(codec, Codec) and (codec.name, codec.id) == (name, cid)
        assert registry.get_by_id(cid) is codec
    with pytest.raises(KeyError):
        registry.get("same")  # no payload, no codec
    with pytest.raises(KeyError):
        registry.get_by_id(6)


def test_the_manifest_reader_accepts_every_built_in_codec():
    """A codec the registry has but manifests may not name could never be read back."""
    from weightsync.format.manifest import SEGMENT_CODECS

    assert set(SEGMENT_CODECS) == {"same"} | {registry.get(n).name for n in SEGMENT_CODECS if n != "same"}
    assert {c.name for c in registry._BY_NAME.values() if c.id < 200} == set(SEGMENT_CODECS) - {"same"}


def test_supports():
    for name in ("ac", "ans"):
        assert registry.get(name).supports("BF16") and not registry.get(name).supports("F64")
    assert all(registry.get(n).supports("F64") for n in ("full", "sparse", "dense"))


def test_an_id_or_a_name_is_registered_once():
    for cid, name in ((2, "other"), (200, "sparse"), (0, "zero"), (1, "same")):
        cls = type("Clash", (registry.get("full").__class__,), {"id": cid, "name": name})
        with pytest.raises(ValueError):
            registry.register(cls)
    assert registry.get_by_id(2).name == "sparse" and registry.get("full").id == 1


def test_a_payload_for_a_dtype_the_codec_does_not_take_is_refused():
    old = np.zeros(64, np.uint8)
    new = old.copy()
    new[::8] = 1
    payload, _, _ = _encode_payload(registry.get("ac"), "U32", old.view("<u8"), new.view("<u8"), CodecConfig())
    with pytest.raises(FormatError, match="does not take F64"):
        decode_tensor("F64", "ac", payload, old, new.size)


def test_a_codec_is_added_by_one_class():
    class Raw(Codec):  # what a new module holds
        id, name = 200, "raw-test"

        def encode(self, dtype, old, new, config):
            return (new - old).tobytes(), int(np.count_nonzero(new != old))

        def decode(self, dtype, block, old, out, what, hasher=None):
            np.add(old, np.frombuffer(block, out.dtype), out=out)
            if hasher is not None:
                hasher.update(out)

    registry.register(Raw)
    try:
        rng = np.random.default_rng(0)
        old = rng.integers(0, 256, 4000, dtype=np.uint8)
        new = old.copy()
        new[::7] += 3
        payload, changed, _ = _encode_payload(
            registry.get("raw-test"), "BF16", old.view("<u2"), new.view("<u2"), CodecConfig(block_bytes=512)
        )
        assert changed == np.count_nonzero(old.view("<u2") != new.view("<u2"))
        assert np.array_equal(decode_tensor("BF16", "raw-test", payload, old, new.size), new)
        with pytest.raises(FormatError, match="is not a 'ac' payload"):
            decode_tensor("BF16", "ac", payload, old, new.size)
            assert encode_tensor("BF16", new, old).codec in ("ans", "dense")  # encoding with it is the payload's choice
    finally:
        del registry._BY_ID[200], registry._BY_NAME["raw-test"]
