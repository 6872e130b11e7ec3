"""Whisper from a CTranslate2 folder (``model.bin`` + ``config.json`` + ``tokenizer.json``) on
qkv's :class:`~qkv.models.speech.SpeechSeq2Seq`, and the bundle that transcribes audio.

The name map (CTranslate2's ``WhisperSpec`` -> qkv), per layer ``i``:

    encoder/conv{1,2}/{weight,bias}                  conv{1,2}.{weight,bias}
    encoder/position_encodings/encodings             encoder_pos (checked against the formula)
    {enc,dec}oder/layer_i/self_attention/linear_0    self_attn.{q,k,v}_proj  (fused rows q|k|v)
    {enc,dec}oder/layer_i/self_attention/linear_1    self_attn.out_proj
    decoder/layer_i/attention/linear_0               cross_attn.q_proj
    decoder/layer_i/attention/linear_1               cross_attn.{k,v}_proj   (fused rows k|v)
    decoder/layer_i/attention/linear_2               cross_attn.out_proj
    .../self_attention/layer_norm, attention/layer_norm, ffn/layer_norm
                                                     attn_norm, cross_norm, ffn_norm
    .../ffn/linear_{0,1}                             ffn.linear{1,2}
    {enc,dec}oder/layer_norm                         {enc,dec}oder_norm
    decoder/embeddings/weight                        tgt_embed.weight = lm_head.weight (tied;
                                                     decoder/projection/weight is its alias)
    decoder/position_encodings/encodings             tgt_pos.weight

Whisper's key projections have no bias: qkv builds them without (``SpeechSeq2SeqConfig.k_bias``
False, passed to :class:`~qkv.nn.Attention`); the converter filled the fused bias with zeros
there, and the loader refuses a file whose key-bias rows are not zero. Scalar options are checked
(GELU, pre-norm, no ALiBi, unscaled embeddings) and anything else refused by name.
Weights are stored in float16 and computed in float32.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.checkpoint.tensor_file import check_finite
from qkv.data.files import BadFileError, MissingFileError, read_json, reading
from qkv.generate.beam import beam_search
from qkv.generate.search import greedy, strip
from qkv.generate.session import EncodedInputs, MemorySession
from qkv.models.speech import SpeechSeq2Seq, SpeechSeq2SeqConfig, speech_sinusoids
from qkv.pretrained.errors import require
from qkv.pretrained.tokenizer import PretrainedTokenizer
from qkv.pretrained.weights import Entry, check_entries, load_entries, skip_init
from qkv.pretrained.whisper import audio as audio_mod
from qkv.pretrained.whisper.ct2_reader import CT2File, read_ct2
from qkv.pretrained.whisper.decode import Vocab
from qkv.pretrained.whisper.longform import stream_segments, transcribe_all
from qkv.pretrained.whisper.options import TranscribeOptions
from qkv.pretrained.whisper.transcript import Segment, Transcript

__all__ = ["SpeechBundle", "load_whisper_bundle", "load_whisper_ct2", "whisper_entries"]

# Scalars of WhisperSpec and the values qkv's model computes (None: any value, unused).
_OPTIONS = {
    "decoder/activation": 3,  # CTranslate2's Activation.GELU (the erf form)
    "decoder/alibi": 0,
    "decoder/pre_norm": 1,
    "decoder/scale_embeddings": 0,
    "decoder/start_from_zero_embedding": 0,
    "decoder/alignment_heads": None,
    "decoder/alignment_layer": None,
    "decoder/num_heads": None,
    "encoder/num_heads": None,
}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _split(rows: int, parts: int, index: int):
    """Transform taking block ``index`` of ``parts`` equal row blocks of a fused tensor."""
    return lambda t: t[index * rows // parts : (index + 1) * rows // parts]


def _attention(src: str, dst: str, E: int, fused: int, k_bias: bool) -> list[Entry]:
    """Entries of one attention: ``fused`` = 3 (self: q|k|v in linear_0) or 2 (cross: q in
    linear_0, k|v in linear_1). The key rows of a fused bias go nowhere unless ``k_bias``
    (the converter wrote zeros there; :func:`_check_file` makes sure they are)."""
    names = ("q_proj", "k_proj", "v_proj")
    out: list[Entry] = []
    if fused == 3:
        groups = [(f"{src}/linear_0", names)]
        last = f"{src}/linear_1"
    else:
        groups = [(f"{src}/linear_0", names[:1]), (f"{src}/linear_1", names[1:])]
        last = f"{src}/linear_2"
    for linear, projs in groups:
        n = len(projs)
        for kind in ("weight", "bias"):
            shape = (n * E, E) if kind == "weight" else (n * E,)
            targets = tuple((f"{dst}.{p}.{kind}", _split(n * E, n, j)) for j, p in enumerate(projs)
                            if kind == "weight" or p != "k_proj" or k_bias)  # fmt: skip
            out.append(Entry(f"{linear}/{kind}", shape, targets))
    out += [Entry(f"{last}/weight", (E, E), ((f"{dst}.out_proj.weight", None),)),
            Entry(f"{last}/bias", (E,), ((f"{dst}.out_proj.bias", None),))]
    return out


def _norm(src: str, dst: str, E: int) -> list[Entry]:
    return [Entry(f"{src}/gamma", (E,), ((f"{dst}.weight", None),)),
            Entry(f"{src}/beta", (E,), ((f"{dst}.bias", None),))]


def _ffn(src: str, dst: str, E: int, F: int) -> list[Entry]:
    return [Entry(f"{src}/linear_0/weight", (F, E), ((f"{dst}.ffn.linear1.weight", None),)),
            Entry(f"{src}/linear_0/bias", (F,), ((f"{dst}.ffn.linear1.bias", None),)),
            Entry(f"{src}/linear_1/weight", (E, F), ((f"{dst}.ffn.linear2.weight", None),)),
            Entry(f"{src}/linear_1/bias", (E,), ((f"{dst}.ffn.linear2.bias", None),)),
            *_norm(f"{src}/layer_norm", f"{dst}.ffn_norm", E)]


def whisper_entries(c: SpeechSeq2SeqConfig) -> list[Entry]:
    """The tensors a ``WhisperSpec`` model.bin must hold for config ``c``, and where each goes."""
    E, F, V = c.d_model, c.d_ff, c.vocab_size
    out = [
        Entry("encoder/conv1/weight", (E, c.n_mels, 3), (("conv1.weight", None),)),
        Entry("encoder/conv1/bias", (E,), (("conv1.bias", None),)),
        Entry("encoder/conv2/weight", (E, E, 3), (("conv2.weight", None),)),
        Entry("encoder/conv2/bias", (E,), (("conv2.bias", None),)),
        Entry("encoder/position_encodings/encodings", (c.max_source_len, E),
              (("encoder_pos", None),)),
        *_norm("encoder/layer_norm", "encoder_norm", E),
        Entry("decoder/embeddings/weight", (V, E),
              (("tgt_embed.weight", None), ("lm_head.weight", None))),
        Entry("decoder/position_encodings/encodings", (c.max_len, E), (("tgt_pos.weight", None),)),
        *_norm("decoder/layer_norm", "decoder_norm", E),
    ]
    for i in range(c.num_encoder_layers):
        src, dst = f"encoder/layer_{i}", f"encoder_blocks.{i}"
        out += _attention(f"{src}/self_attention", f"{dst}.self_attn", E, 3, c.k_bias)
        out += _norm(f"{src}/self_attention/layer_norm", f"{dst}.attn_norm", E)
        out += _ffn(f"{src}/ffn", dst, E, F)
    for i in range(c.num_decoder_layers):
        src, dst = f"decoder/layer_{i}", f"decoder_blocks.{i}"
        out += _attention(f"{src}/self_attention", f"{dst}.self_attn", E, 3, c.k_bias)
        out += _norm(f"{src}/self_attention/layer_norm", f"{dst}.attn_norm", E)
        out += _attention(f"{src}/attention", f"{dst}.cross_attn", E, 2, c.k_bias)
        out += _norm(f"{src}/attention/layer_norm", f"{dst}.cross_norm", E)
        out += _ffn(f"{src}/ffn", dst, E, F)
    return out


def _config(ct2: CT2File) -> SpeechSeq2SeqConfig:
    """The model's sizes, read from the tensor shapes and scalars."""
    path, shapes = ct2.path, ct2.shapes

    def shape(name: str) -> tuple[int, ...]:
        if name not in shapes:
            raise BadFileError(f"{path}: missing tensor {name!r} (expected a WhisperSpec "
                               "model)", path=path)  # fmt: skip
        return shapes[name]

    def layers(stack: str) -> int:
        found = {int(m.group(1)) for n in shapes if (m := re.match(rf"{stack}/layer_(\d+)/", n))}
        if found != set(range(len(found))):
            raise BadFileError(f"{path}: {stack} layers {sorted(found)} are not 0..N-1",
                               path=path)  # fmt: skip
        return len(found)

    V, E = shape("decoder/embeddings/weight")
    heads = int(ct2.scalar("decoder/num_heads"))
    if int(ct2.scalar("encoder/num_heads")) != heads:
        raise BadFileError(f"{path}: encoder and decoder head counts differ; qkv's speech "
                           "model has one num_heads", path=path)  # fmt: skip
    try:
        return SpeechSeq2SeqConfig(
            vocab_size=V, n_mels=shape("encoder/conv1/weight")[1], d_model=E, num_heads=heads,
            num_encoder_layers=layers("encoder"), num_decoder_layers=layers("decoder"),
            d_ff=shape("decoder/layer_0/ffn/linear_0/weight")[0],
            max_source_len=shape("encoder/position_encodings/encodings")[0],
            max_len=shape("decoder/position_encodings/encodings")[0],
        )
    except ValueError as err:
        raise BadFileError(f"{path}: the tensors describe an invalid model: {err}",
                           path=path) from None  # fmt: skip


def _check_file(ct2: CT2File, c: SpeechSeq2SeqConfig) -> None:
    """Options, the tied projection, zero key biases, the sinusoid table."""
    path = ct2.path
    for name, want in _OPTIONS.items():
        if want is not None and ct2.scalar(name) != want:
            raise BadFileError(f"{path}: option {name} = {ct2.scalar(name)}, expected {want} "
                               "(what qkv's Whisper computes)", path=path)  # fmt: skip
    if ct2.aliases.get("decoder/projection/weight") != "decoder/embeddings/weight":
        raise BadFileError(f"{path}: decoder/projection/weight must be an alias of "
                           "decoder/embeddings/weight (tied output projection)", path=path)
    E = c.d_model
    for i in range(c.num_encoder_layers + c.num_decoder_layers):
        stack, j = ("encoder", i) if i < c.num_encoder_layers else \
            ("decoder", i - c.num_encoder_layers)
        fused = [(f"{stack}/layer_{j}/self_attention/linear_0/bias", slice(E, 2 * E))]
        if stack == "decoder":
            fused.append((f"decoder/layer_{j}/attention/linear_1/bias", slice(0, E)))
        for name, keys in fused:
            if bool(ct2.tensors[name][keys].any()):
                raise BadFileError(f"{path}: {name} has a non-zero key bias; Whisper's key "
                                   "projections have none", path=path)  # fmt: skip
    table = ct2.tensors["encoder/position_encodings/encodings"].float()
    err = float((table - speech_sinusoids(c.max_source_len, E)).abs().max())
    if err > 1e-2:
        raise BadFileError(f"{path}: encoder/position_encodings/encodings differs from "
                           f"Whisper's sinusoidal table by {err:.3g}", path=path)  # fmt: skip


def load_whisper_ct2(folder: str | Path) -> tuple[SpeechSeq2Seq, PretrainedTokenizer, dict]:
    """Read a CTranslate2 Whisper folder into ``(model (float32, eval), tokenizer, config.json)``.

    Raises:
        MissingFileError: no model.bin or tokenizer.json in ``folder``.
        BadFileError: a file that is malformed or describes another model (named).
        ImportError: ``tokenizers`` missing (with the install command).
    """
    folder = Path(folder)
    ct2 = read_ct2(folder / "model.bin")
    if ct2.spec != "WhisperSpec":
        raise BadFileError(f"{ct2.path}: spec {ct2.spec!r}; qkv reads Whisper models "
                           "(WhisperSpec) from CTranslate2 files", path=ct2.path)  # fmt: skip
    c = _config(ct2)
    ignore = set(_OPTIONS) | {"decoder/projection/weight"}
    # names and shapes first (missing/unexpected/misshaped, named), then values
    check_entries(ct2.shapes, whisper_entries(c), where=ct2.path, ignore=ignore.__contains__)
    for name, tensor in ct2.tensors.items():
        check_finite(name, tensor, ct2.path)
    _check_file(ct2, c)
    with skip_init():
        model = SpeechSeq2Seq(c)
    state = {k: v.float() for k, v in ct2.tensors.items() if k not in ignore}
    load_entries(model, state, whisper_entries(c), where=ct2.path)
    options = read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    tk = require("tokenizers", "tokenizers")
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise MissingFileError(f"no tokenizer.json in {folder}", path=file)
    with reading(file, "a tokenizers library tokenizer.json", errors=(Exception,)):
        backend = tk.Tokenizer.from_file(str(file))
    special = {"bos_token": "<|startoftranscript|>", "eos_token": "<|endoftext|>",
               "pad_token": "<|endoftext|>"}  # fmt: skip
    with reading(file, "Whisper's special tokens"):
        tokenizer = PretrainedTokenizer(backend, special_tokens=special)
    return model.eval(), tokenizer, options


# Windows transcribed together: a batch for the encoder and the decoder, and the most audio
# (4 minutes) held at once however long the file.
WINDOW_BATCH = 8


def _batches(items: Iterator, n: int) -> Iterator[list]:
    """``items`` in lists of ``n`` (the last one shorter)."""
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


@dataclass
class SpeechBundle:
    """A speech recogniser: audio in, text out.

    Attributes:
        model: the :class:`~qkv.models.speech.SpeechSeq2Seq` (float32, eval mode).
        tokenizer: its tokenizer (ids from ``<|endoftext|>`` on are special).
        name: the packaged name or folder.
        prompt: the forced decoder start (``<|startoftranscript|><|notimestamps|>``).
        suppress, suppress_first: ids never generated / not generated first (the
            converter's ``suppress_ids`` and ``suppress_ids_begin``).
        alignment_heads: ``(layer, head)`` cross-attention heads that follow the audio.
        source: where the weights came from.
    """

    model: SpeechSeq2Seq
    tokenizer: Any
    name: str
    prompt: tuple[int, ...]
    suppress: tuple[int, ...] = ()
    suppress_first: tuple[int, ...] = ()
    alignment_heads: tuple[tuple[int, int], ...] = ()
    source: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> SpeechSeq2SeqConfig:
        return self.model.config

    def features(self, audio: object) -> Tensor:
        """Log-mel features ``(W, n_mels, 3000)`` of ``audio``'s 30 s windows (``W >= 1``).

        Args:
            audio: a path (WAV/FLAC/OGG, any rate) or 1-D float samples at 16 kHz.
        """
        windows = audio_mod.split_windows(audio_mod.waveform(audio))
        return audio_mod.log_mel(windows, self.config.n_mels)  # (W, n_mels, F)

    def inputs(self, memory: Tensor) -> EncodedInputs:
        """The decoding inputs of encoder ``memory (B, S, E)``: prompt and suppressions."""
        return EncodedInputs(memory, [list(self.prompt)] * memory.shape[0],
                             suppress=self.suppress, suppress_first=self.suppress_first)

    @torch.no_grad()
    def tokens(self, features: Tensor, *, beam_size: int | None = None, alpha: float = 0.0,
               max_new_tokens: int = 224, compile: bool = False) -> list[list[int]]:  # fmt: skip
        """Token ids of each window's transcription (EOS stripped), greedy or beam search.

        Args:
            features: ``(W, n_mels, F)`` from :meth:`features`.
            beam_size: None for greedy, else beam search with that many beams
                (:func:`qkv.generate.beam_search`).
            alpha: beam search's GNMT length-penalty exponent (0: plain log-probabilities).
            max_new_tokens: per window (Whisper's default: half its 448 positions).
            compile: greedy decoding on a static cache with the steps after the prompt
                through ``torch.compile`` (the first call compiles; not with beam search).

        Raises:
            TypeError, ValueError: features that are not ``(W, n_mels, F)`` float tensors;
                bad ``beam_size``, ``alpha`` or ``max_new_tokens``; ``compile`` with beams.
        """
        if not isinstance(features, Tensor) or not features.is_floating_point():
            raise TypeError(f"features must be a float tensor (W, n_mels, F), got "
                            f"{getattr(features, 'dtype', type(features).__name__)}")  # fmt: skip
        memory = self.model.encode(features.to(self.model.conv1.weight))  # (W, S, E)
        inputs = self.inputs(memory)
        if compile and beam_size is not None:
            raise ValueError("compile=True (a static KV cache) does not serve beam search; "
                             "use compile=False with beam_size")  # fmt: skip
        if beam_size is None:
            out = greedy(self.model, inputs, max_new_tokens=max_new_tokens,  # type: ignore[arg-type]
                         compile=compile)
        else:
            out = beam_search(self.model, inputs, beam_size=beam_size,  # type: ignore[arg-type]
                              max_new_tokens=max_new_tokens, alpha=alpha)
            assert isinstance(out, Tensor)
        return strip(out, self.config.eos_id)

    def text(self, ids: list[int]) -> str:
        """The text of token ids (special and timestamp tokens dropped), stripped."""
        return self.decode_text(ids).strip()

    def transcribe(self, audio: object, *, beam_size: int | None = None, alpha: float = 0.0,
                   max_new_tokens: int = 224, compile: bool = False) -> str:  # fmt: skip
        """The text spoken in ``audio``, window by window (fixed 30 s windows, no timestamps),
        joined by spaces; :meth:`transcript` is the long-form path with timestamps.

        A file is read :data:`WINDOW_BATCH` windows at a time (:func:`~qkv.pretrained.whisper.audio.
        audio_windows`), so hours of audio take the memory of a few minutes.

        Args:
            audio: a path (WAV/FLAC/OGG, any sample rate) or 1-D float samples at 16 kHz.
            beam_size: None (greedy) or the number of beams.
            alpha: beam search's length-penalty exponent (0: none).
            max_new_tokens: the most tokens per 30 s window.
            compile: a static cache and compiled decoding steps (see :meth:`tokens`).

        Raises:
            TypeError, ValueError: audio that is neither a path nor a 1-D float array.
            BadFileError, MissingFileError: an audio file that cannot be read.
        """
        texts = []
        for windows in _batches(audio_mod.audio_windows(audio), WINDOW_BATCH):
            features = audio_mod.log_mel(windows, self.config.n_mels)  # (W, n_mels, F)
            rows = self.tokens(features, beam_size=beam_size, alpha=alpha,
                               max_new_tokens=max_new_tokens, compile=compile)  # fmt: skip
            texts += [t for t in (self.text(r) for r in rows) if t]
        return " ".join(texts)

    @property
    def vocab(self) -> Vocab:
        """The special ids the timestamp rules need (from the tokenizer) and the bans."""
        ids = {w: self.tokenizer.token_to_id(f"<|{w}|>") for w in
               ("endoftext", "startoftranscript", "startofprev", "nocaptions", "notimestamps")}
        return Vocab(ids["endoftext"], ids["startoftranscript"], ids["startofprev"],
                     ids["nocaptions"], ids["notimestamps"], self.suppress,
                     self.suppress_first)  # fmt: skip

    def decode_text(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` as decoded (leading space kept; special and timestamp tokens
        dropped)."""
        eos = self.config.eos_id
        return self.tokenizer.decode([i for i in ids if eos is None or i < eos])

    def transcripts(self, audios: Sequence[object], options: TranscribeOptions | None = None,
                    **changes: Any) -> Iterator[Transcript]:  # fmt: skip
        """Long-form transcription with timestamps of each of ``audios``, in input order.

        Args:
            audios: paths (WAV/FLAC/OGG, any rate) or 1-D float arrays at 16 kHz.
            options: a :class:`~qkv.pretrained.whisper.options.TranscribeOptions`
                (default: openai-whisper's); ``changes`` replace its fields (e.g.
                ``word_timestamps=True, batch_size=4``).

        Yields:
            one :class:`~qkv.pretrained.whisper.transcript.Transcript` per input, as soon as it and
            every earlier one are done.

        Raises:
            ValueError: a bad option; as :meth:`transcribe` for bad audio.
        """
        return transcribe_all(self, list(audios), self._options(options, changes))

    def segments(self, audio: object, options: TranscribeOptions | None = None,
                 **changes: Any) -> Iterator[Segment]:  # fmt: skip
        """One recording's segments as :meth:`transcripts` finds them, each yielded as soon
        as its 30 s window is decoded (for printing while transcribing)."""
        o = self._options(options, changes)
        return stream_segments(self, audio, o)

    def _options(self, options: TranscribeOptions | None, changes: dict) -> TranscribeOptions:
        o = replace(options or TranscribeOptions(), **changes)
        if o.word_timestamps and not self.alignment_heads:
            raise ValueError(f"word_timestamps=True needs the model's alignment heads; "
                             f"{self.name} declares none (config.json alignment_heads)")
        return o

    def transcript(self, audio: object, options: TranscribeOptions | None = None,
                   **changes: Any) -> Transcript:  # fmt: skip
        """:meth:`transcripts` of one recording."""
        return next(iter(self.transcripts([audio], options, **changes)))

    @torch.no_grad()
    def stream(self, audio: object, *, max_new_tokens: int = 224) -> Iterator[str]:
        """Greedy transcription yielded piece by piece as tokens are chosen (same text as
        :meth:`transcribe`)."""
        shown = ""  # everything yielded so far, across windows
        for window in audio_mod.audio_windows(audio):
            features = audio_mod.log_mel(window, self.config.n_mels)  # (1, n_mels, F)
            memory = self.model.encode(features.to(self.model.conv1.weight))
            session = MemorySession(self.model, self.inputs(memory), max_new_tokens)
            base, logits, ids = shown + (" " if shown else ""), session.first(), []
            for _ in range(max_new_tokens):
                token = int(logits.argmax(-1))
                if token == self.config.eos_id:
                    break
                ids.append(token)
                text = self.text(ids)
                # a piece is shown once it extends what was shown (a token ending inside a
                # UTF-8 character decodes to a replacement mark until the next one comes)
                if text and (base + text).startswith(shown) and len(base + text) > len(shown):
                    yield (base + text)[len(shown) :]
                    shown = base + text
                logits = session.next(torch.tensor([token], device=memory.device))


def load_whisper_bundle(folder: str | Path, name: str) -> SpeechBundle:
    """:func:`load_whisper_ct2` wrapped in a :class:`SpeechBundle` (English transcription
    without timestamps: ``<|startoftranscript|>`` [``<|en|><|transcribe|>`` for multilingual
    models] ``<|notimestamps|>``).

    Raises:
        as :func:`load_whisper_ct2`; BadFileError: a tokenizer without Whisper's special tokens.
    """
    model, tokenizer, options = load_whisper_ct2(folder)
    words = ["<|startoftranscript|>", "<|notimestamps|>"]
    if tokenizer.token_to_id("<|en|>") is not None and model.config.vocab_size > 51864:
        words[1:1] = ["<|en|>", "<|transcribe|>"]  # multilingual: English, transcribe
    prompt = tuple(tokenizer.token_to_id(w) for w in words)
    if None in prompt:
        file = Path(folder) / "tokenizer.json"
        raise BadFileError(f"{file}: no Whisper special tokens {words}", path=file)

    def checked(key: str, ok, what: str) -> tuple:
        value = options.get(key, [])
        if not isinstance(value, list) or not all(ok(v) for v in value):
            file = Path(folder) / "config.json"
            raise BadFileError(f"{file}: {key} must be {what}, got {value!r:.80}", path=file)
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)

    def ids(key: str) -> tuple:
        return checked(key, lambda i: _is_int(i) and 0 <= i < model.config.vocab_size,
                       "a list of token ids")  # fmt: skip

    c = model.config
    heads = checked("alignment_heads", lambda h: isinstance(h, list) and len(h) == 2 and (
        _is_int(h[0]) and _is_int(h[1]) and 0 <= h[0] < c.num_decoder_layers
        and 0 <= h[1] < c.num_heads), "a list of [layer, head] pairs")  # fmt: skip
    return SpeechBundle(model, tokenizer, name, prompt, suppress=ids("suppress_ids"),
                        suppress_first=ids("suppress_ids_begin"), alignment_heads=heads,
                        source={"format": "ctranslate2", "path": str(Path(folder))})
