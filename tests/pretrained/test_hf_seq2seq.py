"""Hugging Face encoder-decoder folders (BART, Marian, T5), made in the test from random models.

transformers builds each model with random weights and saves it with ``save_pretrained``; a tiny
word-level ``tokenizer.json`` is written beside it. qkv loads the folder and must give the same
logits (<= 1e-4, float32, padded batches) and the same tokens as transformers' ``generate``
with explicit settings: greedy, and beam search with 3 and 4 beams (``length_penalty=0``, the
ranking qkv's ``alpha=0`` uses; ``early_stopping=False``; no forced BOS/EOS, no n-gram
blocking), and the same attention weights under ``qkv.inspect.capture``. Texts go through
``translate`` and ``qkv translate --model``; an Opus-MT folder's sentencepiece files give
transformers' ``MarianTokenizer`` ids and texts. Broken folders fail naming the file and the
tensor or option.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from pretrained_refs import need
from typer.testing import CliRunner

from helpers import assert_close
from qkv.cli.app import app
from qkv.data.files import BadFileError
from qkv.generate import beam_search, greedy
from qkv.pretrained.hf.seq2seq import load_hf_seq2seq_folder
from qkv.pretrained.seq2seq_bundle import Seq2SeqBundle

runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})
V = 96
SIZES = dict(d_model=32, layers=2, heads=4, ffn=64)
# special tokens of each family: (id -> text), the source framing, and an EOS logit boost
# (final_logits_bias) so that beams end at different lengths; T5's run to the length limit
FAMILIES = {
    "bart": dict(special={0: "<s>", 1: "<pad>", 2: "</s>", 3: "<unk>"}, frame="<s> $A </s>",
                 eos_boost=0.5),
    "marian": dict(special={0: "</s>", 1: "<unk>", V - 1: "<pad>"}, frame="$A </s>",
                   eos_boost=1.0),
    "t5": dict(special={0: "<pad>", 1: "</s>", 2: "<unk>"}, frame="$A </s>"),
    "t5-gated": dict(special={0: "<pad>", 1: "</s>", 2: "<unk>"}, frame="$A </s>"),
}
SOURCES = ["w5 w6 w7 w8 w9", "w10 w11 w12", "w20 w21 w22 w23 w24 w25 w26 w27 w28 w29 w30"]


def _hf_model(family: str, V: int = V):
    tf = need("transformers")
    s = SIZES
    if family == "bart":
        cfg = tf.BartConfig(vocab_size=V, d_model=s["d_model"], encoder_layers=s["layers"],
                            decoder_layers=s["layers"] + 1, encoder_attention_heads=s["heads"],
                            decoder_attention_heads=s["heads"], encoder_ffn_dim=s["ffn"],
                            decoder_ffn_dim=s["ffn"], max_position_embeddings=64, init_std=0.15)
        return tf.BartForConditionalGeneration(cfg)
    if family == "marian":
        cfg = tf.MarianConfig(vocab_size=V, d_model=s["d_model"], encoder_layers=s["layers"],
                              decoder_layers=s["layers"], encoder_attention_heads=s["heads"],
                              decoder_attention_heads=s["heads"], encoder_ffn_dim=s["ffn"],
                              decoder_ffn_dim=s["ffn"], max_position_embeddings=64,
                              init_std=0.15, pad_token_id=V - 1, decoder_start_token_id=V - 1,
                              eos_token_id=0, scale_embedding=True,
                              activation_function="swish")
        return tf.MarianMTModel(cfg)
    cfg = tf.T5Config(vocab_size=V, d_model=s["d_model"], d_kv=6, d_ff=s["ffn"],
                      num_layers=s["layers"], num_decoder_layers=s["layers"],
                      num_heads=s["heads"], relative_attention_num_buckets=8,
                      relative_attention_max_distance=20, initializer_factor=1.0,
                      decoder_start_token_id=0,
                      feed_forward_proj="gated-gelu" if family == "t5-gated" else "relu")
    return tf.T5ForConditionalGeneration(cfg)


def _tokenizer(folder: Path, family: str) -> None:
    """A word-level tokenizer.json: ``w<i>`` is id ``i``, the family's special tokens."""
    tk = need("tokenizers")
    special = FAMILIES[family]["special"]
    vocab = {special.get(i, f"w{i}"): i for i in range(V)}
    tok = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(special.values()))
    frame = FAMILIES[family]["frame"]
    tok.post_processor = tk.processors.TemplateProcessing(
        single=frame, special_tokens=[(t, vocab[t]) for t in ("<s>", "</s>") if t in frame])
    tok.save(str(folder / "tokenizer.json"))
    names = {"<s>": "bos_token", "</s>": "eos_token", "<pad>": "pad_token", "<unk>": "unk_token"}
    config = {names[t]: t for t in special.values()}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@cache
def _folder(family: str, root: Path) -> tuple[Path, object]:
    """The saved folder of ``family`` and transformers' model (built once per process)."""
    torch.manual_seed(0)
    ref = _hf_model(family).eval()
    with torch.no_grad():
        if hasattr(ref, "final_logits_bias"):
            ref.final_logits_bias[0, ref.config.eos_token_id] = FAMILIES[family]["eos_boost"]
    folder = root / family
    ref.save_pretrained(folder)
    _tokenizer(folder, family)
    return folder, ref


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_seq2seq")


def _load(folder: Path) -> Seq2SeqBundle:
    return load_hf_seq2seq_folder(folder, json.loads((folder / "config.json").read_text()))


def _batch(bundle: Seq2SeqBundle) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    rows = [bundle.tokenizer.encode(t) for t in SOURCES]
    S = max(len(r) for r in rows)
    ids = torch.full((len(rows), S), bundle.config.pad_id)  # (B, S) right-padded
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
    return rows, ids, (ids != bundle.config.pad_id).long()


def _cut(rows, eos: int) -> list[list[int]]:
    """Each row up to and including its first EOS (padding after it dropped)."""
    out = []
    for row in rows.tolist():
        out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(root, family):
    folder, ref = _folder(family, root)
    bundle = _load(folder)
    assert isinstance(bundle, Seq2SeqBundle)
    assert bundle.source["model_type"] == family.split("-")[0]
    _, src, keep = _batch(bundle)
    tgt = torch.randint(3, V - 1, (3, 9), generator=torch.Generator().manual_seed(1))
    tgt[:, 0] = ref.config.decoder_start_token_id or 0
    with torch.no_grad():
        expected = ref(input_ids=src, attention_mask=keep, decoder_input_ids=tgt).logits
        memory = ref.get_encoder()(input_ids=src, attention_mask=keep).last_hidden_state
        ours = bundle.model(src, tgt)
        assert_close(bundle.model.encode(src), memory, atol=1e-4, name=f"{family} encoder")
    assert_close(ours, expected, atol=1e-4, name=f"{family} logits")


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_and_beam_search_match_transformers(root, family):
    folder, ref = _folder(family, root)
    bundle = _load(folder)
    rows, src, keep = _batch(bundle)
    eos, n = bundle.config.eos_id, 24
    off = dict(do_sample=False, forced_bos_token_id=None, forced_eos_token_id=None,
               no_repeat_ngram_size=0, repetition_penalty=1.0, min_length=0,
               max_new_tokens=n, attention_mask=keep)  # fmt: skip
    with torch.no_grad():
        expected = _cut(ref.generate(src, num_beams=1, **off)[:, 1:], eos)
    assert _cut(greedy(bundle.model, rows, max_new_tokens=n), eos) == expected, "greedy"
    assert any(len(r) > 1 for r in expected), "a trivial test: every output is EOS alone"
    for K in (3, 4):
        with torch.no_grad():
            out = ref.generate(src, num_beams=K, length_penalty=0.0, early_stopping=False, **off)
        expected = _cut(out[:, 1:], eos)
        ours = _cut(beam_search(bundle.model, rows, beam_size=K, max_new_tokens=n, alpha=0.0),
                    eos)  # fmt: skip
        assert ours == expected, f"beam search with {K} beams"
        assert ours != [[eos]] * len(rows), "a trivial test: every output is EOS alone"


@pytest.mark.parametrize("family", ["bart", "marian", "t5"])
def test_translate_text_and_the_command_line(root, family):
    folder, ref = _folder(family, root)
    bundle = _load(folder)
    texts = SOURCES[:2]
    ours = bundle.translate(texts, max_new_tokens=12)
    _, src, keep = _batch(bundle)
    with torch.no_grad():
        # the folder's generation_config.json (forced EOS at the limit) applies to both
        out = ref.generate(src[:2], attention_mask=keep[:2], do_sample=False, num_beams=1,
                           max_new_tokens=12, forced_bos_token_id=None)  # fmt: skip
    assert ours == [bundle.tokenizer.decode(r, skip_special_tokens=True) for r in out]
    assert bundle.generate(texts[0], 12) == ours[0]
    result = runner.invoke(app, ["translate", "--model", str(folder), "--max-new-tokens", "12",
                                 *texts])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ours


@pytest.mark.parametrize("family", ["bart", "marian"])
def test_compiled_translation_equals_eager(root, family):
    """A static cache with the steps through torch.compile gives the same text, from Python
    and from ``qkv translate --compile``; beam search and T5 (relative biases) are refused."""
    folder, _ = _folder(family, root)
    bundle = _load(folder)
    texts = SOURCES[:2]
    want = bundle.translate(texts, max_new_tokens=12)
    assert bundle.translate(texts, max_new_tokens=12, compile=True) == want
    with pytest.raises(ValueError, match="does not serve beam search"):
        bundle.translate(texts, beam_size=2, compile=True)
    if family == "marian":
        result = runner.invoke(app, ["translate", "--model", str(folder), "--max-new-tokens",
                                     "12", "--compile", *texts])  # fmt: skip
        assert result.exit_code == 0, result.output
        assert result.stdout.splitlines() == want
    t5 = _load(_folder("t5", root)[0])
    with pytest.raises(ValueError, match="static cache does not support"):
        t5.translate(texts, max_new_tokens=4, compile=True)


def test_bundle_takes_token_ids_and_refuses_bad_input(root):
    folder, _ = _folder("bart", root)
    bundle = _load(folder)
    ids = bundle.tokenizer.encode(SOURCES[0])
    assert bundle.generate_ids([ids], max_new_tokens=8) == bundle.generate_ids([SOURCES[0]],
                                                                               max_new_tokens=8)
    with pytest.raises(TypeError, match="texts\\[1\\] must be a str"):
        bundle.translate(["ok", 3])
    with pytest.raises(ValueError, match="at least one"):
        bundle.translate([])
    with pytest.raises(ValueError, match="max_new_tokens"):
        bundle.translate("w5", max_new_tokens=0)


def _copy(folder: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in folder.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def test_broken_folders_name_the_file_and_what_is_wrong(root, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = _folder("bart", root)
    missing = _copy(folder, tmp_path / "missing")
    state = load_file(missing / "model.safetensors")
    del state["model.decoder.layers.1.fc2.bias"]
    save_file(state, missing / "model.safetensors")
    with pytest.raises(BadFileError, match=r"missing tensor.*model\.decoder\.layers\.1\.fc2\.bias"):
        _load(missing)
    state["model.decoder.layers.1.fc2.bias"] = torch.zeros(SIZES["d_model"])
    state["model.encoder.adapter.weight"] = torch.zeros(3)
    save_file(state, missing / "model.safetensors")
    with pytest.raises(BadFileError, match=r"unexpected tensor.*model\.encoder\.adapter\.weight"):
        _load(missing)
    bad_config = _copy(folder, tmp_path / "prenorm")
    hf = json.loads((bad_config / "config.json").read_text())
    hf["add_final_layer_norm"] = True
    (bad_config / "config.json").write_text(json.dumps(hf))
    with pytest.raises(BadFileError, match=r"config\.json.*add_final_layer_norm"):
        _load(bad_config)
    marian, _ = _folder("marian", root)
    split = _copy(marian, tmp_path / "split")
    hf = json.loads((split / "config.json").read_text())
    hf["share_encoder_decoder_embeddings"] = False
    (split / "config.json").write_text(json.dumps(hf))
    with pytest.raises(BadFileError, match="separate source and target vocabularies"):
        _load(split)
    t5, _ = _folder("t5", root)
    odd = _copy(t5, tmp_path / "odd")
    hf = json.loads((odd / "config.json").read_text())
    hf["feed_forward_proj"] = "gated-gelu-relu"
    (odd / "config.json").write_text(json.dumps(hf))
    with pytest.raises(BadFileError, match="feed_forward_proj='gated-gelu-relu'"):
        _load(odd)


@pytest.mark.parametrize("edit, match", [
    ({"pad_token_id": V}, rf"pad_token_id={V} must be an int in \[0, vocab_size={V}\)"),
    ({"pad_token_id": -1}, r"pad_token_id=-1 must be an int"),
    ({"pad_token_id": "95"}, r"pad_token_id='95' must be an int"),
    ({"scale_embedding": "no"}, r"scale_embedding='no' must be true or false"),
    ({"tie_word_embeddings": "false"}, r"tie_word_embeddings='false' must be true or false"),
    ({"normalize_before": 1}, r"normalize_before=1 must be true or false"),
])
def test_a_config_that_lies_about_its_types_is_refused(root, tmp_path, edit, match):
    """Issue 31: a Marian pad_token_id outside the vocabulary (the embeddings' padding row)
    or a string where a boolean belongs loaded as some other model; transformers refuses
    both. Each is named with config.json before anything is built."""
    marian, _ = _folder("marian", root)
    bad = _copy(marian, tmp_path / "bad")
    hf = json.loads((bad / "config.json").read_text()) | edit
    (bad / "config.json").write_text(json.dumps(hf))
    with pytest.raises(BadFileError, match=r"config\.json.*" + match):
        _load(bad)


def _opus_mt_folder(folder: Path) -> int:
    """Opus-MT's tokenizer files: ``source.spm`` = ``target.spm`` (a tiny sentencepiece model
    trained here) and ``vocab.json`` (``</s>`` 0, ``<unk>`` 1, the pieces, ``<pad>`` last).
    Returns the vocabulary size."""
    spm = need("sentencepiece", "pip install sentencepiece")
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(["the cat sat on the mat", "a dog ran in the park",
                                  "attention is all you need", "translate this sentence now",
                                  "Größe café naïve", "numbers 12 345"] * 20))  # fmt: skip
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "sp"),
                                   vocab_size=45, character_coverage=1.0,
                                   minloglevel=2)  # fmt: skip
    model = (folder / "sp.model").read_bytes()
    (folder / "source.spm").write_bytes(model)
    (folder / "target.spm").write_bytes(model)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "sp.model"))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())
              if not (sp.is_control(i) or sp.is_unknown(i))]  # fmt: skip
    vocab = {"</s>": 0, "<unk>": 1, ">>fra<<": 2}
    vocab.update({p: i + 3 for i, p in enumerate(pieces)})
    vocab["<pad>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    return len(vocab)


OPUS_TEXTS = ["the cat sat on the mat", "a dog ran in the café", ">>fra<< attention is all",
              "unseen words: zebra Ω", ""]  # fmt: skip


@pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
def test_opus_mt_folder_with_sentencepiece_files(tmp_path):
    tf = need("transformers")
    folder = tmp_path / "opus-mt-tiny"
    n = _opus_mt_folder(folder)
    ref_tok = tf.MarianTokenizer(str(folder / "source.spm"), str(folder / "target.spm"),
                                 str(folder / "vocab.json"))  # fmt: skip
    torch.manual_seed(0)
    cfg = dict(pad_token_id=n - 1, decoder_start_token_id=n - 1, eos_token_id=0)
    ref = _hf_model("marian", V=n).eval()
    ref.config.update(cfg)
    ref.generation_config.update(**cfg)
    ref.save_pretrained(folder)
    bundle = _load(folder)
    tok = bundle.tokenizer
    for text in OPUS_TEXTS:
        assert tok.encode(text) == ref_tok(text).input_ids, text
    ids = [5, 9, 2, 1, 17, 0, n - 1, 30]
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == \
            ref_tok.decode(ids, skip_special_tokens=skip), skip  # fmt: skip
    texts = OPUS_TEXTS[:3]
    batch = ref_tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = ref.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=10)
    expected = ref_tok.batch_decode(out, skip_special_tokens=True)
    assert bundle.translate(texts, max_new_tokens=10) == expected
    assert all(expected), expected  # real text, not empty strings


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_load_dispatches_and_qkv_checkpoints_round_trip(root, tmp_path, family):
    import qkv.pretrained
    from qkv.checkpoint import load_checkpoint, save_checkpoint

    folder, _ = _folder(family, root)
    bundle = qkv.pretrained.load(folder)
    assert isinstance(bundle, Seq2SeqBundle) and bundle.name == str(folder)
    save_checkpoint(tmp_path / "ckpt", bundle.model)
    again = load_checkpoint(tmp_path / "ckpt").model.eval()
    assert again.config == bundle.config
    _, src, _ = _batch(bundle)
    tgt = torch.tensor([[bundle.config.bos_id, 7, 8]] * 3)
    with torch.no_grad():
        assert_close(again(src, tgt), bundle.model(src, tgt), atol=0.0, name="round trip")


MARKUP = "no[/such]model"  # rich would read "[/such]" as a closing tag


def test_translate_command_refuses_bad_models_in_one_line(root, tmp_path):
    from qkv.checkpoint import save_checkpoint
    from qkv.data import CharTokenizer
    from qkv.models import DecoderLM, DecoderLMConfig

    tok = CharTokenizer.fit("the cat")
    lm = DecoderLM(DecoderLMConfig(tok.vocab_size, d_model=16, num_layers=1, num_heads=2))
    save_checkpoint(tmp_path / "lm", lm, tokenizers={"text": tok})
    folder, _ = _folder("bart", root)
    cases = [
        (["--model", MARKUP, "x"], [MARKUP]),
        (["--model", str(tmp_path / "lm"), "x"], ["DecoderLM", "not an encoder-decoder"]),
        (["--model", str(folder)], ["give at least one text to translate", "--input FILE"]),
        (["--model", str(folder), "x", "--beam", "0"], ["--beam"]),
        (["--model", str(folder), "x", "--beam", "2", "--compile"], ["--compile", "--beam 2"]),
        (["--model", str(_folder("t5", root)[0]), "x", "--compile"],
         ["static cache does not support"]),
        ([], ["CHECKPOINT", "--model"]),
    ]
    for args, words in cases:
        result = runner.invoke(app, ["translate", *args])
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code != 0 and len(lines) == 1, (args, result.output)
        assert lines[0].startswith("error: ") and all(w in lines[0] for w in words), lines[0]


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_captured_attention_weights_match_transformers(root, family):
    """qkv.inspect.capture on a loaded model: outputs unchanged, every self- and
    cross-attention's weights equal transformers' ``output_attentions`` (T5's relative bias
    and the padding included)."""
    from qkv.inspect import capture

    folder, ref = _folder(family, root)
    bundle = _load(folder)
    _, src, keep = _batch(bundle)
    tgt = torch.tensor([[bundle.config.bos_id, 7, 8, 9]] * 3)
    ref.set_attn_implementation("eager")  # the implementation that returns weights
    try:
        with torch.no_grad():
            expected = ref(input_ids=src, attention_mask=keep, decoder_input_ids=tgt,
                           output_attentions=True)  # fmt: skip
            plain = bundle.model(src, tgt)
            with capture(bundle.model) as cap:
                out = bundle.model(src, tgt)
    finally:
        ref.set_attn_implementation("sdpa")
    assert_close(out, plain, atol=0.0, name="outputs under capture")
    kinds = {"encoder_blocks.{}.self_attn": expected.encoder_attentions,
             "decoder_blocks.{}.self_attn": expected.decoder_attentions,
             "decoder_blocks.{}.cross_attn": expected.cross_attentions}
    for pattern, ref_weights in kinds.items():
        for i, w in enumerate(ref_weights):
            name = pattern.format(i)
            assert_close(cap[name], w, atol=1e-5, name=f"{family} {name} weights")


@pytest.mark.parametrize(("family", "copies"), [
    ("bart", ["model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
              "lm_head.weight"]),
    ("marian", ["model.encoder.embed_tokens.weight", "lm_head.weight",
                "model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"]),
    ("t5", ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"]),
])  # fmt: skip
def test_files_with_tied_copies_and_computed_tables_load_the_same(root, tmp_path, family, copies):
    """Older files also store copies of the tied embedding (and Marian's computed position
    table); they are not read, and the model is the same."""
    from safetensors.torch import load_file, save_file

    folder, _ = _folder(family, root)
    older = _copy(folder, tmp_path / "older")
    state = load_file(older / "model.safetensors")
    shared = state["model.shared.weight" if family != "t5" else "shared.weight"]
    for name in copies:
        state[name] = torch.zeros(64, shared.shape[1]) if "positions" in name else shared.clone()
    save_file(state, older / "model.safetensors")
    src, tgt = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[3, 9, 10]])
    with torch.no_grad():
        assert_close(_load(older).model(src, tgt), _load(folder).model(src, tgt), atol=0.0,
                     name=f"{family} with copies")  # fmt: skip
