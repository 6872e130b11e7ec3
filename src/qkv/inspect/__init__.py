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

    logits, cache = qi.run_with_cache(model, ids)   # every hook point, detached
    cache.decompose_resid()                         # embeddings + each head + biases + FFNs
    qi.logit_lens(cache); qi.direct_logit_attribution(cache, (good, bad))
    qi.patch_residual(model, clean, corrupted, metric)                  # (L, T) sweep

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
(everything into one folder, for ``qkv inspect``); analysis above the hooks:
:mod:`~qkv.inspect.cache` (``run_with_cache``), :mod:`~qkv.inspect.decompose` (the residual
stream as a sum), :mod:`~qkv.inspect.lens` (logit lens, direct logit attribution),
:mod:`~qkv.inspect.patching`, :mod:`~qkv.inspect.analysis_plots`,
:mod:`~qkv.inspect.induction` (prefix-matching scores, head ablation); in the viewer:
:mod:`~qkv.inspect.timeline` (``record_generation``: each new token's attention while the KV
cache is on), :mod:`~qkv.inspect.neuron` (``qk_terms``: the D terms of one score),
:mod:`~qkv.inspect.alignment` (a speech model's tokens against audio time).
"""

from qkv.inspect.analysis_plots import (
    plot_head_attribution,
    plot_heatmap,
    plot_logit_lens,
    plot_patching,
)
from qkv.inspect.cache import ActivationCache, run_with_cache
from qkv.inspect.capture import Captured, capture, join_calls
from qkv.inspect.decompose import ResidComponents, decompose_resid
from qkv.inspect.figures import plot_masks, plot_positions
from qkv.inspect.hookpoints import attention_layers, hook_points, hooks
from qkv.inspect.induction import (
    ablate_heads,
    head_means,
    prefix_matching_scores,
    previous_token_scores,
)
from qkv.inspect.lens import Attribution, LogitLens, direct_logit_attribution, logit_lens
from qkv.inspect.neuron import QKTerms, qk_terms
from qkv.inspect.patching import patch_heads, patch_residual
from qkv.inspect.plots import plot_alignment, plot_grid, plot_head, plot_rollout, rollout
from qkv.inspect.report import write_report
from qkv.inspect.timeline import Generation, record_generation
from qkv.inspect.trace import Trace, TraceStep, trace
from qkv.inspect.viewer import View, view
from qkv.inspect.weights import weights_of

__all__ = [
    "ActivationCache",
    "Attribution",
    "Captured",
    "Generation",
    "LogitLens",
    "QKTerms",
    "ResidComponents",
    "Trace",
    "TraceStep",
    "View",
    "ablate_heads",
    "attention_layers",
    "capture",
    "decompose_resid",
    "direct_logit_attribution",
    "head_means",
    "hook_points",
    "hooks",
    "join_calls",
    "logit_lens",
    "patch_heads",
    "patch_residual",
    "plot_alignment",
    "plot_grid",
    "plot_head",
    "plot_head_attribution",
    "plot_heatmap",
    "plot_logit_lens",
    "plot_masks",
    "plot_patching",
    "plot_positions",
    "plot_rollout",
    "prefix_matching_scores",
    "previous_token_scores",
    "qk_terms",
    "record_generation",
    "rollout",
    "run_with_cache",
    "trace",
    "view",
    "weights_of",
    "write_report",
]
