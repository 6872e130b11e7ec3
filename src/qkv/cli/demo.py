"""``qkv demo``: train a transformer from scratch on this CPU, use it, and look inside it.

The run is :func:`qkv.train.recipes.train_dates` under :func:`~qkv.train.recipes.date_recipe`;
the pictures come from :mod:`qkv.inspect` (cross-attention captured while the model reads each
example, drawn by :func:`~qkv.inspect.plot_alignment`, and the offline viewer).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.markup import escape

from qkv.cli.common import FLAG
from qkv.data import CharTokenizer
from qkv.data.dates import CASES, DATE_FORMATS
from qkv.models import Seq2SeqTransformer
from qkv.train.spec import DATA_FILE, DataSpec

__all__ = ["GOAL", "attention_pictures", "command", "token_labels"]

NAME = "demo"
GOAL = 0.995  # the test exact match the full demo promises


def token_labels(tok: CharTokenizer, ids: Sequence[int]) -> list[str]:
    """Readable labels of character ids: ``"␣"`` for a space, ``"<eos>"`` for specials."""
    out = []
    for i in ids:
        text = tok.decode([i], skip_special=False)
        out.append("␣" if text == " " else text)
    return out


@torch.no_grad()
def attention_pictures(
    model: Seq2SeqTransformer,
    src_tok: CharTokenizer,
    tgt_tok: CharTokenizer,
    texts: Sequence[str],
    folder: Path,
    *,
    viewer: int | None = 0,
) -> tuple[list[Path], Path | None]:
    """Greedy-translate each text and draw its cross-attention alignment, one PNG each.

    Rows are the output characters (each row is the decoder step that wrote it), columns the
    source characters; the weights are the last decoder layer's, averaged over heads.

    Args:
        model: a trained encoder-decoder (eval mode).
        src_tok, tgt_tok: its tokenizers.
        texts: the sources.
        folder: where ``alignment-<n>.png`` (n from 1) and ``viewer.html`` go.
        viewer: index of the text to open in the interactive viewer; None = no viewer.

    Returns:
        ``(PNG paths, viewer path or None)``.

    Raises:
        ImportError: matplotlib missing; ValueError: as :mod:`qkv.inspect`.
    """
    from qkv.generate import greedy, strip
    from qkv.inspect import capture, plot_alignment, view

    folder.mkdir(parents=True, exist_ok=True)
    bos, eos = model.config.bos_id, model.config.eos_id
    pictures: list[Path] = []
    viewer_path = None
    for n, text in enumerate(texts):
        src = torch.tensor([src_tok.encode(text, add_eos=True)])  # (1, S)
        out = strip(greedy(model, src, max_new_tokens=2 * src.shape[1] + 10), eos)[0]
        tgt_in = torch.tensor([[bos, *out]])  # (1, T): row t writes out[t] (then EOS)
        src_labels = token_labels(src_tok, src[0].tolist())
        out_labels = token_labels(tgt_tok, [*out, eos])
        with capture(model, layers="*cross_attn") as cap:
            model(src, tgt_in)
        pictures.append(plot_alignment(cap, folder / f"alignment-{n + 1}.png",
                                       src_tokens=src_labels, tgt_tokens=out_labels))  # fmt: skip
        if viewer == n:
            viewer_path = view(model, src_labels, folder / "viewer.html", input_ids=src,
                               target=tgt_in, target_tokens=token_labels(tgt_tok, [bos, *out]),
                               title=f"qkv demo: {text} -> {tgt_tok.decode(out)}").path  # fmt: skip
    return pictures, viewer_path


def command(
    out: Annotated[Path, typer.Option(
        "--out", help="Folder for the checkpoint, loss curve, attention PNGs and viewer "
        "(files of an earlier demo there are replaced).",
    )] = Path("runs/demo"),
    quick: Annotated[bool, typer.Option(
        "--quick", metavar=FLAG,
        help="A much smaller budget (320 small steps, ~20 s in all); it shows every "
        "step but does not reach 99%.",
    )] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seeds the data, weights and order.")] = 0,
    threads: Annotated[int | None, typer.Option(
        "--threads", min=1, help="CPU threads for torch (default 1: robust on a busy machine; "
        "2 is up to ~1.4x faster on an idle one).",
    )] = None,
) -> None:
    """Train a transformer from scratch to normalise dates, use it, and draw its attention.

    A Seq2SeqTransformer learns to write "tuesday 3rd of march 2015" or "3/3/15" as 2015-03-03.
    It trains a fixed 1,000 steps on this CPU (a minute or two), and gets 99.5% or more of
    held-out dates exactly right, the same on any machine.
    Then it translates dates it never saw and draws its cross-attention for each of them.
    --out receives the checkpoint, loss curve, alignment PNGs and the interactive viewer.

    [bold]Example:[/bold] qkv demo --out runs/demo
    """
    from qkv.train.recipes import DEMO_DATES, date_recipe, train_dates

    # --out was checked by common.guard (a folder, or creatable), which also turns expected
    # failures (ValueError, OSError, ...) into one line.
    console = Console(highlight=False, soft_wrap=True)
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    # metrics.jsonl is appended to: start it afresh so it describes this run alone
    (out / "metrics.jsonl").unlink(missing_ok=True)
    recipe = date_recipe(quick, seed=seed, run_dir=out)
    # the data spec, so that `qkv eval <out>` rebuilds this run's own test split
    spec = DataSpec("task", "dates", seed=recipe.seed, n_train=recipe.n_train,
                    n_valid=recipe.n_valid, n_test=recipe.n_test)  # fmt: skip
    (out / DATA_FILE).write_text(json.dumps(spec.to_json(), indent=1) + "\n")
    if (threads or recipe.threads) is not None:
        torch.set_num_threads(threads or recipe.threads)
    n = torch.get_num_threads()
    console.print(
        f"[bold]qkv demo[/bold]: a transformer learns to normalise dates from scratch "
        f"({'quick' if quick else 'full'} run, {n} CPU thread{'s' * (n > 1)})\n"
        f"data: {recipe.n_train:,} training pairs in {len(DATE_FORMATS)} formats × "
        f"{len(CASES)} letter cases, "
        f"{recipe.n_valid:,} validation, {recipe.n_test:,} test (all sources distinct)\n"
        f"training: {recipe.train.steps:,} steps of {recipe.train.batch_size} pairs, "
        f"seed {recipe.seed} (the same result on any machine; only the time differs)"
    )
    run = train_dates(recipe)
    texts = [t for t, _ in DEMO_DATES]
    outputs = run.translate(texts)
    pictures, viewer = attention_pictures(run.model, run.src_tok, run.tgt_tok, texts, out)
    _report(console, run, outputs, pictures, viewer, out, quick, time.perf_counter() - start)


def _report(console, run, outputs, pictures, viewer, out: Path, quick: bool,
            total: float) -> None:  # fmt: skip
    from qkv.train.recipes import DEMO_DATES

    r, c = run.result, run.model.config
    why = {"target": "validation target reached",
           "time": "stopped by the safety time cap: the result is not the recipe's"}.get(
        run.stop.reason, "all steps run")  # fmt: skip
    console.print(
        f"model: Seq2SeqTransformer, {c.num_encoder_layers}+{c.num_decoder_layers} layers, "
        f"d_model {c.d_model}, {c.num_heads} heads, {run.model.num_parameters():,} parameters\n"
        f"trained {r.steps:,} steps in {run.train_seconds:.1f} s ({why}; "
        f"{r.tokens_per_second:,.0f} target tokens/s)"
    )
    em, n = run.test_metrics["exact_match"], len(run.task.test)
    console.print(f"[bold]test exact match: {em:.1%}[/bold] ({round(em * n):,} of {n:,} "
                  "held-out dates exactly right)")  # fmt: skip
    if em < GOAL and not quick:
        console.print(f"below the {GOAL:.1%} the recipe reaches with every seed measured: "
                      "a bug, please report it")  # fmt: skip
    console.print("\n[bold]dates it never saw[/bold]")
    seen = {s for s, _ in run.task.train}
    width = max(len(t) for t, _ in DEMO_DATES)
    for (text, want), got in zip(DEMO_DATES, outputs, strict=True):
        mark = "[green]right[/green]" if got == want else f"[red]wrong[/red], expected {want}"
        note = " (in the training data)" if text in seen else ""
        # the model's output is text, not markup (an untrained model can write "[")
        console.print(f"  {escape(f'{text:<{width}}  →  {got:<10}')}  {mark}{note}")
    console.print("\n[bold]written[/bold]")
    # Paths come from --out: printed as text, never as rich markup.
    if run.checkpoint is not None:
        console.print(f"  checkpoint        {run.checkpoint}  (try: qkv translate {out} "
                      f"\"MAR 3, 2015\"; qkv eval {out})", markup=False)  # fmt: skip
    for name, path in (("loss curve", out / "loss.png"), ("metrics", out / "metrics.jsonl")):
        if path.exists():
            console.print(f"  {name:<17} {path}", markup=False)
    console.print(f"  alignments        {pictures[0]} ... {pictures[-1].name} "
                  "(cross-attention, output × input)", markup=False)  # fmt: skip
    if viewer is not None:
        console.print(f"  viewer            {viewer}  (open in a browser; no network)",
                      markup=False)  # fmt: skip
    console.print(f"output folder: {out}  (total {total:.0f} s)", markup=False)
