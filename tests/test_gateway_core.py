"""The gateway's pure parts: incremental chat templating, sessions and prefix breaks, sampling refusals, stop
strings, the Hermes tool-call parser, and the tiny chat tokenizer `prorsa up` serves with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prorsa.gateway.sampling import UnsupportedField, build_sampling, cut_at_stop
from prorsa.gateway.sessions import SessionError, SessionTable
from prorsa.gateway.tool_parser import parse_hermes

pytest.importorskip("transformers", reason="the chat template needs transformers")
pytest.importorskip("tokenizers", reason="the tiny tokenizer needs tokenizers")

from prorsa.gateway.chat_template import ChatTokenizer  # noqa: E402
from prorsa.gateway.tiny_tokenizer import build_tiny_tokenizer  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return ChatTokenizer.load(build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def test_tiny_tokenizer_is_deterministic_and_chatml(tmp_path: Path, tok: ChatTokenizer) -> None:
    again = build_tiny_tokenizer(str(tmp_path / "again"))
    assert (Path(again) / "tokenizer.json").read_text() == (Path(tok.name) / "tokenizer.json").read_text()
    assert tok.eot_id == 2 and tok.tok.convert_tokens_to_ids("<|im_start|>") == 1  # the tiny Qwen2's eos/bos
    text = tok.decode(tok.render([{"role": "user", "content": "run ls"}], TOOLS, True), skip_special=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert '"name": "bash"' in text
    assert tok.decode([5, 10**6]) == "<tool_response>"  # out-of-vocabulary ids render as nothing
    assert tok.vocab_size == 32000  # the tiny Qwen2's: every id it samples has text


@pytest.mark.parametrize("closed", [True, False])
def test_continuation_equals_the_full_template_token_for_token(tok: ChatTokenizer, closed: bool) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "run ls please"}]
    reply = 'ok <tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    out = tok.encode(reply) + ([tok.eot_id] if closed else [])
    new = [{"role": "tool", "content": "a.py"}, {"role": "tool", "content": "b.py"}]
    incremental = tok.first_prompt(msgs, TOOLS) + out + tok.continuation(out, new, TOOLS)
    whole = tok.render([*msgs, {"role": "assistant", "content": reply}, *new], TOOLS, True)
    assert incremental == whole  # a cut output gets its end-of-turn token, as the template would add


def test_sessions_extend_or_break() -> None:
    table = SessionTable(max_sessions=2)
    s, fresh = table.acquire("t1", 0.0)
    assert fresh
    with pytest.raises(SessionError) as busy:
        table.acquire("t1", 0.1)
    assert busy.value.status == 409
    msgs = [{"role": "user", "content": "a"}]
    table.record(s, [1, 2], [3], 1.0, messages=msgs, tools=None)
    table.release(s)
    assert table.extends(s, [1, 2, 3, 4]) and not table.extends(s, [1, 9, 3])
    asst = {"role": "assistant", "content": "x"}
    assert table.plan_chat(s, [*msgs, asst, {"role": "user", "content": "b"}], None).new_messages == [
        {"role": "user", "content": "b"}
    ]
    edited = table.plan_chat(
        s, [{"role": "user", "content": "A"}, asst, {"role": "user", "content": "b"}], None
    )
    assert edited.new_messages is None and "changed" in edited.prefix_break
    assert "tools" in table.plan_chat(s, [*msgs, asst, msgs[0]], TOOLS).prefix_break
    assert table.idle(60.0, 30.0) == ["t1"] and table.idle(20.0, 30.0) == []
    table.finish("t1")
    with pytest.raises(SessionError) as finished:
        table.acquire("t1", 2.0)
    assert finished.value.status == 409 and "t1" not in table.sessions  # its state is gone, its id refused
    with pytest.raises(SessionError) as unknown:
        table.finish("nope")
    assert unknown.value.status == 404
    table.acquire("t2", 0.0)
    table.acquire("t3", 0.0)  # a finished session no longer counts against the bound
    with pytest.raises(SessionError) as full:
        table.acquire("t4", 0.0)
    assert full.value.status == 429


def test_a_session_found_on_the_bus_is_forgotten_and_one_closed_there_is_finished() -> None:
    table = SessionTable()
    s, fresh = table.acquire("lost-1", 0.0)
    assert fresh
    table.forget("lost-1")  # the caller found it open on the bus: nothing of it stays here
    table.release(s)
    assert len(table) == 0 and table.idle(10_000.0, 1.0) == []
    with pytest.raises(SessionError) as unknown:
        table.get("lost-1")
    assert unknown.value.status == 404  # still unknown here: /finish looks on the bus again
    table.closed("lost-1")  # closed there
    with pytest.raises(SessionError) as finished:
        table.acquire("lost-1", 1.0)
    assert (finished.value.status, finished.value.code) == (409, "session_finished")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"min_p": 0.1}, "min_p"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"logprobs_mode": "raw_logits"}, "logprobs_mode"),
        ({"top_p": 0.0}, "top_p"),
        ({"stop": [""]}, "stop"),
        # Honoured, within the contract's bounds (proto.SamplingParams): outside them refused by name.
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(fields: dict, field: str) -> None:
    with pytest.raises(UnsupportedField) as exc:
        build_sampling(fields, 1000)
    assert exc.value.field == field


def test_sampling_maps_what_engines_honour() -> None:
    s = build_sampling(
        {
            "max_tokens": 5000,
            "temperature": 0.0,
            "top_k": 20,
            "seed": 7,
            "stop": "END",
            "presence_penalty": 0.0,
        },
        1000,
    )
    assert (s.params.max_tokens, s.params.temperature, s.params.top_k, s.params.seed) == (1000, 0.0, 20, 7)
    assert s.stop == ("END",) and s.params.logprobs
    assert (s.params.top_logprobs, s.params.min_tokens, s.params.logprobs_mode) == (0, 0, "")


def test_penalties_min_tokens_and_top_logprobs_reach_the_engines() -> None:
    fields = {"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "min_tokens": 4}
    fields |= {"top_logprobs": 5, "logprobs_mode": "processed_logprobs", "max_tokens": 16}
    p = build_sampling(fields, 1000).params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.min_tokens, p.top_logprobs, p.logprobs_mode, p.max_tokens) == (4, 5, "processed_logprobs", 16)
    capped = build_sampling({"min_tokens": 40, "max_tokens": 50}, 30).params
    assert (capped.max_tokens, capped.min_tokens) == (30, 30)  # the gateway's cap bounds both


def test_stop_strings_cut_at_a_token_boundary() -> None:
    vocab = {1: "he", 2: "llo", 3: " EN", 4: "D!", 5: "more"}

    def decode(ids: list[int]) -> str:
        return "".join(vocab[i] for i in ids)

    assert cut_at_stop([1, 2, 3, 4, 5], ("END",), decode) == (4, "hello ")
    assert cut_at_stop([1, 2], ("END",), decode) is None


def test_a_stop_string_within_min_tokens_does_not_cut() -> None:
    vocab = {1: "a", 2: "X", 3: "b", 4: "c", 5: "X", 6: "d", 7: "X"}

    def decode(ids: list[int]) -> str:
        return "".join(vocab[i] for i in ids)

    ids = [1, 2, 3, 4, 5, 6]  # "aXbcXd": X completes with token 2 and token 5
    assert cut_at_stop(ids, ("X",), decode) == (2, "a")
    # Token 2 is the min_tokens-th: a stop string it completes counts.
    assert cut_at_stop(ids, ("X",), decode, min_tokens=2) == (2, "a")
    assert cut_at_stop(ids, ("X",), decode, min_tokens=3) == (5, "aXbc")
    assert cut_at_stop(ids, ("cX",), decode, min_tokens=5) == (5, "aXb")  # completed by token 5: counts
    assert cut_at_stop(ids, ("X",), decode, min_tokens=6) is None


def test_hermes_parser() -> None:
    content, calls = parse_hermes(
        'let me look\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    )
    assert content == "let me look" and [(c.name, c.arguments) for c in calls] == [
        ("bash", '{"command": "ls"}')
    ]
    assert parse_hermes("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_hermes("plain") == ("plain", [])


def test_vllms_tool_parsers_are_used_by_name(tok: ChatTokenizer) -> None:
    """Where vLLM is installed its parsers are used by name (`--tool-parser`); its hermes reads what ours does."""
    pytest.importorskip("vllm", reason="vLLM's tool parsers need vLLM")
    from prorsa.gateway.tool_parser import make_parser

    text = 'let me look\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    for parse in (make_parser("hermes", tok.tok), make_parser("vllm:hermes", tok.tok)):
        content, calls = parse(text, TOOLS)
        assert content.strip() == "let me look"
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("bash", {"command": "ls"})]
        assert parse("no call here", TOOLS) == ("no call here", [])
    with pytest.raises(ValueError, match="unknown tool parser"):
        make_parser("no-such-parser", tok.tok)
    with pytest.raises(
        ValueError, match="does not fit this tokenizer"
    ):  # its markers are not in our vocabulary
        make_parser("llama3_json", tok.tok)
