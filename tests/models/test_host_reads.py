"""A decoding step reads values back to the host only to validate its inputs, never per layer;
in qkv's own generation loop it reads nothing.

Counted with a ``TorchFunctionMode`` that sees every way a tensor's value reaches Python
(``item``, ``tolist``, ``bool``/``int``/``float``/``index`` conversions, ``numpy``): a padded
batch (a bool mask and explicit positions) stepped with tokens from outside reads those ids
once (min and max in one transfer); the positions the session computes and, in the
generation loop, the tokens it chose from the logits are in range by construction and are not
read back (``qkv.checks.remember_checked``); the layers read nothing, so the count does not
grow with depth.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from qkv.generate.session import make_session
from qkv.models import DecoderLM, DecoderLMConfig

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
         torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy}


class CountReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _model(style: str, layers: int) -> DecoderLM:
    torch.manual_seed(0)
    if style == "gpt2":
        cfg = DecoderLMConfig.gpt2_style(vocab_size=100, d_model=32, num_layers=layers,
                                         num_heads=2, max_len=64)
    else:
        cfg = DecoderLMConfig.llama_style(vocab_size=100, d_model=32, num_layers=layers,
                                          num_heads=2, num_kv_heads=1, max_len=64)
    return DecoderLM(cfg).eval()


def _reads_per_step(style: str, layers: int, prompts) -> int:
    session = make_session(_model(style, layers), prompts, 8, pad_id=None, bos_id=None)
    with torch.no_grad():
        token = session.first().argmax(-1)
        with CountReads() as count:
            session.next(token)
    return count.reads


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_a_decoding_step_reads_its_inputs_once_and_no_layer_reads(style):
    padded = [[1, 2, 3], [4, 5]]  # left-padded: a bool mask and explicit positions
    shallow, deep = _reads_per_step(style, 1, padded), _reads_per_step(style, 4, padded)
    assert shallow == deep, f"{style}: {shallow} reads with 1 layer, {deep} with 4"
    assert deep <= 1, f"{style}: {deep} host reads in one padded decoding step (the ids)"
    plain = _reads_per_step(style, 4, [[1, 2, 3], [4, 5, 6]])
    assert plain <= 1, f"{style}: {plain} host reads in one unpadded decoding step (ids)"


def _float_mask_reads(layers: int) -> int:
    """Host reads of one forward whose layers all receive the same float mask (T5-style
    relative position biases: one (1, H, T, S) bias per forward)."""
    torch.manual_seed(0)
    cfg = DecoderLMConfig(vocab_size=100, d_model=32, num_layers=layers, num_heads=2,
                          max_len=64, positions="relative")
    model = DecoderLM(cfg).eval()
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad(), CountReads() as count:
        model(ids)
    return count.reads


def test_a_float_mask_is_read_once_per_forward_not_per_layer():
    assert _float_mask_reads(1) == _float_mask_reads(4)


def test_a_mask_changed_in_place_is_checked_again():
    import qkv

    q = torch.randn(1, 2, 4, 8)
    mask = torch.zeros(4, 4)
    qkv.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    mask[0, 0] = float("nan")  # a new version of the same tensor
    with pytest.raises(ValueError, match="attn_mask contains NaN"):
        qkv.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def _generate_reads(style: str, new_tokens: int) -> int:
    """Host reads of qkv's greedy loop over padded prompts (no EOS: the loop's own stop
    check is the one read a step would add)."""
    from qkv.generate import greedy

    model = _model(style, 2)
    with CountReads() as count:
        greedy(model, [[1, 2, 3], [4, 5]], max_new_tokens=new_tokens)
    return count.reads


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_the_generation_loop_reads_nothing_per_step_with_a_bool_mask(style):
    """Tokens chosen from the logits and positions the session computes are in range by
    construction (qkv.checks.remember_checked): the model reads neither back, so a padded
    decoding step of qkv's own loop reads nothing from the device."""
    short, long = _generate_reads(style, 3), _generate_reads(style, 7)
    assert long == short, f"{style}: {(long - short) / 4:.2f} host reads per decoding step"


def test_a_token_changed_in_place_is_read_again():
    """The memo is by identity and version: a checked tensor edited afterwards is checked
    again (the check is skipped only for the values it saw)."""
    from qkv.checks import remember_checked

    model = _model("gpt2", 1)
    ids = torch.tensor([[1, 2, 3]])
    remember_checked(ids, ("ids", 100))
    ids[0, 1] = 1000  # out of the vocabulary, after the check
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=100\)"):
        model(ids)


def test_a_tensor_checked_again_is_the_newest_in_the_memo(monkeypatch):
    """The memo keeps the last checks; a tensor checked again (or a new tensor at a reused
    id) moves to the newest end, so a later eviction drops the oldest check, not it (the
    generation loop's reads per step depended on which ids the allocator reused)."""
    from qkv import checks

    monkeypatch.setattr(checks, "_CHECKED", {})
    first = checks.remember_checked(torch.tensor([1]), "x")
    others = [checks.remember_checked(torch.tensor([i]), "x")
              for i in range(checks._CHECKED_MAX - 2)]  # fmt: skip
    checks.remember_checked(first, "x")  # checked again (the memo is not full yet)
    others += [checks.remember_checked(torch.tensor([i]), "x") for i in range(2)]  # one evicted
    assert checks.checked_before(first, "x"), "the tensor checked last was evicted"
    assert not checks.checked_before(others[0], "x"), "the oldest check was kept"
