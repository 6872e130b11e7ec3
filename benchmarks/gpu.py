"""GPU benchmark suite: qkv's ``triton`` backend against ``auto`` and torch's kernels.

    python benchmarks/gpu.py [--device cuda|cpu] [--quick] [--out PATH] [--max-seconds N]
                             [--groups dense,decode,paged,alibi,window,document,relative,weights]

CPU dry run (tiny sizes, Triton's interpreter):
    TRITON_INTERPRET=1 python benchmarks/gpu.py --device cpu --quick --out /tmp/gpu_dry.json

The same suite is ``qkv bench --device cuda``. The cases, timing method and JSON layout are
described in :mod:`qkv.bench.gpu`.
"""

import sys

from qkv.bench.gpu import main

if __name__ == "__main__":
    sys.exit(main())
