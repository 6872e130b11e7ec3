"""Complete models, each built from :mod:`qkv.nn` parts and configured by a frozen dataclass.

* :class:`Seq2SeqTransformer` — encoder-decoder (Vaswani et al., 2017); BART, T5 and Marian
  (Opus-MT) are configurations of it (:mod:`~qkv.models.seq2seq_config`).
* :class:`DecoderLM` — decoder-only language model; GPT-2 style and Llama style are two
  configurations (:meth:`DecoderLMConfig.gpt2_style`, :meth:`DecoderLMConfig.llama_style`).
* :class:`Encoder` — BERT-style encoder with mean or CLS pooling.
* :class:`ViT` — Vision Transformer classifier.
* :class:`SpeechSeq2Seq` — speech encoder-decoder over log-mel features (Whisper).

Every config validates itself, round-trips through ``to_dict`` / ``from_dict`` (JSON), and
every model has ``.config``, ``num_parameters()`` and a repr that starts with the config.
"""

from qkv.models.decoder_lm import DecoderLM, DecoderLMConfig
from qkv.models.encoder import Encoder, EncoderConfig
from qkv.models.seq2seq import Seq2SeqConfig, Seq2SeqTransformer
from qkv.models.speech import SpeechSeq2Seq, SpeechSeq2SeqConfig
from qkv.models.vit import ViT, ViTConfig

__all__ = [
    "DecoderLM",
    "DecoderLMConfig",
    "Encoder",
    "EncoderConfig",
    "Seq2SeqConfig",
    "Seq2SeqTransformer",
    "SpeechSeq2Seq",
    "SpeechSeq2SeqConfig",
    "ViT",
    "ViTConfig",
]
