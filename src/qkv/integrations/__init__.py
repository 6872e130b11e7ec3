"""qkv inside other libraries, imported only on request.

``qkv.integrations.transformers``: :func:`~qkv.integrations.transformers.register` makes
``attn_implementation="qkv"`` a Hugging Face transformers attention implementation, so any
transformers model attends through :func:`qkv.scaled_dot_product_attention` and
:mod:`qkv.inspect` captures its exact weights. transformers is an optional extra: nothing here
imports it until a function is called.
"""

__all__ = ["transformers"]


def __getattr__(name: str):
    if name == "transformers":
        import importlib

        return importlib.import_module("qkv.integrations.transformers")
    raise AttributeError(f"module 'qkv.integrations' has no attribute {name!r}")
