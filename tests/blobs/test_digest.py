"""savepoint.blobs.digest: algorithms, digest shapes, the memo."""

from __future__ import annotations

import blake3
import pytest
import xxhash

from savepoint.blobs import FastMemo
from savepoint.blobs import digest as d
from savepoint.errors import IncompatibleCheckpointError


def test_algorithms_name_content() -> None:
    data = b"x" * (3 << 20)  # over the size where blake3's own threads are used
    assert d.digest_function("blake3")(data) == blake3.blake3(data).hexdigest()
    assert d.digest_function("blake3")(b"ab") == blake3.blake3(b"ab").hexdigest()
    assert d.digest_function("xxh3-128")(b"ab") == f"{xxhash.xxh3_128_intdigest(b'ab'):032x}"
    for name, n in d.ALGORITHMS.items():
        assert len(d.digest_function(name)(b"")) == n
        assert d.is_digest(name, d.digest_function(name)(b"q"))


@pytest.mark.parametrize("value", ["", "g" * 64, "A" * 64, "a" * 63, "a" * 65, None, 5, "../x"])
def test_is_digest_refuses(value: object) -> None:
    assert not d.is_digest("blake3", value)


def test_unknown_algorithm() -> None:
    with pytest.raises(IncompatibleCheckpointError, match="unknown blob digest"):
        d.digest_function("md5")
    with pytest.raises(IncompatibleCheckpointError):
        d.hex_length("sha1")
    assert not d.is_digest("sha1", "a" * 40)


def test_memo_is_bounded_and_keyed_per_instance() -> None:
    memo = FastMemo(capacity=2)
    keys = [memo.key(bytes([i]) * 10) for i in range(3)]
    for i, k in enumerate(keys):
        memo.add(k, (str(i), str(i)))
    assert memo.get(keys[0]) is None  # evicted
    assert memo.get(keys[2]) == ("2", "2")
    assert (memo.hits, memo.misses) == (1, 1)
    assert FastMemo().key(b"abc") != memo.key(b"abc")  # a random seed per memo
    memo.clear()
    assert memo.get(keys[2]) is None
