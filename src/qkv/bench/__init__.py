"""The attention benchmark suite behind ``qkv bench``, inside the package so it runs when installed.

* :mod:`~qkv.bench.suite`: :func:`~qkv.bench.suite.run_suite` measures qkv's backends and
  torch's kernel side by side and returns plain records.
* :mod:`~qkv.bench.targets`: the issue's targets, checked against one run's records.
* :mod:`~qkv.bench.memprobe`: peak memory of one attention call in a fresh subprocess
  (``python -m qkv.bench.memprobe``).
* :mod:`~qkv.bench.measure`: timing, peak RSS and probe-subprocess helpers.
* :mod:`~qkv.bench.plot`: the log-log plot (matplotlib, the ``plots`` extra).

Printing the tables is the command's job (:mod:`qkv.cli.bench_report`). The repository's
``benchmarks/`` folder keeps the standalone scripts (models, training, pretrained) and the
latest results; they import these helpers.
"""
