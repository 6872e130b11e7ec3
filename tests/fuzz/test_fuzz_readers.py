"""Every file reader qkv has, fed random bytes, truncations, bit flips and hostile JSON values.

Readers: qkv checkpoint folders (``load_checkpoint``, with and without a model and optimizer to
fill), Hugging Face folders (Llama with safetensors or a pickled ``pytorch_model.bin``; BERT
with the sentence-transformers files), GGUF files (float32 and Q8_0), qkv's tokenizer files,
and the JSON/TOML readers. Each example copies a tiny valid file set (tests/fuzz/tiny_files.py),
changes one file, and loads. The only outcomes allowed:

* a load (whose weights are then all finite), or
* a :class:`qkv.data.files.BadFileError` whose message names the changed file;

never another exception (a crash deep inside a library, a MemoryError), a hang (each load runs
under :func:`hard_deadline`), resident memory beyond what the files justify, or code run from
a file (a payload is tried in tests/pretrained/test_hostile_files.py).

``make test`` runs the quick profile (25 examples per case); ``make fuzz`` the long one.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv.pretrained
from fuzz.tiny_files import (
    OUTCOMES,
    PeakMemory,
    gguf_llama,
    hard_deadline,
    hf_bert,
    hf_llama,
    qkv_checkpoint,
    tiny_lm,
    tokenizer_files,
)
from qkv.checkpoint import load_checkpoint
from qkv.checkpoint.backing import DERIVED_FLOOR
from qkv.data.files import BadFileError, read_json, read_toml
from qkv.data.tokenizers import load_tokenizer

DEADLINE_S = 30.0  # generous: two cores are shared; a real hang runs far longer
# Resident memory a load may add: the computed-buffer floor, room for first-use library
# initialisation, and a multiple of the files' size (dequantised GGUF is ~8x its Q8_0 blocks).
MEMORY_SLACK = DERIVED_FLOOR + 256 * 2**20
FUZZ = settings.get_profile("qkv-readers")


# --- the valid files every example starts from (built once per worker) -----------------------


def _with_optimizer(folder: Path) -> object:
    model = tiny_lm()
    return load_checkpoint(folder, model, optimizer=torch.optim.AdamW(model.parameters()))


def _json_or_toml(folder: Path, changed: Path) -> object:
    return (read_toml if changed.suffix == ".toml" else read_json)(changed)


@dataclass(frozen=True)
class Family:
    """Files of one reader: the base folder, the files changed, and how to load."""

    base: str
    files: tuple[str, ...]
    load: Callable[[Path, Path], object]  # (copied folder, changed file) -> result


FAMILIES = {
    "checkpoint": Family("checkpoint", (
        "config.json", "model.safetensors", "tokenizer-text.json", "train_state.json",
        "train_state.safetensors",
    ), lambda folder, changed: load_checkpoint(folder)),
    "checkpoint+optimizer": Family("checkpoint", (
        "config.json", "model.safetensors", "train_state.json", "train_state.safetensors",
    ), lambda folder, changed: _with_optimizer(folder)),
    "hf-llama": Family("hf-llama", (
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ), lambda folder, changed: qkv.pretrained.load(folder)),
    "hf-bert": Family("hf-bert", (
        "config.json", "model.safetensors", "vocab.txt", "modules.json",
        "1_Pooling/config.json", "sentence_bert_config.json",
    ), lambda folder, changed: qkv.pretrained.load(folder)),
    "hf-pickle": Family("hf-pickle", ("pytorch_model.bin",),
                        lambda folder, changed: qkv.pretrained.load(folder)),
    "gguf": Family("gguf", ("m.gguf",), lambda folder, changed: qkv.pretrained.load(changed)),
    "gguf-q8": Family("gguf-q8", ("m.gguf",), lambda folder, changed: qkv.pretrained.load(changed)),
    "tokenizers": Family("tokenizers", ("char.json", "byte.json", "bpe.json", "wordpiece.json"),
                         lambda folder, changed: load_tokenizer(changed)),
    "json-toml": Family("json-toml", ("run.json", "run.toml"), _json_or_toml),
}  # fmt: skip
JSON_FAMILIES = ("checkpoint", "checkpoint+optimizer", "hf-llama", "hf-bert", "tokenizers")


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    folders = {
        "checkpoint": qkv_checkpoint(root / "checkpoint", training=True),
        "hf-llama": hf_llama(root / "hf-llama"),
        "hf-bert": hf_bert(root / "hf-bert"),
        "hf-pickle": hf_llama(root / "hf-pickle", pickled=True),
    }
    for name, quantized in (("gguf", False), ("gguf-q8", True)):
        (root / name).mkdir()
        gguf_llama(root / name / "m.gguf", quantized=quantized)
        folders[name] = root / name
    tokenizer_files(root / "tokenizers")
    folders["tokenizers"] = root / "tokenizers"
    (root / "json-toml").mkdir()
    (root / "json-toml" / "run.json").write_text(json.dumps({"model": {"d_model": 32},
                                                             "steps": [1, 2.5, None]}))
    (root / "json-toml" / "run.toml").write_text(
        '[model]\nd_model = 32\nname = "tiny"\n[train]\nsteps = 100\nlr = 1e-3\n')
    folders["json-toml"] = root / "json-toml"
    return folders


# --- mutations -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutation:
    """One change to a file's bytes: ``kind`` at offset ``at`` (``bits`` for flips)."""

    kind: str
    at: int = 0
    data: bytes = b""
    bits: tuple[tuple[int, int], ...] = ()

    def apply(self, blob: bytes) -> bytes:
        if self.kind == "truncate":
            return blob[: self.at]
        if self.kind == "flip":
            out = bytearray(blob)
            for pos, bit in self.bits:
                out[pos] ^= 1 << bit
            return bytes(out)
        if self.kind == "overwrite":
            return blob[: self.at] + self.data + blob[self.at + len(self.data):]
        if self.kind == "insert":
            return blob[: self.at] + self.data + blob[self.at:]
        if self.kind == "delete":
            return blob[: self.at] + blob[self.at + len(self.data):]
        return self.data  # "replace": the whole file is random bytes


def mutations(size: int, hot: int) -> st.SearchStrategy[Mutation]:
    """Changes to a ``size``-byte file; offsets favour the first ``hot`` bytes (the header)."""
    at = st.one_of(st.integers(0, max(hot - 1, 0)), st.integers(0, size - 1))
    junk = st.binary(min_size=1, max_size=24)
    numbers = st.sampled_from([b"\xff" * 8, b"\x00" * 8, struct.pack("<Q", 10**12),
                               struct.pack("<Q", 2**63), b"9" * 12, b"-1", b"1e999"])  # fmt: skip
    return st.one_of(
        st.builds(Mutation, st.just("truncate"), st.integers(0, size - 1)),
        st.builds(Mutation, st.just("flip"), bits=st.lists(
            st.tuples(at, st.integers(0, 7)), min_size=1, max_size=8).map(tuple)),
        st.builds(Mutation, st.just("overwrite"), at, st.one_of(junk, numbers)),
        st.builds(Mutation, st.just("insert"), at, junk),
        st.builds(Mutation, st.just("delete"), at, junk),
        st.builds(Mutation, st.just("replace"), data=st.binary(max_size=300)),
    )


def _hot(path: Path, blob: bytes) -> int:
    """Bytes at the start of a file where a change reaches the structure, not just values."""
    if path.suffix == ".safetensors" and len(blob) >= 8:
        return 8 + struct.unpack("<Q", blob[:8])[0]
    if path.suffix == ".gguf":
        import gguf

        return int(gguf.GGUFReader(str(path)).data_offset)
    if path.suffix == ".bin":
        return len(blob) // 4
    return len(blob)


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(),
    st.sampled_from([0, -1, 1, 2, 3, 7, 65, 10**7, 10**12, 2**31, 2**63, 2**64 + 1, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=10),
    st.sampled_from(["llama", "bert", "gpt2", "rope", "DecoderLM", "Encoder", "", "../../x",
                     "config.json", "model.safetensors", "Pooling", "BPE", "char"]),
)  # fmt: skip
JSON_VALUES = st.recursive(
    _SCALARS, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8,
)  # fmt: skip
KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_scaling",
        "rope_parameters", "max_position_embeddings", "model_class", "model_config", "tied",
        "tokenizers", "training", "optimizer", "chars", "model", "path", "type",
        "chat_template", "max_seq_length", "position_embedding_type")  # fmt: skip


def _paths(doc: object, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value in a JSON document (dict keys and list indices)."""
    out = [prefix]
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        out += _paths(value, (*prefix, key))
    return out


def _edit(doc: object, path: tuple, action: str, value: object, key: str) -> object:
    if not path:
        return value if action == "set" else doc
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if action == "set":
        parent[last] = value
    elif action == "delete":
        del parent[last]
    elif isinstance(parent[last], dict):  # "add": a new or replaced key under the path
        parent[last][key] = value
    else:
        parent[last] = value
    return doc


# --- the outcome check -----------------------------------------------------------------------


def _models(result: object) -> list[torch.nn.Module]:
    model = getattr(result, "model", None)
    return [model] if isinstance(model, torch.nn.Module) else []


def _names_the_file(message: str, changed: Path, folder: Path) -> bool:
    # The file itself, or its folder together with its name ("<folder>/a.json + b.safetensors")
    return str(changed) in message or (str(folder) in message and changed.name in message)


def check_outcome(load: Callable[[], object], changed: Path, folder: Path) -> None:
    files_bytes = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    peak = PeakMemory()
    peak.reset()
    try:
        with hard_deadline(DEADLINE_S):
            result = load()
    except BadFileError as err:
        assert _names_the_file(str(err), changed, folder), f"the error does not name {changed}: {err}"
        OUTCOMES["refused"] += 1
    else:
        for model in _models(result):
            for name, t in model.state_dict().items():
                assert not t.is_floating_point() or bool(torch.isfinite(t).all()), (
                    f"loaded with a non-finite {name!r} from changed {changed.name}")
        OUTCOMES["loaded"] += 1
    added = peak.added()
    assert added is None or added <= MEMORY_SLACK + 16 * files_bytes, (
        f"loading changed {changed.name} added {added / 2**20:.0f} MiB of resident memory for "
        f"{files_bytes} bytes of files")


def _run(bases: dict[str, Path], family: Family, rel: str, change: Callable[[bytes], bytes]
         ) -> None:  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "m"
        shutil.copytree(bases[family.base], folder)
        changed = folder / rel
        changed.write_bytes(change(changed.read_bytes()))
        check_outcome(lambda: family.load(folder, changed), changed, folder)


# --- the fuzzers ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
@settings(FUZZ)
@given(data=st.data())
def test_random_bytes_truncations_and_bit_flips(bases, name, data):
    family = FAMILIES[name]
    rel = data.draw(st.sampled_from(family.files), label="file")
    path = bases[family.base] / rel
    blob = path.read_bytes()
    mutation = data.draw(mutations(len(blob), _hot(path, blob)), label="mutation")
    _run(bases, family, rel, mutation.apply)


@pytest.mark.parametrize("name", JSON_FAMILIES)
@settings(FUZZ)
@given(data=st.data())
def test_hostile_json_values(bases, name, data):
    family = FAMILIES[name]
    rel = data.draw(st.sampled_from([f for f in family.files if f.endswith(".json")]),
                    label="file")  # fmt: skip
    doc = json.loads((bases[family.base] / rel).read_text())
    path = data.draw(st.sampled_from(_paths(doc)), label="path")
    action = data.draw(st.sampled_from(["set", "delete", "add"] if path else ["set", "add"]),
                       label="action")  # fmt: skip
    value = data.draw(JSON_VALUES, label="value")
    key = data.draw(st.sampled_from(KEYS), label="key")
    text = json.dumps(_edit(doc, path, action, value, key), allow_nan=True)
    _run(bases, family, rel, lambda blob: text.encode())
