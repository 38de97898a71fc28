"""Prompt validation: empty prompts and malformed chat messages are refused by name before any work, with one
ValueError / TypeError (``check_conversation`` alone, and through ``LLM.generate``)."""

from __future__ import annotations

import pytest

from kvcache.engine import LLM, SamplingParams
from kvcache.engine.prompts import CHAT_ROLES, check_conversation

USER = {"role": "user", "content": "Hi!"}


@pytest.mark.parametrize("messages, error, match", [
    ([], ValueError, r"prompts\[2\]: expected a conversation with at least one message"),
    ("hello", TypeError, r"prompts\[2\]: expected a conversation"),
    ([USER, "hi"], TypeError, r"prompts\[2\]\[1\]: expected a \{'role', 'content'\} dict, got str"),
    ([{"role": "user"}], ValueError, r"prompts\[2\]\[0\]: expected a 'content' key, got the keys \['role'\]"),
    ([USER, {"content": "x"}], ValueError, r"prompts\[2\]\[1\]: expected a 'role' key"),
    ([{"role": "robot", "content": "x"}], ValueError, r"prompts\[2\]\[0\]\['role'\]: expected one of .*'robot'"),
    ([{"role": "user", "content": None}], TypeError, r"prompts\[2\]\[0\]\['content'\]: expected a str, got NoneType"),
])
def test_check_conversation_names_the_message(messages, error, match):
    with pytest.raises(error, match=match):
        check_conversation(messages, "prompts[2]")


def test_check_conversation_accepts_every_role():
    for role in CHAT_ROLES:
        check_conversation([{"role": role, "content": "x"}])  # no exception


@pytest.fixture(scope="module")
def llm(smollm):
    model, tok = smollm
    return LLM(model, tokenizer=tok, max_num_seqs=2, max_model_len=128)


@pytest.mark.parametrize("prompts, error, match", [
    ([""], ValueError, r"prompts\[0\]: expected a prompt of at least one token, got '' \(0 tokens\)"),
    (["Hello", ""], ValueError, r"prompts\[1\]: expected a prompt of at least one token"),
    ([{"prompt": ""}], ValueError, r"prompts\[0\]: expected a prompt of at least one token"),
    ([[{"role": "user"}]], ValueError, r"prompts\[0\]\[0\]: expected a 'content' key"),
    ([{"role": "user"}], ValueError, r"prompts\[0\]\[0\]: expected a 'content' key"),  # one conversation
    ([[USER], [{"role": "robot", "content": "x"}]], ValueError, r"prompts\[1\]\[0\]\['role'\]: expected one of"),
    ([{"content": "no role"}], ValueError, r"prompts\[0\]\[0\]: expected a 'role' key"),
])
def test_generate_refuses_before_any_work(llm, prompts, error, match):
    before = llm.stats
    with pytest.raises(error, match=match):
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))
    assert llm.stats is before  # nothing ran: the last call's counters stay
    assert not llm.scheduler.has_unfinished() and llm.allocator.num_used_blocks == 0


def test_stats_cover_the_last_call(llm):
    sp = SamplingParams(max_tokens=3, temperature=0.0)
    llm.generate([[USER], [USER]], sp)
    assert llm.stats.requests == 2 and llm.stats.generated_tokens <= 6
    first = llm.stats
    llm.generate([[USER]], sp)
    assert llm.stats is not first and llm.stats.requests == 1 and first.requests == 2
