"""Hugging Face-format folders: read into qkv's generic models, and written back.

Module map:

* :mod:`~qkv.pretrained.hf.folder`: a folder (``config.json``, safetensors weights, tokenizer)
  loaded into a ready bundle; :mod:`~qkv.pretrained.hf.common` reads configs and weights,
  :mod:`~qkv.pretrained.hf.tokenizer` the tokenizer (``tokenizer.json`` or the older files);
* name maps, one per family, from the checkpoint's names to qkv's:
  :mod:`~qkv.pretrained.hf.bert` (BERT, MiniLM), :mod:`~qkv.pretrained.hf.gpt2`,
  :mod:`~qkv.pretrained.hf.llama` (Llama and its RoPE scalings),
  :mod:`~qkv.pretrained.hf.decoders` (Mistral, Qwen2, Qwen3, Gemma 2, Phi-3);
* encoder-decoders: :mod:`~qkv.pretrained.hf.seq2seq` over :mod:`~qkv.pretrained.hf.bart`,
  :mod:`~qkv.pretrained.hf.t5` and :mod:`~qkv.pretrained.hf.marian`;
* :mod:`~qkv.pretrained.hf.save`: :func:`save_hf`, a qkv model written as a Hugging Face
  folder (the same name maps, reversed); public as :func:`qkv.pretrained.save_hf`.

Model-specific quirks are options of qkv's generic blocks; these modules only map names and
check that a checkpoint's tensors back its config.
"""
