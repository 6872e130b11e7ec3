"""A folder's ``generation_config.json`` (issue 29): qkv decodes a folder as transformers'
``generate`` does with no arguments, reading the same file: Opus-MT's beams, pad ban, length
cap and forced EOS; a greedy folder's n-gram ban and repetition penalty. Bad files are named."""

from __future__ import annotations

import json

import pytest
import torch
from test_hf_seq2seq import SOURCES, _batch, _hf_model, _load, _tokenizer

from qkv.data.files import BadFileError
from qkv.pretrained.generation_config import read_generation_config

CONFIGS = {
    "opus-mt": dict(num_beams=4, bad_words_ids=[[95]], max_length=20, length_penalty=1.0,
                    early_stopping=False),
    "greedy-controls": dict(num_beams=1, no_repeat_ngram_size=2, repetition_penalty=1.3,
                            max_length=16),
    "beams-early": dict(num_beams=3, early_stopping=True, length_penalty=0.6, max_length=18),
}  # fmt: skip


def _folder(tmp_path, settings: dict):
    torch.manual_seed(0)
    ref = _hf_model("marian").eval()
    with torch.no_grad():
        ref.final_logits_bias[0, ref.config.eos_token_id] = 1.0
    ref.generation_config.update(**settings)
    folder = tmp_path / "marian"
    ref.save_pretrained(folder)
    _tokenizer(folder, "marian")
    return folder, ref


@pytest.mark.parametrize("name", CONFIGS)
def test_a_folder_decodes_as_transformers_generate_with_no_arguments(tmp_path, name):
    folder, ref = _folder(tmp_path, CONFIGS[name])
    saved = json.loads((folder / "generation_config.json").read_text())
    assert all(saved[k] == v for k, v in CONFIGS[name].items()), saved
    bundle = _load(folder)
    _, src, keep = _batch(bundle)
    with torch.no_grad():
        out = ref.generate(src, attention_mask=keep)  # the folder's settings, nothing else
    expected = [bundle.tokenizer.decode(r, skip_special_tokens=True) for r in out]
    assert bundle.translate(SOURCES) == expected
    with torch.no_grad():  # the same length, none of the folder's other settings
        n = CONFIGS[name]["max_length"] - 1
        plain = ref.generate(src, attention_mask=keep, num_beams=1, max_new_tokens=n,
                             no_repeat_ngram_size=0, repetition_penalty=1.0,
                             bad_words_ids=None, forced_eos_token_id=None)  # fmt: skip
    assert expected != [bundle.tokenizer.decode(r, skip_special_tokens=True) for r in plain], \
        "a trivial test: the folder's settings change nothing"  # fmt: skip


def test_bad_generation_configs_are_named(tmp_path):
    file = tmp_path / "generation_config.json"
    for text, match in [("{", "not valid JSON"), ("[1]", "expected a JSON object"),
                        ('{"num_beams": 0}', "num_beams must be an int >= 1"),
                        ('{"bad_words_ids": [5]}', "bad_words_ids must be"),
                        ('{"early_stopping": "sometimes"}', "early_stopping must be"),
                        ('{"repetition_penalty": -1}', "repetition_penalty must be")]:  # fmt: skip
        file.write_text(text)
        with pytest.raises(BadFileError, match=match) as info:
            read_generation_config(tmp_path, eos_id=0)
        assert "generation_config.json" in str(info.value)
    assert read_generation_config(tmp_path / "nowhere", eos_id=0) is None
