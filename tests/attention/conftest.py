"""``QKV_TEST_EXTRA_BACKEND=1``: run every backend grid with one more backend.

The test reference backend (reference_backend.py) is registered here, before any test module
of this directory is collected, so every grid built on ``helpers.backend_names`` picks it up.
"""

import os

if os.environ.get("QKV_TEST_EXTRA_BACKEND") == "1":
    import reference_backend

    from qkv.attention import backends

    if reference_backend.NAME not in backends.REGISTRY:
        backends.register(reference_backend)
