"""The transfer wire format's pieces in one process: the chunk checksum (the Triton kernel, compiled or under
the interpreter, gives the pure-torch definition's bits; damage it must notice), the header seal, and how a
payload is cut into chunks."""

from __future__ import annotations

import struct

import pytest
import torch

from kvcache.distributed import wire
from kvcache.distributed.wire import Layout, checksum, checksum_reference

pytestmark = pytest.mark.timeout(120)

_M = 0xFFFFFFFF


def _python_checksum(data: bytes, chunk: int) -> list[int]:
    """The documented definition in plain Python ints (slow; small bodies only)."""

    def fmix32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & _M
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & _M
        return x ^ (x >> 16)

    def lowbias32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & _M
        x ^= x >> 15
        x = (x * 0x846CA68B) & _M
        return x ^ (x >> 16)

    sa, sb = (chunk * 0x85EBCA77 + 0x165667B1) & _M, (chunk * 0x27D4EB2F + 0x61C88647) & _M
    a = b = 0
    for i, (w,) in enumerate(struct.iter_unpack("<I", data)):
        a = (a + fmix32(w ^ ((i * 0x9E3779B1 + sa) & _M))) & _M
        b = (b + lowbias32((w + i * 0xC2B2AE3D + sb) & _M)) & _M
    return [v - (1 << 32) if v >= 1 << 31 else v for v in (a, b)]


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_checksum_is_the_documented_definition() -> None:
    """Known answers (they pin the wire format: a change here is a new protocol version) and the plain-Python
    definition."""
    body = torch.arange(256, dtype=torch.uint8)
    assert checksum_reference(body, 0).tolist() == [407902753, -135280229]
    assert checksum_reference(body, 5).tolist() == [-59887636, -962633625]
    assert checksum_reference(body, wire.HEADER_CHUNK).tolist() == [-227477093, 1218472262]
    for n, c in [(4, 0), (100, 3), (1028, 2**31 - 1), (4096, 12345)]:
        b = _bytes(n, n)
        assert checksum_reference(b, c).tolist() == _python_checksum(bytes(b.tolist()), c)


@pytest.mark.parametrize("nbytes", [4, 64, 4096 + 16, 20_004])
def test_kernel_gives_the_reference_bits(device: torch.device, nbytes: int) -> None:
    body = _bytes(nbytes, 1)
    for c in (0, 1, 7, -1, 2**31 - 1):
        got = checksum(body.to(device), c)
        assert got.dtype == torch.int32 and got.device.type == device.type
        assert torch.equal(got.cpu(), checksum_reference(body, c)), (nbytes, c)


@pytest.mark.slow
def test_kernel_gives_the_reference_bits_over_many_programs(device: torch.device) -> None:
    """Past 1024 programs of 1024 words each program sums several tiles."""
    body = _bytes((1 << 22) + 4096 + 12, 2)
    assert torch.equal(checksum(body.to(device), 3).cpu(), checksum_reference(body, 3))


def test_kernel_notices_changed_bytes(device: torch.device) -> None:
    body = _bytes(4096, 3)
    ref = checksum(body.to(device), 2)
    for pos in (0, 1, 2047, 4095):
        damaged = body.clone()
        damaged[pos] ^= 0x01
        assert not torch.equal(checksum(damaged.to(device), 2), ref)


def test_every_changed_byte_is_noticed() -> None:
    """Each byte of a body changed by each of 3 patterns (one bit, the top bit, all bits): both lanes change
    (a change inside one 4-byte word always changes both sums: each lane is a bijection of the word)."""
    body = _bytes(512, 4)
    ref = checksum_reference(body, 0)
    for pos in range(body.numel()):
        for flip in (0x01, 0x80, 0xFF):
            damaged = body.clone()
            damaged[pos] ^= flip
            got = checksum_reference(damaged, 0)
            assert (got != ref).all(), (pos, flip)


def test_moved_and_repeated_data_is_noticed() -> None:
    body = _bytes(1024, 5)
    ref = checksum_reference(body, 1)
    words = body.view(torch.int32)
    swapped = words.clone()
    swapped[[3, 200]] = swapped[[200, 3]]
    halves = torch.cat([body[512:], body[:512]])
    assert not torch.equal(checksum_reference(swapped.view(torch.uint8), 1), ref)
    assert not torch.equal(checksum_reference(halves, 1), ref)
    assert not torch.equal(checksum_reference(body, 2), ref)  # the same body at another chunk's index
    zeros, longer = torch.zeros(64, dtype=torch.uint8), torch.zeros(128, dtype=torch.uint8)
    assert not torch.equal(checksum_reference(zeros, 0), checksum_reference(longer, 0))
    assert not torch.equal(checksum_reference(zeros, 0), torch.zeros(2, dtype=torch.int32))


def test_checksum_arguments() -> None:
    with pytest.raises(TypeError, match="body: expected a torch.Tensor"):
        checksum(b"1234", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="body: expected a contiguous 1-d uint8 tensor"):
        checksum(torch.zeros(4, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="body: expected a contiguous 1-d uint8 tensor"):
        checksum(torch.zeros(2, 8, dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match="whole int32 words"):
        checksum(torch.zeros(6, dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match="whole int32 words"):
        checksum(torch.zeros(12, dtype=torch.uint8)[2:10], 0)
    with pytest.raises(TypeError, match="chunk: expected an int"):
        checksum(torch.zeros(8, dtype=torch.uint8), True)  # type: ignore[arg-type]
    assert checksum(torch.zeros(0, dtype=torch.uint8), 0).tolist() == [0, 0]


def test_header_seal() -> None:
    h = wire.new_header(wire.KIND_BLOCKS)
    h[wire.F_COUNT], h[wire.F_NBYTES] = 12, 1 << 40
    sealed = wire.seal(h)
    assert wire.sealed(sealed) and sealed[:wire.F_SEAL_A] == h[:wire.F_SEAL_A]
    for field in (wire.F_MAGIC, wire.F_COUNT, wire.F_NBYTES, wire.F_SEAL_B):
        bad = list(sealed)
        bad[field] ^= 1 << 33 if field == wire.F_NBYTES else 1
        assert not wire.sealed(bad), field
    assert not wire.sealed(sealed[:-1])


def test_layout_cuts_rows_into_chunks() -> None:
    lay = Layout.build(prefix=8, parts=(100, 24), rows=10, chunk_bytes=300)
    assert (lay.chunk_rows, lay.chunks) == (2, 5)
    assert [lay.rows_of(c) for c in range(5)] == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    # chunk 0: prefix 8 bytes (padded to 16), 2 x 100 data bytes (216 -> 224), 2 x 24 params bytes
    assert lay.sections(0) == [(0, 8), (16, 200), (224, 48)]
    assert lay.sections(1) == [(0, 0), (0, 200), (208, 48)]
    assert [lay.body_bytes(c) for c in range(5)] == [272, 256, 256, 256, 256]
    assert lay.nbytes == 272 + 4 * 256
    last = Layout.build(prefix=0, parts=(64,), rows=10, chunk_bytes=64 * 4 + 63)  # 4 rows; 10 = 4 + 4 + 2
    assert (last.chunks, last.rows_of(2), last.body_bytes(2)) == (3, (8, 10), 128)
    assert Layout.build(prefix=0, parts=(64,), rows=3, chunk_bytes=1).chunk_rows == 1  # one row at least
    assert Layout.build(prefix=32, parts=(16,), rows=0, chunk_bytes=None).chunks == 1  # the prefix alone
    assert Layout.build(prefix=0, parts=(16,), rows=0, chunk_bytes=None).chunks == 0
    assert Layout.build(prefix=0, parts=(1 << 16,), rows=4096, chunk_bytes=None).chunk_rows == 512  # 32 MiB
    assert wire.default_chunk_bytes(100) == 16 << 20 and wire.default_chunk_bytes(1 << 30) == 64 << 20
    assert wire.default_chunk_bytes(256 << 20) == 32 << 20
