"""Block hashes of the prefix cache: a hash chain over full blocks' token ids and a request's extra keys, SHA-256
over a canonical, type-tagged byte encoding truncated to 64 bits (stable across processes, machines and Python
versions), and the argument checks the allocator shares."""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Iterable, Sequence

__all__ = ["HASH_BITS", "hash_block_tokens", "hash_blocks"]

HASH_BITS = 64
"""Width of block hashes: ints in ``[0, 2**64)``."""

_HASH_LIMIT = 1 << HASH_BITS
# Version tag of the byte encoding: change it whenever the encoding changes, so hashes persisted by an
# older version can never match blocks hashed by a newer one.
_HASH_DOMAIN = b"kvcache.paged.block-hash.v1\x00"
_NO_PARENT = b"n"


# --------------------------------------------------------------------------------------- validation


def _as_int(name: str, value: object) -> int:
    """``value`` as a Python int (anything with ``__index__``: int, numpy integers); bools are rejected."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got bool ({value!r})")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} ({value!r})") from None


def _as_hash(name: str, value: object) -> int:
    h = _as_int(name, value)
    if not 0 <= h < _HASH_LIMIT:
        raise ValueError(f"{name}: expected a block hash in [0, 2**{HASH_BITS}), got {h}")
    return h


def _as_list(name: str, values: object, what: str) -> list:
    if isinstance(values, (str, bytes, bytearray)) or not isinstance(values, Iterable):
        raise TypeError(f"{name}: expected an iterable of {what}, got {type(values).__name__}")
    return list(values)


# ------------------------------------------------------------------------------------------ hashing


def _encode_key(name: str, key: object, out: list[bytes]) -> None:
    """Append the canonical, type-tagged encoding of one extra key to ``out``."""
    if key is None:
        out.append(b"N")
    elif isinstance(key, bool):
        out.append(b"T" if key else b"F")
    elif isinstance(key, int):
        raw = key.to_bytes((key.bit_length() + 8) // 8, "little", signed=True)
        out.append(b"i" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(key, float):
        out.append(b"f" + struct.pack("<d", key))
    elif isinstance(key, str):
        raw = key.encode("utf-8")
        out.append(b"s" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
        out.append(b"b" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(key, (tuple, list)):
        out.append(b"t" + struct.pack("<I", len(key)))
        for item in key:
            _encode_key(name, item, out)
    elif hasattr(key, "__index__"):  # numpy integers: the same encoding as the equal Python int
        _encode_key(name, operator.index(key), out)
    else:
        raise TypeError(
            f"{name}: expected None, bool, int, float, str, bytes or tuples of them, got {type(key).__name__}"
        )


def _encode_extra_keys(extra_keys: object) -> bytes:
    if not isinstance(extra_keys, (tuple, list)):
        raise TypeError(f"extra_keys: expected a tuple, got {type(extra_keys).__name__}")
    out: list[bytes] = []
    _encode_key("extra_keys", tuple(extra_keys), out)
    return b"".join(out)


def _encode_tokens(tokens: Sequence[object]) -> bytes:
    try:
        return b"k" + struct.pack(f"<I{len(tokens)}q", len(tokens), *tokens)
    except struct.error:
        pass
    for t in tokens:  # find the offending token for a precise message
        v = _as_int("token_ids", t)
        if not -(1 << 63) <= v < (1 << 63):
            raise ValueError(f"token_ids: expected token ids in the int64 range, got {v}")
    raise ValueError("token_ids: could not encode the token ids")  # pragma: no cover


def _tokens_list(token_ids: object) -> list | tuple:
    if isinstance(token_ids, (list, tuple)):
        return token_ids
    if isinstance(token_ids, (str, bytes, bytearray)) or not isinstance(token_ids, Iterable):
        raise TypeError(f"token_ids: expected a sequence of ints, got {type(token_ids).__name__}")
    return list(token_ids)


def _digest(parent: bytes, tokens: bytes, extra: bytes) -> int:
    d = hashlib.sha256(_HASH_DOMAIN + parent + tokens + extra).digest()
    return int.from_bytes(d[:8], "little")


def _parent_bytes(parent_hash: object) -> bytes:
    if parent_hash is None:
        return _NO_PARENT
    return b"p" + struct.pack("<Q", _as_hash("parent_hash", parent_hash))


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    """Hash of one block in a hash chain.

    Parameters
    ----------
    parent_hash : int or None
        Hash of the previous block of the sequence, ``None`` for the first block.
    token_ids : sequence of int
        The block's token ids (ints in the int64 range; numpy integers accepted). Normally exactly
        ``block_size`` of them: only full blocks are cached.
    extra_keys : tuple
        Whatever else determines the block's KV besides the tokens: LoRA adapter id, cache salt,
        multimodal input hashes. Elements: None, bool, int, float, str, bytes, or (nested) tuples of them.
        Different extra keys give different hashes; ``()`` is the default.

    Returns
    -------
    int
        ``int.from_bytes(sha256(tag + parent + tokens + extra_keys)[:8], "little")``, in ``[0, 2**64)``, where
        each part is a canonical, type- and length-tagged byte encoding (tokens as little-endian int64).
        Stable across processes and machines. With ``n`` distinct blocks, the chance of any 64-bit
        collision is about ``n**2 / 2**65``.

    Raises
    ------
    TypeError
        ``token_ids`` holds a non-integer, or ``extra_keys`` is not a tuple of supported values.
    ValueError
        ``parent_hash`` is not in ``[0, 2**64)``, or a token id is outside the int64 range.
    """
    return _digest(_parent_bytes(parent_hash), _encode_tokens(_tokens_list(token_ids)), _encode_extra_keys(extra_keys))


def hash_blocks(
    token_ids: Sequence[int], block_size: int, *, extra_keys: tuple = (), parent_hash: int | None = None
) -> list[int]:
    """Hash chain of every full block of a token sequence.

    Parameters
    ----------
    token_ids : sequence of int
        The sequence's tokens (from its first token, or from the first token after the block whose hash is
        ``parent_hash``).
    block_size : int
        Tokens per block (>= 1).
    extra_keys : tuple
        Extra keys mixed into *every* block's hash (see :func:`hash_block_tokens`). Keys that concern only
        some blocks (a multimodal input spanning blocks 3..5) are hashed block by block with
        :func:`hash_block_tokens`.
    parent_hash : int or None
        Hash of the block before ``token_ids[0]``, to continue a chain (decode appends one block at a time).

    Returns
    -------
    list of int
        ``len(token_ids) // block_size`` hashes; a trailing partial block gets none. ``hashes[i]`` covers
        ``hashes[i - 1]`` (or ``parent_hash``), ``token_ids[i * block_size:(i + 1) * block_size]`` and
        ``extra_keys``, so ``hash_blocks(t[k * bs:], bs, parent_hash=hash_blocks(t, bs)[k - 1])`` equals
        ``hash_blocks(t, bs)[k:]``.

    Raises
    ------
    TypeError, ValueError
        Bad ``block_size``, ``token_ids``, ``extra_keys`` or ``parent_hash``; the error names the argument.
    """
    bs = _as_int("block_size", block_size)
    if bs < 1:
        raise ValueError(f"block_size: expected an int >= 1, got {bs}")
    tokens = _tokens_list(token_ids)
    extra = _encode_extra_keys(extra_keys)
    parent = _parent_bytes(parent_hash)
    out: list[int] = []
    for i in range(len(tokens) // bs):
        h = _digest(parent, _encode_tokens(tokens[i * bs : (i + 1) * bs]), extra)
        out.append(h)
        parent = b"p" + struct.pack("<Q", h)
    return out
