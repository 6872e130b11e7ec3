"""A compiler pass for the decoding step: one-row float32 matmuls as inductor reductions.

A decoding step multiplies one token's activations by every weight matrix of the model: a
matrix-vector product (GEMV) that reads each weight once and does two flops per 4-byte read,
so its speed is the memory bandwidth it reaches. ``torch.compile`` hands a one-row
``aten.mm`` to the BLAS library (an extern call), whose float32 GEMV streams well below the
bandwidth on some CPUs: on an AMD EPYC (AVX-512, 2 threads) ``F.linear`` at one row read
16.6 GB/s over SmolLM2-135M's matrices, where a plain sum over a tensor reads 40-45 GB/s.
:class:`DecodeGemv` rewrites each such ``mm(a (1, K), b (K, N))`` (and ``addmm`` with a bias)
into ``sum(aᵀ * b, dim=0)`` before inductor lowers the graph, so inductor generates the
product as a reduction: one C++ loop per output row, vectorised along ``K``, rows split
across the threads, the preceding norm fused into it; the same matrices read 28.9 GB/s.

The sum runs in float32 in another order than the BLAS kernel's, so a logit moves by the
rounding of a float32 dot product (``~K·eps·|a|·|b|``), as any other GEMV kernel's does.
Only float32 CPU matmuls with one row are rewritten; a prefill (``M > 1``, compute-bound),
another dtype (the quantised kernels are their own extern calls) or a GPU is left to
inductor. :data:`ENABLED` turns the pass off (for comparison).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

__all__ = ["ENABLED", "DecodeGemv", "compile_options"]

ENABLED = True  # one-row float32 CPU matmuls of a compiled step become inductor reductions

_aten = torch.ops.aten


def _operands(node: torch.fx.Node) -> tuple[Any, Any, Any] | None:
    """``(bias, a, b)`` of an ``mm``/``addmm`` node (bias None for ``mm``), or None."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is _aten.mm.default:
        return (None, *node.args)
    if node.target is _aten.addmm.default:
        return node.args  # (bias, a, b), beta = alpha = 1 (no kwargs)
    return None


def _rewritten(bias: Any, a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether ``a @ b (+ bias)`` is a one-row float32 CPU product this pass rewrites."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return False
    if va.dim() != 2 or vb.dim() != 2 or va.shape[0] != 1:
        return False
    if bias is not None and not isinstance(getattr(bias, "meta", {}).get("val"), torch.Tensor):
        return False
    same = {va.dtype, vb.dtype} | ({bias.meta["val"].dtype} if bias is not None else set())
    return same == {torch.float32} and va.device.type == vb.device.type == "cpu"


class DecodeGemv(CustomGraphPass):
    """Rewrite one-row float32 CPU ``mm(a (1, K), b (K, N))`` into ``sum(aᵀ * b, 0)``
    (``(1, N)``; ``addmm`` adds its bias after): an inductor post-grad pass, set with
    ``torch.compile(..., options=compile_options())``."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            found = _operands(node)
            if found is None or not _rewritten(*found):
                continue
            bias, a, b = found
            with graph.inserting_before(node):
                out = self._gemv(graph, a, b)
                if bias is not None:
                    out = _call(graph, _aten.add.Tensor, out, bias)
            node.replace_all_uses_with(out)
            graph.erase_node(node)

    @staticmethod
    def _gemv(graph: torch.fx.Graph, a: torch.fx.Node, b: torch.fx.Node) -> torch.fx.Node:
        column = _call(graph, _aten.permute.default, a, [1, 0])  # (K, 1)
        product = _call(graph, _aten.mul.Tensor, column, b)  # (K, N), never stored
        return _call(graph, _aten.sum.dim_IntList, product, [0], True)  # (1, N)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


def _call(graph: torch.fx.Graph, target: Any, *args: Any) -> torch.fx.Node:
    """A node ``target(*args)`` with its ``val`` metadata (the op run on the fake values)."""
    node = graph.call_function(target, args)
    fake = [x.meta["val"] if isinstance(x, torch.fx.Node) else x for x in args]
    node.meta["val"] = target(*fake)
    return node


def compile_options(device: torch.device) -> dict[str, Any] | None:
    """``torch.compile`` options for a decoding step on ``device``: the pass on a CPU while
    :data:`ENABLED`, else None (inductor's defaults)."""
    if not ENABLED or device.type != "cpu":
        return None
    return {"post_grad_custom_pre_pass": DecodeGemv()}
