"""Training: the loop, schedules, label-smoothed loss, metrics, checkpoints and resume.

* :func:`train_seq2seq` / :func:`evaluate_seq2seq`: encoder-decoder models on string pairs
  (a :class:`~qkv.data.Task`, a list, or a torch ``Dataset``/``DataLoader`` of pairs), with
  loss, perplexity, token accuracy, exact match, BLEU (where the references are long enough
  for it: :func:`~qkv.train.metrics.bleu_applies`) and chrF.
* :func:`train_lm` / :func:`evaluate_lm`: decoder-only models on a token stream or documents
  (a list, or a torch ``Dataset`` of token-id documents).
* Every step records the loss it minimised (label-smoothed when smoothing is on) and ``ce``,
  the plain cross-entropy of the same logits, which is what compares with validation.
* :func:`fit`: the loop itself, for any :class:`Job` (model, batches, loss, evaluation).
* :class:`TrainConfig`: every setting, frozen and validated, loadable from TOML.
* :func:`save_checkpoint` / :func:`load_checkpoint`: safetensors + JSON folders, written
  atomically, loaded without pickle (the format is :mod:`qkv.checkpoint`, shared with
  :mod:`qkv.pretrained`); a run keeps ``<run_dir>/last`` (resumable) and ``<run_dir>/best``,
  appends to ``<run_dir>/metrics.jsonl`` and draws ``loss.png``.
* Data parallelism (:mod:`~qkv.train.parallel`): under ``torchrun`` (any initialised process
  group of several ranks) :func:`fit`, :func:`train_lm` and :func:`train_seq2seq` train with
  DDP, or FSDP2 with ``TrainConfig(fsdp=True)``, and equal one process with the same seed and
  global batch; checkpoints keep one format and resume on any number of processes.
* :func:`finetune` / :func:`resume_finetune`: fine-tune a pretrained decoder, fully or with
  LoRA adapters (:class:`LoRAOptions`), as a :class:`FineTuneSpec` says (base model, data,
  training settings, run folder): ``<out>/model`` (a Hugging Face folder),
  ``adapters.safetensors``, ``finetune.json`` and resumable checkpoints; what
  ``qkv train --from`` does (:mod:`~qkv.train.finetuning`).
* :mod:`~qkv.train.spec` and :mod:`~qkv.train.runs`: what ``qkv train`` / ``qkv eval`` do, as
  functions: the run spec (data source, TOML tables), building the model and config, training
  and testing, reading a finished run back.

Example::

    from qkv.data import CharTokenizer, make_task
    from qkv.models import Seq2SeqConfig, Seq2SeqTransformer
    from qkv.train import TrainConfig, train_seq2seq

    task = make_task("copy", n_train=2000, max_len=6)
    tok = CharTokenizer.fit(task.texts())
    model = Seq2SeqTransformer(Seq2SeqConfig(tok.vocab_size, tok.vocab_size, d_model=64))
    result = train_seq2seq(model, task, tok, tok, TrainConfig(steps=300, run_dir="runs/copy"))
"""

from qkv.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from qkv.train.config import METRIC_MODES, SCHEDULES, TrainConfig
from qkv.train.lm import LM_METRICS, evaluate_lm, train_lm
from qkv.train.loop import Callback, Job, TrainResult, fit, seed_everything
from qkv.train.losses import LossParts, token_loss
from qkv.train.metrics import bleu, chrf, exact_match, perplexity, token_accuracy
from qkv.train.progress import MetricsLog, ProgressBar, loss_curves, plot_loss_curve
from qkv.train.schedules import lr_at, make_optimizer, paper_peak_lr, parameter_groups
from qkv.train.seq2seq import SEQ2SEQ_METRICS, evaluate_seq2seq, train_seq2seq

__all__ = [
    "LM_METRICS",
    "METRIC_MODES",
    "SCHEDULES",
    "SEQ2SEQ_METRICS",
    "Callback",
    "Checkpoint",
    "CheckpointError",
    "FineTuneRun",
    "FineTuneSpec",
    "Job",
    "LoRAOptions",
    "LossParts",
    "MetricsLog",
    "ProgressBar",
    "TrainConfig",
    "TrainResult",
    "bleu",
    "chrf",
    "evaluate_lm",
    "evaluate_seq2seq",
    "exact_match",
    "finetune",
    "fit",
    "load_checkpoint",
    "loss_curves",
    "lr_at",
    "make_optimizer",
    "paper_peak_lr",
    "parameter_groups",
    "perplexity",
    "plot_loss_curve",
    "resume_finetune",
    "save_checkpoint",
    "seed_everything",
    "token_accuracy",
    "token_loss",
    "train_lm",
    "train_seq2seq",
]

# Fine-tuning brings qkv.pretrained (its tokenizers and name maps): loaded when first named.
_FINETUNE = {"FineTuneRun": "finetuning", "finetune": "finetuning", "resume_finetune": "finetuning",
             "FineTuneSpec": "finetune_spec", "LoRAOptions": "finetune_spec"}


def __getattr__(name: str):
    if name in _FINETUNE:
        import importlib

        value = getattr(importlib.import_module(f"qkv.train.{_FINETUNE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'qkv.train' has no attribute {name!r}")
