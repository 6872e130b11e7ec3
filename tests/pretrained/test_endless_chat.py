"""``qkv chat --endless`` (issue 29): a conversation in an attention-sink cache. The first turn
equals the plain chat (nothing dropped, the same tokens); later turns feed only their new text;
the cache never holds more than ``sinks + recent`` positions."""

from __future__ import annotations

from functools import cache

import pytest

import qkv.pretrained
from qkv.pretrained.endless_chat import EndlessChat


@cache
def smollm2():
    return qkv.pretrained.load("SmolLM2-135M-Instruct")


def _say(chat: EndlessChat, messages: list, text: str, n: int = 12) -> str:
    messages.append({"role": "user", "content": text})
    reply = "".join(chat.reply(messages, max_new_tokens=n))
    messages.append({"role": "assistant", "content": reply})
    return reply


@pytest.mark.self_check
def test_the_first_turn_equals_the_plain_chat():
    bundle = smollm2()
    messages = [{"role": "user", "content": "Name three colours."}]
    plain = "".join(bundle.stream(messages, max_new_tokens=16))
    assert "".join(EndlessChat(bundle).reply(messages, max_new_tokens=16)) == plain


@pytest.mark.self_check
def test_turns_feed_only_what_is_new_and_memory_stays_flat():
    bundle = smollm2()
    chat, messages = EndlessChat(bundle, sinks=4, recent=96), []
    held = []
    for question in ["Hi!", "What is two plus two?", "And three plus three?",
                     "Say a word that rhymes with cat.", "Thanks, bye."]:  # fmt: skip
        assert _say(chat, messages, question).strip(), messages
        held.append(chat.held)
        assert chat.fed.endswith(messages[-1]["content"])
    assert chat.cache.length > 100 and max(held) <= 100, (chat.cache.length, held)


def test_an_edited_conversation_starts_the_cache_over():
    bundle = smollm2()
    chat, messages = EndlessChat(bundle), []
    _say(chat, messages, "Hello there.")
    length = chat.cache.length
    edited = [{"role": "user", "content": "Something else entirely."}]
    "".join(chat.reply(edited, max_new_tokens=4))
    assert chat.cache.length < length + 40 and chat.fed.startswith(
        bundle.tokenizer.apply_chat_template(edited))


def test_bad_sizes_and_models_are_refused():
    bundle = smollm2()
    with pytest.raises(ValueError, match="recent"):
        EndlessChat(bundle, recent=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        next(EndlessChat(bundle).reply([{"role": "user", "content": "x"}], max_new_tokens=0))
