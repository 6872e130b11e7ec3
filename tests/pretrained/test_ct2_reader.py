"""The CTranslate2 model.bin reader: written from the format, so tested on files this test
writes byte by byte the way CTranslate2's ``ModelSpec._serialize`` does, on the packaged real
file, and on every kind of damage (each must be a BadFileError naming the file)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv.pretrained
from qkv.data.files import BadFileError, MissingFileError
from qkv.pretrained.whisper.ct2_reader import read_ct2

_IDS = {np.dtype("float32"): 0, np.dtype("int8"): 1, np.dtype("int16"): 2,
        np.dtype("int32"): 3, np.dtype("float16"): 4}


def _string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<H", len(raw) + 1) + raw + b"\0"


def _variable(name, array: np.ndarray, type_id=None, num_bytes=None) -> bytes:
    out = _string(name) + struct.pack("<B", array.ndim)
    out += b"".join(struct.pack("<I", d) for d in array.shape)
    out += struct.pack("<B", _IDS[array.dtype] if type_id is None else type_id)
    out += struct.pack("<I", array.nbytes if num_bytes is None else num_bytes)
    return out + array.tobytes()


def _file(variables: list[bytes], aliases=(), version=6, count=None, tail=b"") -> bytes:
    out = struct.pack("<I", version) + _string("TestSpec") + struct.pack("<I", 2)
    out += struct.pack("<I", len(variables) if count is None else count) + b"".join(variables)
    out += struct.pack("<I", len(aliases)) + b"".join(_string(a) + _string(t) for a, t in aliases)
    return out + tail


ARRAYS = {
    "a/weight": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    "a/half": (np.arange(10, dtype=np.float32) / 3).astype(np.float16).reshape(2, 5),
    "b/ids": np.array([1, -2, 3], dtype=np.int32),
    "b/scalar": np.array(3, dtype=np.int8),
    "b/short": np.array([[7, -8]], dtype=np.int16),
    "c/empty": np.zeros((0, 4), dtype=np.float32),
}


def _good() -> bytes:
    return _file([_variable(k, v) for k, v in ARRAYS.items()], aliases=[("d/tied", "a/weight")])


def test_round_trip_of_every_dtype_and_an_alias(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(_good())
    f = read_ct2(path)
    assert (f.version, f.spec, f.revision) == (6, "TestSpec", 2)
    for name, array in ARRAYS.items():
        assert f.shapes[name] == array.shape
        assert f.tensors[name].dtype == torch.from_numpy(array).dtype
        assert torch.equal(f.tensors[name], torch.from_numpy(array)), name
    assert f.aliases == {"d/tied": "a/weight"} and f.tensors["d/tied"] is f.tensors["a/weight"]
    assert f.scalar("b/scalar") == 3
    with pytest.raises(BadFileError, match="expected a scalar variable 'a/weight'"):
        f.scalar("a/weight")
    header = read_ct2(path, tensors=False)
    assert header.shapes == f.shapes and not header.tensors


def test_bfloat16_is_read_bit_exact(tmp_path):
    values = torch.tensor([1.5, -2.25, 3e38, 1e-3], dtype=torch.bfloat16)
    bits = values.view(torch.int16).numpy()
    (tmp_path / "m.bin").write_bytes(_file([_variable("x", bits, type_id=5)]))
    got = read_ct2(tmp_path / "m.bin").tensors["x"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, values)


def test_the_packaged_whisper_file():
    f = read_ct2(qkv.pretrained.locate("whisper-tiny.en") / "model.bin", tensors=False)
    assert (f.version, f.spec, f.revision) == (6, "WhisperSpec", 3)
    assert f.shapes["encoder/conv1/weight"] == (384, 80, 3)
    assert f.shapes["decoder/layer_0/self_attention/linear_0/weight"] == (1152, 384)
    assert f.dtypes["decoder/embeddings/weight"] == "float16"
    assert f.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    assert len(f.shapes) == 149


def test_every_truncation_is_refused(tmp_path):
    data = _good()
    path = tmp_path / "model.bin"
    for n in [*range(0, 60), *range(60, len(data), 7)]:
        path.write_bytes(data[:n])
        with pytest.raises(BadFileError, match=r"model\.bin: .*truncated") as err:
            read_ct2(path)
        assert err.value.path == path, n


V = np.ones(4, dtype=np.float32)
CASES = {
    "bad version": (_file([_variable("x", V)], version=7), "unsupported binary version 7"),
    "old version": (_file([_variable("x", V)], version=3), "unsupported binary version 3"),
    "unknown dtype": (_file([_variable("x", V, type_id=9)]), "unknown dtype id 9"),
    "size mismatch": (_file([_variable("x", V, num_bytes=12)]), "declares 12 bytes; expected 16"),
    "absurd size": (_file([_variable("x", V, num_bytes=2**32 - 1)]), "declares 4294967295 bytes"),
    "absurd count": (_file([_variable("x", V)], count=2**31), "declares 2147483648 variables"),
    "absurd rank": (_file([_variable("x", np.ones((1,) * 9, dtype=np.float32))]), "rank 9"),
    "duplicate": (_file([_variable("x", V), _variable("x", V)]), "'x' appears twice"),
    "alias to nothing": (_file([_variable("x", V)], aliases=[("y", "z")]), "'z', which is not in the file"),
    "alias shadows": (_file([_variable("x", V), _variable("y", V)], aliases=[("y", "x")]), "also the name"),
    "trailing bytes": (_file([_variable("x", V)], tail=b"\0\0"), "2 unexpected bytes"),
    "bad utf-8 name": (_file([_variable(b"\xff\xfe", V)]), "not UTF-8"),
    "no NUL": (struct.pack("<I", 6) + struct.pack("<H", 3) + b"abc" + b"\0" * 20, "not a NUL-terminated"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_files_are_refused_by_name(case, tmp_path):
    data, message = CASES[case]
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    with pytest.raises(BadFileError, match=message) as err:
        read_ct2(path)
    assert str(path) in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(MissingFileError, match=r"no CTranslate2 model\.bin"):
        read_ct2(tmp_path / "absent.bin")


def test_a_whisper_folder_with_damage_is_refused(tmp_path):
    """The Whisper loader's own checks: another spec, a non-zero key bias, a NaN, a missing
    tensor."""
    from qkv.pretrained.whisper.model import load_whisper_ct2

    (tmp_path / "model.bin").write_bytes(_good())
    with pytest.raises(BadFileError, match="spec 'TestSpec'; qkv reads Whisper models"):
        load_whisper_ct2(tmp_path)
    real = qkv.pretrained.locate("whisper-tiny.en") / "model.bin"
    data = bytearray(real.read_bytes())
    name = b"encoder/layer_0/self_attention/linear_0/bias\0"
    at = data.index(name) + len(name) + 1 + 4 + 1 + 4  # rank, dim, dtype, size
    data[at + 2 * 384 : at + 2 * 384 + 2] = np.array([0.5], dtype=np.float16).tobytes()  # k bias
    (tmp_path / "model.bin").write_bytes(bytes(data))
    with pytest.raises(BadFileError, match="non-zero key bias"):
        load_whisper_ct2(tmp_path)
    data[at + 2 * 384 : at + 2 * 384 + 2] = b"\0\0"
    name = b"encoder/conv1/bias\0"
    bias = data.index(name) + len(name) + 1 + 4 + 1 + 4
    data[bias : bias + 2] = np.array([np.nan], dtype=np.float16).tobytes()
    (tmp_path / "model.bin").write_bytes(bytes(data))
    with pytest.raises(BadFileError, match=r"'encoder/conv1/bias'.*NaN"):
        load_whisper_ct2(tmp_path)
    data[bias : bias + 2] = b"\0\0"
    renamed = data.index(b"decoder/layer_3/ffn/linear_1/bias")
    data[renamed : renamed + 7] = b"decodex"
    (tmp_path / "model.bin").write_bytes(bytes(data))
    with pytest.raises(BadFileError, match=r"missing tensor.*'decoder/layer_3/ffn/linear_1/bias'"):
        load_whisper_ct2(tmp_path)
    data[renamed : renamed + 7] = b"decoder"
    data[:4] = struct.pack("<I", 5)
    spec_at = data.index(b"WhisperSpec")
    data[spec_at : spec_at + 11] = b"WhisperSpek"
    (tmp_path / "model.bin").write_bytes(bytes(data))
    with pytest.raises(BadFileError, match="spec 'WhisperSpek'"):
        load_whisper_ct2(tmp_path)


def test_unpickling_is_never_involved(tmp_path):
    """A pickle named model.bin is just bytes of the wrong layout, never loaded."""
    import pickle

    path = Path(tmp_path / "model.bin")
    path.write_bytes(pickle.dumps({"x": 1}))
    with pytest.raises(BadFileError):
        read_ct2(path)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_damage_is_a_bad_file_error_or_a_clean_read(data, tmp_path_factory):
    """Bit flips, overwritten bytes, cuts and random bytes: a BadFileError or a file whose
    every tensor has the bytes its shape and dtype promise; never another exception."""
    raw = bytearray(_good())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    raw = raw[: data.draw(st.integers(0, len(raw)))] + data.draw(st.binary(max_size=8))
    path = tmp_path_factory.mktemp("fuzz") / "model.bin"
    path.write_bytes(bytes(raw))
    try:
        f = read_ct2(path)
    except BadFileError as err:
        assert str(path) in str(err)
        return
    for name, t in f.tensors.items():
        assert tuple(t.shape) == f.shapes[name]
