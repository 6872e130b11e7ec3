"""See inside a model: hook points, captured attention, a token's journey, plots, a viewer.

    import qkv.inspect as qi

    with qi.capture(model, layers=None, heads=None, rows=None) as cap:
        logits = model(ids)                 # outputs bitwise unchanged, same fast kernel
    cap.weights["blocks.0.self_attn"]       # (B, H, T, S), exact
    cap.kinds["blocks.0.self_attn"]         # "self" | "causal self" | "cross"

    with qi.hooks(model, {"blocks.1.self_attn.hook_out": zero_head}):   # read or replace
        ablated = model(ids)

    print(qi.trace(model, ids, position=3, tokens=labels).table())
    qi.plot_head(cap, "head.png", layer=0, head=1, q_tokens=labels)
    qi.view(model, labels, "attention.html", input_ids=ids)             # one offline file

Hook points (identity modules, :mod:`qkv.nn.hooks`), by name under each block ``{stack}.{i}``:
``hook_resid_pre``, ``self_attn.hook_q`` / ``hook_k`` / ``hook_v`` / ``hook_inputs`` /
``hook_scores`` / ``hook_weights`` / ``hook_out``, ``hook_attn_out``, ``hook_resid_mid``,
(``cross_attn.*``, ``hook_cross_out``, ``hook_resid_cross``), ``ffn.hook_hidden``,
``hook_ffn_out``, ``hook_resid_post``. A hook on ``hook_scores`` or ``hook_weights`` makes that
one layer run the math path (those tensors exist nowhere else); no other hook changes the
backend.

Modules: :mod:`~qkv.inspect.hookpoints`, :mod:`~qkv.inspect.capture`,
:mod:`~qkv.inspect.weights` (exact weights from queries, keys and the log-sum-exp),
:mod:`~qkv.inspect.trace`, :mod:`~qkv.inspect.plots`, :mod:`~qkv.inspect.figures`,
:mod:`~qkv.inspect.viewer` (with :mod:`~qkv.inspect.viewer_data`), :mod:`~qkv.inspect.report`
(everything into one folder, for ``qkv inspect``).
"""

from qkv.inspect.capture import Captured, capture, join_calls
from qkv.inspect.figures import plot_masks, plot_positions
from qkv.inspect.hookpoints import attention_layers, hook_points, hooks
from qkv.inspect.plots import plot_alignment, plot_grid, plot_head, plot_rollout, rollout
from qkv.inspect.report import write_report
from qkv.inspect.trace import Trace, TraceStep, trace
from qkv.inspect.viewer import View, view
from qkv.inspect.weights import weights_of

__all__ = [
    "Captured",
    "Trace",
    "TraceStep",
    "View",
    "attention_layers",
    "capture",
    "hook_points",
    "hooks",
    "join_calls",
    "plot_alignment",
    "plot_grid",
    "plot_head",
    "plot_masks",
    "plot_positions",
    "plot_rollout",
    "rollout",
    "trace",
    "view",
    "weights_of",
    "write_report",
]
