"""Peak memory of one attention call in a fresh subprocess; lives in :mod:`qkv.bench.memprobe`.

Kept for ``from memprobe import peak_extra_bytes`` with this folder on ``sys.path``; run a probe
with ``python -m qkv.bench.memprobe --spec JSON``.
"""

from qkv.bench.memprobe import attention_fn, make_inputs, peak_extra_bytes, probe

__all__ = ["attention_fn", "make_inputs", "peak_extra_bytes", "probe"]
