"""Hostile files: every loader names the file it cannot use, checks a config against the tensors
before it builds anything, refuses non-finite weights, and never runs code from a pickle.

The files are tiny, written here (tests/fuzz/tiny_files.py); tests/fuzz/test_fuzz_readers.py
feeds the same readers random bytes, truncations and bit flips.
"""

from __future__ import annotations

import json
import os
import pickle
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import qkv.pretrained
from fuzz.tiny_files import (
    gguf_llama,
    hard_deadline,
    hf_bert,
    hf_llama,
    qkv_checkpoint,
)
from qkv.checkpoint import CheckpointError, check_finite, load_checkpoint
from qkv.data.files import BadFileError, MissingFileError, read_json, read_toml
from qkv.data.tokenizers import load_tokenizer
from qkv.models import DecoderLM, Encoder

# --- 1. a file a loader cannot read is named, with what was expected and what was found ----


def test_the_error_type():
    err = BadFileError("the header is cut short", path="/x/model.safetensors")
    assert isinstance(err, ValueError) and err.path.name == "model.safetensors"
    assert str(err) == "/x/model.safetensors: the header is cut short"
    missing = MissingFileError("no file at /x/a.json", path="/x/a.json")
    assert isinstance(missing, FileNotFoundError) and isinstance(missing, BadFileError)
    assert str(missing) == "no file at /x/a.json"
    assert issubclass(CheckpointError, BadFileError)
    for e in (err, missing, CheckpointError("bad", path="/x/config.json")):
        back = pickle.loads(pickle.dumps(e))  # across processes the path survives
        assert (type(back), str(back), back.path) == (type(e), str(e), e.path)


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _case_hf_safetensors(tmp):
    hf_llama(tmp)
    _truncate(tmp / "model.safetensors")
    return tmp / "model.safetensors", r"not a readable safetensors file, truncated or corrupt"


def _case_hf_config(tmp):
    hf_llama(tmp)
    (tmp / "config.json").write_text('{"model_type": "llama", ')
    return tmp / "config.json", r"is not valid JSON: Expecting"


def _case_hf_tokenizer(tmp):
    hf_llama(tmp)
    (tmp / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 3}}')
    return tmp / "tokenizer.json", r"expected a tokenizers library tokenizer\.json"


def _case_hf_vocab(tmp):
    hf_bert(tmp)
    (tmp / "vocab.txt").write_bytes(b"\xff\xfe\x00[UNK]")
    return tmp / "vocab.txt", r"expected a WordPiece vocabulary"


def _case_hf_modules(tmp):
    hf_bert(tmp)
    (tmp / "modules.json").write_text(json.dumps([{"type": "x.Pooling", "path": "../../etc"}]))
    return tmp / "modules.json", r"module path '\.\./\.\./etc' is not a folder inside"


def _case_hf_shards(tmp):
    hf_llama(tmp)
    (tmp / "model.safetensors").rename(tmp / "shard.safetensors")
    index = {"weight_map": {"model.norm.weight": "../shard.safetensors"}}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp / "model.safetensors.index.json", r"is not a plain file name in the folder"


def _case_legacy_pickle(tmp):
    hf_llama(tmp)
    (tmp / "model.safetensors").unlink()
    (tmp / "pytorch_model.bin").write_bytes(pickle.dumps({"w": [1.0, 2.0]}))
    return tmp / "pytorch_model.bin", r"not a zip archive .*expected the zip format torch\.save"


def _case_checkpoint_safetensors(tmp):
    qkv_checkpoint(tmp)
    _truncate(tmp / "model.safetensors", 0.9)
    return tmp / "model.safetensors", r"not a readable safetensors file, truncated or corrupt"


def _case_checkpoint_tokenizer(tmp):
    qkv_checkpoint(tmp)
    (tmp / "tokenizer-text.json").write_text('{"qkv_tokenizer": "char", "chars": 5}')
    return tmp / "tokenizer-text.json", r"cannot read tokenizer 'text' \(listed in .*config\.json\)"


def _case_gguf(tmp):
    gguf_llama(tmp / "m.gguf")
    _truncate(tmp / "m.gguf", 0.3)
    return tmp / "m.gguf", r"is not a readable GGUF file .*expected llama\.cpp's format"


@pytest.mark.parametrize("case", [
    _case_hf_safetensors, _case_hf_config, _case_hf_tokenizer, _case_hf_vocab, _case_hf_modules,
    _case_hf_shards, _case_legacy_pickle, _case_checkpoint_safetensors,
    _case_checkpoint_tokenizer, _case_gguf,
], ids=lambda f: f.__name__.removeprefix("_case_"))  # fmt: skip
def test_unreadable_files_are_named(tmp_path, case):
    bad, message = case(tmp_path)
    target = tmp_path if bad.suffix != ".gguf" else bad
    with pytest.raises(BadFileError, match=message) as info:
        qkv.pretrained.load(target)
    assert info.value.path == bad and str(bad) in str(info.value)


@pytest.mark.parametrize("text", ["", "   "])
def test_load_of_an_empty_name_is_refused(text, tmp_path, monkeypatch):
    qkv_checkpoint(tmp_path / "ck")
    monkeypatch.chdir(tmp_path / "ck")  # Path("") is ".": it must not load the working folder
    with pytest.raises(BadFileError, match=rf"name_or_path is empty \({text!r}\); expected a "
                                           r"packaged name \(\['all-MiniLM-L6-v2'"):  # fmt: skip
        qkv.pretrained.load(text)


@pytest.mark.parametrize(("reader", "content", "message"), [
    (read_json, b"\xff\xfe{}", r"is not a UTF-8 text file"),
    (read_json, b"[" * 100_000, r"is not valid JSON"),
    (read_json, b"[1, 2]", r"must hold a JSON object, got list"),
    (read_json, b"1" * 5000, r"is not valid JSON: ValueError"),
    (read_toml, b"a = [" * 10_000, r"is not valid TOML"),
    (load_tokenizer, b'{"qkv_tokenizer": "char"}', r"KeyError: 'chars' \(expected a qkv char"),
    (load_tokenizer, b'{"model": {"type": "BPE"}}', r"expected a tokenizers library"),
], ids=["utf8", "deep-json", "json-list", "long-int", "deep-toml", "char-keys", "bpe-body"])
def test_json_toml_and_tokenizer_readers_name_the_file(tmp_path, reader, content, message):
    path = tmp_path / "file.json"
    path.write_bytes(content)
    with pytest.raises(BadFileError, match=message) as info:
        reader(path)
    assert info.value.path == path and str(path) in str(info.value)


def _evil(marker):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    return Evil()


@pytest.mark.parametrize("container", ["torch-zip", "raw-pickle"])
def test_a_pickle_that_would_run_code_is_refused(tmp_path, container):
    hf_llama(tmp_path, pickled=True)
    marker = tmp_path / "code-ran"
    state = {**torch.load(tmp_path / "pytorch_model.bin"), "model.norm.weight": _evil(marker)}
    if container == "torch-zip":
        torch.save(state, tmp_path / "pytorch_model.bin")
        message = r"refused: the pickle holds more than tensors \(.*posix\.system.*never runs code"
    else:
        (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(state))
        message = r"not a zip archive"
    with pytest.raises(BadFileError, match=message) as info:
        qkv.pretrained.load(tmp_path)
    assert "convert it to model.safetensors" in str(info.value)
    assert info.value.path == tmp_path / "pytorch_model.bin"
    assert not marker.exists(), "the payload ran"
    # The payload is live: unpickled without weights_only it does run (so the test can fail).
    if container == "torch-zip":
        torch.load(tmp_path / "pytorch_model.bin", weights_only=False)
    else:
        pickle.loads((tmp_path / "pytorch_model.bin").read_bytes())
    assert marker.exists()


# --- 2. a config is checked against the tensors' header before anything is built -----------


@pytest.fixture
def builds(monkeypatch):
    """The default device of every DecoderLM/Encoder construction ("meta" allocates nothing)."""
    devices: list[str] = []
    for cls in (DecoderLM, Encoder):
        def spy(self, *args, _init=cls.__init__, **kwargs):
            devices.append(torch.get_default_device().type)
            _init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", spy)
    return devices


def _refused_unbuilt(load, builds, message, path):
    builds.clear()  # writing the file built a model
    with hard_deadline(30), pytest.raises(BadFileError, match=message) as info:
        load()
    assert info.value.path == path and str(path) in str(info.value)
    assert set(builds) <= {"meta"}, f"a model was built on {builds} before the check"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("vocab_size", 10**12, r"vocab_size=1000000000000 cannot be right: .*model\.safetensors "
                           r"holds \d+ values in all"),
    ("num_layers", 10**7, r"num_layers=10000000 cannot be right: .* holds 21 tensors"),
    ("d_model", 2**30, r"d_model=1073741824 cannot be right"),
    ("max_len", 10**9, r"asks for 59\.6 GiB of computed buffers .*'blocks\.0\.self_attn\.rope"
                       r"\.cos_cached', has shape \(1000000000, 8\).*expected a smaller max_len"),
    ("vocab_size", 262, None),
], ids=["vocab", "layers", "width", "max_len", "vocab+1"])  # fmt: skip
def test_checkpoint_config_is_checked_before_building(tmp_path, builds, field, value, message):
    qkv_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_config"][field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / ("model.safetensors" if message is None else "config.json")
    message = message or (r"model\.safetensors: tensor 'embed\.weight' has shape \(261, 32\), "
                          r"the model expects \(262, 32\) \(the DecoderLM .*config\.json describes")
    _refused_unbuilt(lambda: load_checkpoint(tmp_path), builds, message, path)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("vocab_size", 10**12, r"config\.json: vocab_size=1000000000000 cannot be right"),
    ("num_hidden_layers", 10**7, r"config\.json: num_layers=10000000 cannot be right"),
    ("max_position_embeddings", 10**9, r"config\.json: the config asks for 59\.6 GiB"),
    ("intermediate_size", 65, r"model\.safetensors: misshaped tensor\(s\): 'model\.layers\.0\.mlp"
                              r"\.gate_proj\.weight' has shape \(64, 32\), expected \(65, 32\)"),
], ids=["vocab", "layers", "max_len", "d_ff+1"])  # fmt: skip
def test_hf_config_is_checked_before_building(tmp_path, builds, field, value, message):
    hf_llama(tmp_path, **{field: value})
    path = tmp_path / ("model.safetensors" if field == "intermediate_size" else "config.json")
    _refused_unbuilt(lambda: qkv.pretrained.load(tmp_path), builds, message, path)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("llama.block_count", 10**7, r"num_layers=10000000 cannot be right: .* holds 21 tensors"),
    ("llama.feed_forward_length", 10**12, r"d_ff=1000000000000 cannot be right"),
    ("llama.vocab_size", 10**12, r"vocab_size=1000000000000 cannot be right"),
    ("llama.context_length", 10**9, r"the config asks for 59\.6 GiB of computed buffers"),
    ("llama.block_count", 3, r"missing tensor\(s\) 'blk\.2\.attn_k\.weight'"),
], ids=["layers", "d_ff", "vocab", "max_len", "layers+1"])  # fmt: skip
def test_gguf_metadata_is_checked_before_building(tmp_path, builds, key, value, message):
    path = gguf_llama(tmp_path / "m.gguf", metadata={key: value})
    _refused_unbuilt(lambda: qkv.pretrained.load(path), builds, message, path)


def test_a_checked_config_still_loads(tmp_path, builds):
    hf_llama(tmp_path)
    builds.clear()
    qkv.pretrained.load(tmp_path)
    assert builds == ["meta", "cpu"], builds  # checked on meta, then built once for real


# --- 3. weights that are not finite are refused, naming the tensor --------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_names_the_tensor(dtype, bad):
    t = torch.zeros(3, 4, dtype=dtype)
    t[1, 2] = bad
    with pytest.raises(BadFileError, match=rf"f\.bin: tensor 'w' \(3, 4\) holds 1 NaN/infinite "
                                           rf"value\(s\) \(first at flat index 6, {bad}\)"):
        check_finite("w", t, "f.bin")
    check_finite("ids", torch.tensor([1, 2**40]), "f.bin")  # integers cannot be NaN
    check_finite("w", torch.zeros(0), "f.bin")


def _poison_safetensors(path, name):
    state = load_file(str(path))
    state[name] = state[name].clone()
    state[name].view(-1)[5] = float("nan")
    save_file(state, str(path))


def test_nan_in_a_checkpoint(tmp_path):
    qkv_checkpoint(tmp_path)
    _poison_safetensors(tmp_path / "model.safetensors", "blocks.1.ffn.up_proj.weight")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'blocks\.1\.ffn\.up_"
                                              r"proj\.weight' \(64, 32\) holds 1 NaN"):  # fmt: skip
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("pickled", [False, True], ids=["safetensors", "pytorch_model.bin"])
def test_nan_in_a_hf_folder(tmp_path, pickled):
    hf_llama(tmp_path, pickled=pickled)
    name = "model.layers.0.self_attn.v_proj.weight"
    if pickled:
        state = torch.load(tmp_path / "pytorch_model.bin")
        state[name][0, 1] = float("inf")
        torch.save(state, tmp_path / "pytorch_model.bin")
    else:
        _poison_safetensors(tmp_path / "model.safetensors", name)
    with pytest.raises(BadFileError, match=rf"tensor '{name}' \(16, 32\) holds 1 NaN/infinite"):
        qkv.pretrained.load(tmp_path)


def test_gguf_block_with_a_nan_scale(tmp_path):
    import gguf

    path = gguf_llama(tmp_path / "q8.gguf", quantized=True)
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight")
    assert tensor.tensor_type.name == "Q8_0"
    offset = int(tensor.data_offset) + 34 * 3  # the 4th block: a float16 scale, 32 int8 weights
    del reader
    data = bytearray(path.read_bytes())
    data[offset:offset + 2] = struct.pack("<e", float("nan"))
    path.write_bytes(bytes(data))
    with pytest.raises(BadFileError, match=r"q8\.gguf: GGUF tensor \(Q8_0\) 'blk\.1\.attn_q\."
                                           r"weight' \(32, 32\) holds 32 NaN/infinite value\(s\) "
                                           r"\(first at flat index 96"):  # fmt: skip
        qkv.pretrained.load(path)
