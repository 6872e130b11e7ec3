"""Measurement helpers for the scripts in this folder; they live in :mod:`qkv.bench.measure`.

The scripts import them as ``from common import ...`` (this folder is not a package).
"""

from qkv.bench.measure import *  # noqa: F403
from qkv.bench.measure import __all__  # noqa: F401
