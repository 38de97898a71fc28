"""KVSnapshot: construction, packing, .to(), .equal(), safetensors files (bit-exact, every dtype)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvcache import CacheConfig, KVCacheManager, KVLayerConfig, KVSnapshot, LinearKVCache, ManagerConfig

from . import KV_DTYPES, beq, bits, fill_cache, random_like

SPECS = [(2, 8), (3, 80), (1, 96)]


def separate(specs, n, dtype, gen, device="cpu"):
    return [random_like(torch.empty(2, h, n, d, dtype=dtype), gen).to(device) for h, d in specs]


def packed(specs, n, dtype, gen, device="cpu"):
    flat = random_like(torch.empty(sum(2 * h * n * d for h, d in specs), dtype=dtype), gen).to(device)
    out, off = [], 0
    for h, d in specs:
        out.append(flat[off : off + 2 * h * n * d].view(2, h, n, d))
        off += 2 * h * n * d
    return out, flat


def gen_(seed=0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------- construction


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_properties_separate(dtype):
    layers = separate(SPECS, 5, dtype, gen_())
    snap = KVSnapshot(layers)
    assert snap.num_layers == 3 and snap.seq_len == 5 and snap.dtype == dtype
    assert snap.device == torch.device("cpu")
    assert snap.layer_specs == tuple(SPECS)
    assert snap.nbytes == sum(2 * h * 5 * d for h, d in SPECS) * layers[0].element_size()
    assert snap.flat is None
    assert len(snap.layers) == 3
    for t, orig in zip(snap.layers, layers):
        assert t.data_ptr() == orig.data_ptr(), "the snapshot holds the given tensors, no copy"
    assert "KVSnapshot" in repr(snap)


def test_packed_detection():
    layers, flat = packed(SPECS, 4, torch.float16, gen_(1))
    snap = KVSnapshot(layers)
    assert snap.flat is not None
    assert snap.flat.data_ptr() == flat.data_ptr() and snap.flat.numel() == flat.numel()
    assert beq(snap.flat, flat)
    # same views out of order, or with a gap, are not packed
    assert KVSnapshot([layers[1], layers[0], layers[2]]).flat is None
    assert KVSnapshot([layers[0], layers[2]]).flat is None


def test_empty_is_packed():
    snap = KVSnapshot.empty(SPECS, 6, dtype=torch.bfloat16, device="cpu")
    assert snap.flat is not None and snap.flat.numel() == sum(2 * h * 6 * d for h, d in SPECS)
    assert snap.layer_specs == tuple(SPECS) and snap.seq_len == 6 and snap.dtype == torch.bfloat16
    for t, (h, d) in zip(snap.layers, SPECS):
        assert tuple(t.shape) == (2, h, 6, d) and t.is_contiguous()
    # the layers are views of the flat buffer, back to back
    snap.flat.view(torch.int16).copy_(torch.arange(snap.flat.numel(), dtype=torch.int16))
    off = 0
    for t in snap.layers:
        assert t.view(torch.int16).flatten().tolist() == list(range(off, off + t.numel()))
        off += t.numel()


def test_invalid_construction():
    g = gen_(2)
    ok = separate(SPECS, 3, torch.float16, g)
    with pytest.raises(TypeError, match="layers"):
        KVSnapshot(ok[0])
    with pytest.raises(TypeError, match="layers"):
        KVSnapshot(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        KVSnapshot([ok[0], "x"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="layers"):
        KVSnapshot([])
    with pytest.raises(ValueError, match=r"layers\[0\]"):
        KVSnapshot([ok[0][0]])  # 3-d
    with pytest.raises(ValueError, match=r"layers\[1\]"):
        KVSnapshot([ok[0], torch.zeros(3, 2, 3, 8, dtype=torch.float16)])  # dim 0 != 2
    with pytest.raises(ValueError, match="dtype"):
        KVSnapshot([torch.ones(2, 2, 3, 8, dtype=torch.float64)])
    with pytest.raises(ValueError, match="dtype"):
        KVSnapshot([ok[0], ok[1].to(torch.bfloat16)])  # mixed dtypes
    with pytest.raises(ValueError, match="seq_len"):
        KVSnapshot([ok[0], separate([(3, 80)], 4, torch.float16, g)[0]])  # mixed seq_len
    with pytest.raises(ValueError, match="contiguous"):
        KVSnapshot([torch.zeros(2, 3, 8, 2, dtype=torch.float16).transpose(2, 3)])
    with pytest.raises(ValueError, match="device"):
        KVSnapshot([ok[0], torch.empty(2, 3, 3, 80, dtype=torch.float16, device="meta")])


# ------------------------------------------------------------------------------------------- to / equal


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("kind", ["separate", "packed"])
def test_to_copies(dtype, kind):
    g = gen_(3)
    layers = separate(SPECS, 4, dtype, g) if kind == "separate" else packed(SPECS, 4, dtype, g)[0]
    snap = KVSnapshot(layers)
    saved = [t.clone() for t in layers]
    copy = snap.to("cpu")
    assert copy.flat is not None, ".to() returns a packed snapshot"
    assert copy.layer_specs == snap.layer_specs and copy.seq_len == 4 and copy.dtype == dtype
    for a, b in zip(copy.layers, saved):
        assert beq(a, b)
        assert a.is_contiguous()
    assert copy.equal(snap) and snap.equal(copy)
    # a copy: the original's memory is not shared
    for t in layers:
        t.copy_(random_like(t, g))
    for a, b in zip(copy.layers, saved):
        assert beq(a, b)
    assert not copy.equal(snap)


def test_to_device_object(device):
    snap = KVSnapshot(separate(SPECS, 2, torch.float16, gen_(4)))
    moved = snap.to(device)
    assert moved.device.type == torch.device(device).type
    assert moved.equal(snap)
    back = moved.to("cpu")
    assert back.device == torch.device("cpu") and back.equal(snap)


def test_equal():
    g = gen_(5)
    layers = separate(SPECS, 3, torch.float16, g)
    a = KVSnapshot(layers)
    b = KVSnapshot([t.clone() for t in layers])
    assert a.equal(b) and b.equal(a) and a.equal(a)
    # one flipped bit in the last element of the last layer
    flipped = [t.clone() for t in layers]
    flipped[-1].view(torch.int16).view(-1)[-1] ^= 1
    assert not a.equal(KVSnapshot(flipped))
    # different shapes, seq_len, dtype, or not a snapshot
    assert not a.equal(KVSnapshot(layers[:2]))
    assert not a.equal(KVSnapshot([t[:, :, :2].contiguous() for t in layers]))
    assert not a.equal(KVSnapshot([t.view(torch.bfloat16) for t in layers]))
    assert not a.equal(layers)  # type: ignore[arg-type]
    assert not a.equal(None)  # type: ignore[arg-type]
    # NaN payloads compare by bits: a snapshot holding NaNs equals its copy
    nan = [torch.full((2, 1, 2, 4), float("nan"), dtype=torch.float16)]
    assert KVSnapshot(nan).equal(KVSnapshot([nan[0].clone()]))


# ------------------------------------------------------------------------------------------- files


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("kind", ["separate", "packed"])
@pytest.mark.parametrize("seq_len", [1, 7])
def test_file_round_trip(tmp_path, dtype, kind, seq_len):
    g = gen_(6)
    layers = separate(SPECS, seq_len, dtype, g) if kind == "separate" else packed(SPECS, seq_len, dtype, g)[0]
    snap = KVSnapshot(layers)
    path = tmp_path / "prompt.safetensors"
    snap.save_file(path, metadata={"model": "tiny", "note": "system prompt"})
    loaded = KVSnapshot.load_file(path)
    assert loaded.layer_specs == tuple(SPECS) and loaded.seq_len == seq_len and loaded.dtype == dtype
    assert loaded.device == torch.device("cpu")
    assert loaded.flat is not None
    for a, b in zip(loaded.layers, layers):
        assert torch.equal(bits(a), bits(b))
    assert loaded.equal(snap)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert sorted(f.keys()) == ["layer.0", "layer.1", "layer.2"]
        assert tuple(f.get_tensor("layer.1").shape) == (2, 3, seq_len, 80)
    assert meta["model"] == "tiny" and meta["note"] == "system prompt"
    assert meta["seq_len"] == str(seq_len)
    assert "format" in meta


def test_file_round_trip_str_path_and_device(tmp_path, device):
    snap = KVSnapshot(separate(SPECS, 3, torch.float8_e4m3fn, gen_(7)))
    path = str(tmp_path / "s.safetensors")
    snap.save_file(path)
    loaded = KVSnapshot.load_file(path, device=device)
    assert loaded.device.type == torch.device(device).type
    assert loaded.equal(snap)


def test_file_metadata_validation(tmp_path):
    snap = KVSnapshot(separate(SPECS, 2, torch.float16, gen_(8)))
    for key in ("format", "seq_len", "num_layers"):
        with pytest.raises(ValueError, match="metadata"):
            snap.save_file(tmp_path / f"{key}.safetensors", metadata={key: "1"})
    with pytest.raises(TypeError, match="metadata"):
        snap.save_file(tmp_path / "t.safetensors", metadata={"n": 1})  # type: ignore[dict-item]


def test_load_non_snapshot_file(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"weight": torch.randn(4, 4)}, str(path))
    with pytest.raises(ValueError, match="snapshot"):
        KVSnapshot.load_file(path)
    path2 = tmp_path / "other.safetensors"
    save_file({"layer.0": torch.zeros(2, 1, 1, 8, dtype=torch.float16)}, str(path2), metadata={"format": "other"})
    with pytest.raises(ValueError, match="snapshot"):
        KVSnapshot.load_file(path2)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_cache_snapshot_through_file(tmp_path, device, dtype):
    """Save a slot of a heterogeneous manager and of a linear cache, write, read, restore elsewhere."""
    g = gen_(9)
    mgr = KVCacheManager(ManagerConfig(max_batch_size=3, max_seq_len=8,
                                       layers=[KVLayerConfig(h, d) for h, d in SPECS], dtype=dtype, device=device))
    fill_cache(mgr, g)
    mgr.reset_for_new_sequences([6, 2])
    snap = mgr.save(0, 6)
    snap.save_file(tmp_path / "m.safetensors")
    loaded = KVSnapshot.load_file(tmp_path / "m.safetensors", device=mgr.device)
    assert loaded.equal(snap)
    mgr.restore(loaded, 2)
    for i in range(len(SPECS)):
        assert beq(mgr.layer(i)[2, :, :, :6], mgr.layer(i)[0, :, :, :6])

    lin = LinearKVCache(CacheConfig(num_layers=2, max_batch_size=2, max_seq_len=8, num_kv_heads=3, head_dim=24,
                                    dtype=dtype, device=device))
    fill_cache(lin, g)
    lin.reset_for_new_sequences([8])
    lin.save(0, 8).save_file(tmp_path / "l.safetensors")
    lin.restore(KVSnapshot.load_file(tmp_path / "l.safetensors", device=lin.device), 1)
    assert beq(lin.buffer[:, 1], lin.buffer[:, 0])
