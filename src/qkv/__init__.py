"""qkv: attention and the transformer, end to end, exact, fast and visible.

Shape glossary, used in every docstring and reshape comment:

    B    batch (all leading dimensions)      T    query length
    H    query heads                          S    key / value length
    Hkv  key/value heads (grouped-query)      D    head width (queries and keys)
    E    model width (d_model)                Dv   head width of values
    V    vocabulary size

Tensors inside attention are ``(B, H, T, D)``. Masks follow SDPA polarity (True = may attend)
unless a function says otherwise; see :mod:`qkv.masks`.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from qkv import masks  # the public module: attention/masks.py plus the flex mods
from qkv.attention import (
    BlockMask,
    Explanation,
    create_block_mask,
    explain,
    flex_attention,
    scaled_dot_product_attention,
)

__version__ = "0.1.0"

# Subpackages load on first use (``qkv.nn``, ``qkv.inspect``, ...), so ``import qkv`` stays
# light and optional extras are only needed by what is used.
_SUBPACKAGES = (
    "reference", "attention", "nn", "models", "data", "checkpoint", "generate", "train",
    "pretrained", "inspect", "bench", "distributed", "integrations", "serve",
)

__all__ = [
    "BlockMask",
    "Explanation",
    "create_block_mask",
    "flex_attention",
    "__version__",
    "explain",
    "masks",
    "scaled_dot_product_attention",
    *_SUBPACKAGES,
]


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"qkv.{name}")
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")


# Modules that moved into sub-packages (issue 43), old name -> new: the old names still import,
# as the same module object, with a DeprecationWarning naming the new one. (Not
# ``qkv.pretrained.save_hf``, the function, nor ``qkv.pretrained.whisper``, now the package.)
MOVED_MODULES = {
    "qkv.attention.flex_blocks": "qkv.attention.flex.blocks",
    "qkv.attention.flex_compiled": "qkv.attention.flex.compiled",
    "qkv.attention.flex_fused": "qkv.attention.flex.fused",
    "qkv.attention.flex_loop": "qkv.attention.flex.loop",
    "qkv.attention.flex_sdpa": "qkv.attention.flex.sdpa",
    "qkv.attention.flex_triton": "qkv.attention.flex.triton_path",
    "qkv.attention.triton_backward": "qkv.attention.triton.backward",
    "qkv.attention.triton_env": "qkv.attention.triton",
    "qkv.attention.triton_fast": "qkv.attention.triton.fast",
    "qkv.attention.triton_flex": "qkv.attention.triton.flex",
    "qkv.attention.triton_kernels": "qkv.attention.triton.kernels",
    "qkv.attention.triton_launch": "qkv.attention.triton.launch",
    "qkv.attention.triton_paged": "qkv.attention.triton.paged",
    "qkv.attention.triton_plan": "qkv.attention.triton.plan",
    "qkv.cli.serve_app": "qkv.serve.app",
    "qkv.cli.serve_replies": "qkv.serve.replies",
    "qkv.cli.serve_requests": "qkv.serve.requests",
    "qkv.cli.tour_attention": "qkv.cli.tour.attention",
    "qkv.cli.tour_basics": "qkv.cli.tour.basics",
    "qkv.cli.tour_console": "qkv.cli.tour.console",
    "qkv.cli.tour_html": "qkv.cli.tour.html",
    "qkv.cli.tour_layers": "qkv.cli.tour.layers",
    "qkv.cli.tour_masks": "qkv.cli.tour.masks",
    "qkv.cli.tour_memory": "qkv.cli.tour.memory",
    "qkv.cli.tour_models": "qkv.cli.tour.models",
    "qkv.cli.tour_modules": "qkv.cli.tour.modules",
    "qkv.cli.tour_page": "qkv.cli.tour.page",
    "qkv.cli.tour_positions": "qkv.cli.tour.positions",
    "qkv.cli.tour_stops": "qkv.cli.tour.stops",
    "qkv.pretrained.audio": "qkv.pretrained.whisper.audio",
    "qkv.pretrained.ct2_reader": "qkv.pretrained.whisper.ct2_reader",
    "qkv.pretrained.gguf_llama": "qkv.pretrained.gguf.llama",
    "qkv.pretrained.gguf_reader": "qkv.pretrained.gguf.reader",
    "qkv.pretrained.hf_bart": "qkv.pretrained.hf.bart",
    "qkv.pretrained.hf_bert": "qkv.pretrained.hf.bert",
    "qkv.pretrained.hf_common": "qkv.pretrained.hf.common",
    "qkv.pretrained.hf_decoders": "qkv.pretrained.hf.decoders",
    "qkv.pretrained.hf_folder": "qkv.pretrained.hf.folder",
    "qkv.pretrained.hf_gpt2": "qkv.pretrained.hf.gpt2",
    "qkv.pretrained.hf_llama": "qkv.pretrained.hf.llama",
    "qkv.pretrained.hf_marian": "qkv.pretrained.hf.marian",
    "qkv.pretrained.hf_seq2seq": "qkv.pretrained.hf.seq2seq",
    "qkv.pretrained.hf_t5": "qkv.pretrained.hf.t5",
    "qkv.pretrained.hf_tokenizer": "qkv.pretrained.hf.tokenizer",
    "qkv.pretrained.mel_frames": "qkv.pretrained.whisper.mel_frames",
    "qkv.pretrained.subtitles": "qkv.pretrained.whisper.subtitles",
    "qkv.pretrained.tokenizer_gguf": "qkv.pretrained.gguf.tokenizer",
    "qkv.pretrained.transcript": "qkv.pretrained.whisper.transcript",
    "qkv.pretrained.transcript_options": "qkv.pretrained.whisper.options",
    "qkv.pretrained.whisper_decode": "qkv.pretrained.whisper.decode",
    "qkv.pretrained.whisper_longform": "qkv.pretrained.whisper.longform",
    "qkv.pretrained.word_times": "qkv.pretrained.whisper.word_times",
}


class _MovedLoader(importlib.abc.Loader):
    def create_module(self, spec):
        new = MOVED_MODULES[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import that", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        pass  # the new module ran when it was imported


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(name, _MovedLoader())


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
