"""Snapshot files (issue 13, item 6): damaged files are errors, never a wrong snapshot; writes are atomic.

Damage is made byte by byte on real files: truncation at every length class, every header byte flipped, data
bytes flipped, metadata rewritten; writes are interrupted by a killed process and by file-system refusals.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save as st_save

from kvcache import KVSnapshot

from . import random_like


def snapshot(seq_len=3, specs=((1, 4), (2, 2)), dtype=torch.float16, seed=0) -> KVSnapshot:
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for h, d in specs:
        t = torch.empty((2, h, seq_len, d), dtype=dtype)
        t.copy_(random_like(t, gen))
        layers.append(t)
    return KVSnapshot(layers)


def header_len(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def rewrite(data: bytes, meta_update: dict | None = None, tensors_update: dict | None = None,
            drop: tuple[str, ...] = ()) -> bytes:
    """A file like ``data`` with metadata keys replaced / removed (value None) and tensors added or removed,
    written by safetensors itself (a well-formed file whose content is wrong)."""
    from safetensors.torch import load

    tensors = load(data)
    header = json.loads(data[8:header_len(data)])
    meta = dict(header["__metadata__"])
    for k, v in (meta_update or {}).items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    tensors.update(tensors_update or {})
    for k in drop:
        tensors.pop(k)
    return st_save(tensors, metadata=meta)


def load_bytes(tmp_path, data: bytes, name="x.safetensors", **kw) -> KVSnapshot:
    p = tmp_path / name
    p.write_bytes(data)
    return KVSnapshot.load_file(p, **kw)


@pytest.fixture
def saved(tmp_path):
    snap = snapshot()
    path = tmp_path / "snap.safetensors"
    snap.save_file(path, metadata={"model": "tiny"})
    return snap, path, path.read_bytes()


def test_round_trip_and_metadata(saved, tmp_path):
    snap, path, data = saved
    assert KVSnapshot.load_file(path).equal(snap)
    meta = json.loads(data[8:header_len(data)])["__metadata__"]
    assert meta["format"] == "kvcache.snapshot/1"
    assert meta["seq_len"] == "3" and meta["num_layers"] == "2" and meta["dtype"] == "float16"
    assert json.loads(meta["layer_specs"]) == [[1, 4], [2, 2]]
    assert meta["checksum"].startswith("sha256:") and len(meta["checksum"]) == 7 + 64
    assert meta["model"] == "tiny"
    assert os.listdir(tmp_path) == ["snap.safetensors"]  # no temporary file left


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_round_trip_dtypes_and_zero_tokens(tmp_path, dtype):
    for seq_len in (0, 5):
        snap = snapshot(seq_len=seq_len, dtype=dtype, seed=seq_len)
        snap.save_file(tmp_path / "s.safetensors")
        assert KVSnapshot.load_file(tmp_path / "s.safetensors").equal(snap)


def test_truncated_files(saved, tmp_path):
    _, _, data = saved
    h = header_len(data)
    for n in sorted({0, 1, 7, 8, 9, h // 2, h - 1, h, h + 1, len(data) - 1}):
        with pytest.raises(ValueError, match=r"^path: .*(truncated|damaged)"):
            load_bytes(tmp_path, data[:n])


def test_every_flipped_header_byte_is_an_error(saved, tmp_path):
    _, _, data = saved
    h = header_len(data)
    for pos in range(h):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        with pytest.raises(ValueError, match=r"^path: "):
            load_bytes(tmp_path, bytes(bad))


def test_flipped_data_bytes_fail_the_checksum(saved, tmp_path):
    snap, _, data = saved
    h = header_len(data)
    for pos in range(h, len(data), max(1, (len(data) - h) // 16)):
        for bit in (0x01, 0x80):
            bad = bytearray(data)
            bad[pos] ^= bit
            with pytest.raises(ValueError, match=r"^path: .* is damaged: checksum"):
                load_bytes(tmp_path, bytes(bad))
            # opting out of the checksum loads the damaged bytes: the caller asked for it
            loaded = load_bytes(tmp_path, bytes(bad), verify=False)
            assert not loaded.equal(snap)


def test_wrong_metadata(saved, tmp_path):
    _, _, data = saved
    cases = {
        "seq_len": ({"seq_len": "4"}, r"tensor layer\.0: expected shape \[2, H, 4, D\]"),
        "seq_len-text": ({"seq_len": "three"}, r"metadata seq_len: expected an int >= 0, got 'three'"),
        "num_layers-more": ({"num_layers": "3"}, r"lacks tensors \['layer\.2'\]"),
        "num_layers-fewer": ({"num_layers": "1"}, r"holds unexpected tensors \['layer\.1'\]"),
        "num_layers-zero": ({"num_layers": "0"}, r"metadata num_layers: expected an int >= 1"),
        "dtype": ({"dtype": "bfloat16"}, r"metadata dtype: expected 'float16'"),
        "layer_specs": ({"layer_specs": "[[1, 4], [2, 3]]"}, r"metadata layer_specs: expected \[\[1, 4\], \[2, 2\]\]"),
        "format": ({"format": "kvcache.snapshot/9"}, r"is not a kvcache snapshot"),
        "missing-seq_len": ({"seq_len": None}, r"metadata: key 'seq_len' is missing"),
        "missing-checksum": ({"checksum": None}, r"key 'checksum' is missing \(load_file\(\.\.\., verify=False\)"),
        "user-key": ({"model": "other"}, r"is damaged: checksum"),
    }
    for update, msg in cases.values():
        with pytest.raises(ValueError, match=r"^path: .*" + msg):
            load_bytes(tmp_path, rewrite(data, update))
    # structure is checked without the checksum too
    with pytest.raises(ValueError, match=r"expected shape \[2, H, 4, D\]"):
        load_bytes(tmp_path, rewrite(data, {"seq_len": "4"}), verify=False)
    assert load_bytes(tmp_path, rewrite(data, {"checksum": None}), verify=False).seq_len == 3


def test_extra_and_missing_tensors(saved, tmp_path):
    _, _, data = saved
    extra = {"layer.2": torch.zeros(2, 1, 3, 4, dtype=torch.float16)}
    with pytest.raises(ValueError, match=r"holds unexpected tensors \['layer\.2'\]"):
        load_bytes(tmp_path, rewrite(data, tensors_update=extra))
    with pytest.raises(ValueError, match=r"holds unexpected tensors \['junk'\]"):
        load_bytes(tmp_path, rewrite(data, tensors_update={"junk": torch.zeros(1)}), verify=False)
    with pytest.raises(ValueError, match=r"lacks tensors \['layer\.1'\]"):
        load_bytes(tmp_path, rewrite(data, drop=("layer.1",)))


def test_wrong_tensor_content(saved, tmp_path):
    _, _, data = saved
    bad_shape = {"layer.1": torch.zeros(3, 2, 3, 2, dtype=torch.float16)}
    with pytest.raises(ValueError, match=r"tensor layer\.1: expected shape \[2, H, 3, D\]"):
        load_bytes(tmp_path, rewrite(data, tensors_update=bad_shape), verify=False)
    bad_dtype = {"layer.1": torch.zeros(2, 2, 3, 2, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=r"tensor layer\.1: expected dtype torch\.float16"):
        load_bytes(tmp_path, rewrite(data, tensors_update=bad_dtype), verify=False)


def test_errors_chain_their_cause(saved, tmp_path):
    _, _, data = saved
    h = header_len(data)
    with pytest.raises(ValueError) as e:
        load_bytes(tmp_path, data[: h + 3])
    assert e.value.__cause__ is not None
    with pytest.raises(FileNotFoundError, match=r"path: cannot read the snapshot file") as e2:
        KVSnapshot.load_file(tmp_path / "absent.safetensors")
    assert isinstance(e2.value.__cause__, FileNotFoundError)


# ---------------------------------------------------------------------------------------------------------
# writing


def test_missing_directory(tmp_path):
    target = tmp_path / "no" / "such" / "dir" / "s.safetensors"
    with pytest.raises(FileNotFoundError, match=r"path: cannot write the snapshot file") as e:
        snapshot().save_file(target)
    assert isinstance(e.value.__cause__, OSError)
    assert not (tmp_path / "no").exists()


def test_path_under_a_file(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match=r"path: cannot write"):
        snapshot().save_file(tmp_path / "file" / "s.safetensors")
    assert (tmp_path / "file").read_bytes() == b"x"


def test_directory_at_target_leaves_no_temp(tmp_path):
    (tmp_path / "s.safetensors").mkdir()
    with pytest.raises(OSError, match=r"path: cannot write") as e:
        snapshot().save_file(tmp_path / "s.safetensors")
    assert e.value.__cause__ is not None
    assert os.listdir(tmp_path) == ["s.safetensors"]  # the temporary file was removed
    assert os.listdir(tmp_path / "s.safetensors") == []


def test_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    old = snapshot(seed=1)
    old.save_file(ro / "s.safetensors")
    os.chmod(ro, 0o555)
    try:
        if os.geteuid() == 0:
            # root writes through permission bits: force the refusal with a directory in place of the target's
            # temporary location instead (a directory is not writable as a file by anyone)
            target = ro / "sub"
            os.chmod(ro, 0o755)
            target.mkdir()
            os.chmod(target, 0o555)
            with pytest.raises(OSError, match=r"path: cannot write"):
                snapshot().save_file(target)  # target is a directory: replace refuses
        else:
            with pytest.raises(PermissionError, match=r"path: cannot write"):
                snapshot().save_file(ro / "s.safetensors")
        assert KVSnapshot.load_file(ro / "s.safetensors").equal(old)
        assert sorted(os.listdir(ro)) in (["s.safetensors"], ["s.safetensors", "sub"])
    finally:
        os.chmod(ro, 0o755)


def test_replace_keeps_old_file_until_the_new_one_is_complete(tmp_path):
    path = tmp_path / "s.safetensors"
    old, new = snapshot(seed=1), snapshot(seed=2)
    old.save_file(path)
    new.save_file(path)
    assert KVSnapshot.load_file(path).equal(new)
    assert os.listdir(tmp_path) == ["s.safetensors"]


_CHILD = textwrap.dedent(
    """
    import os, sys, time, torch
    from kvcache import KVSnapshot

    real_fsync = os.fsync
    def stall(fd):  # the data is written to the temporary file; stop here until killed
        real_fsync(fd)
        print("WRITTEN", flush=True)
        time.sleep(60)
    os.fsync = stall
    layers = [torch.full((2, 4, 64, 32), 7.0, dtype=torch.float16)]
    KVSnapshot(layers).save_file(sys.argv[1])
    """
)


def test_save_killed_mid_write(tmp_path):
    path = tmp_path / "s.safetensors"
    old = snapshot(seed=3)
    old.save_file(path)
    before = path.read_bytes()
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == "WRITTEN", line
        assert len(os.listdir(tmp_path)) == 2  # the target and the child's temporary file
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert path.read_bytes() == before  # the old file is intact
    assert KVSnapshot.load_file(path).equal(old)
    # the dead writer's temporary file is removed by the next save to the same path
    snapshot(seed=4).save_file(path)
    assert os.listdir(tmp_path) == ["s.safetensors"]
    assert KVSnapshot.load_file(path).equal(snapshot(seed=4))


def test_metadata_validation(tmp_path):
    snap = snapshot()
    for key in ("format", "seq_len", "num_layers", "dtype", "layer_specs", "checksum"):
        with pytest.raises(ValueError, match=rf"^metadata: key '{key}' is reserved"):
            snap.save_file(tmp_path / "s.safetensors", metadata={key: "1"})
    with pytest.raises(TypeError, match=r"^metadata: expected str keys and values"):
        snap.save_file(tmp_path / "s.safetensors", metadata={"n": 1})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"^metadata: expected a mapping"):
        snap.save_file(tmp_path / "s.safetensors", metadata=[("a", "b")])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^verify: expected a bool"):
        KVSnapshot.load_file(tmp_path / "s.safetensors", verify=1)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []
