"""GGUF files (llama.cpp's format): Llama-family decoders and their tokenizers.

Module map: :mod:`~qkv.pretrained.gguf.reader` (metadata and tensors, read with the ``gguf``
package, checked before anything is built), :mod:`~qkv.pretrained.gguf.llama` (the tensors
mapped onto :class:`qkv.models.DecoderLM`, Llama style), :mod:`~qkv.pretrained.gguf.tokenizer`
(the byte-level BPE tokenizer rebuilt from the file's metadata).
"""
