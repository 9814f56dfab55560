"""The wire contract: every message round-trips; bad bytes and wrong versions raise ProtoError naming the field."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import proto
from proto import SCHEMA_VERSION, GenerateRequest, ProtoError, Subjects, TurnSubmitted
from proto.examples import EXAMPLES
from proto.messages import ALL_MESSAGES

EXAMPLE_LIST = list(EXAMPLES.values())


def test_every_message_has_an_example() -> None:
    assert set(EXAMPLES) == set(ALL_MESSAGES)


@pytest.mark.parametrize("msg", EXAMPLE_LIST, ids=lambda m: type(m).__name__)
def test_round_trip_and_tag(msg: proto.Message) -> None:
    data = proto.encode(msg)
    payload = json.loads(data)
    assert payload["schema_version"] == SCHEMA_VERSION
    assert payload["type"] == type(msg).__struct_config__.tag
    assert proto.decode(data, "s") == msg
    assert proto.decode_as(data, type(msg), "s") == msg


@pytest.mark.parametrize("msg", EXAMPLE_LIST, ids=lambda m: type(m).__name__)
def test_wrong_schema_version_is_rejected(msg: proto.Message) -> None:
    payload = json.loads(proto.encode(msg))
    payload["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(ProtoError) as info:
        proto.decode(json.dumps(payload).encode(), "prorsa.x")
    assert info.value.kind == "schema_version" and info.value.field == "schema_version"
    assert "prorsa.x" in str(info.value)


def test_a_schema_1_turn_is_refused_by_name() -> None:
    """A whole-context request of schema 1 (before the lean wire): refused, saying which version each side speaks."""
    payload = json.loads(proto.encode(EXAMPLES[GenerateRequest]))
    for lean_field in ("prefix_turn", "prefix_len", "context_logged"):
        del payload[lean_field]
    payload["schema_version"] = 1
    with pytest.raises(
        ProtoError, match=r"schema version 1 is not supported \(this build speaks 2\)"
    ) as info:
        proto.decode(json.dumps(payload).encode(), "prorsa.work.prefill.any", GenerateRequest)
    assert info.value.kind == "schema_version"


def test_sampling_fields_added_within_schema_2_default_to_neutral_and_are_bounded() -> None:
    """A request from a sender before penalties, min_tokens, top_logprobs and logprobs_mode decodes with each at the
    value that changes nothing; values outside what an engine takes are refused naming the field."""
    payload = json.loads(proto.encode(EXAMPLES[GenerateRequest]))
    added = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "top_logprobs")
    for name in (*added, "logprobs_mode"):
        del payload["sampling"][name]
    s = proto.decode_as(json.dumps(payload).encode(), GenerateRequest, "s").sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_tokens, s.top_logprobs) == (
        0.0,
        0.0,
        1.0,
        0,
        0,
    )
    assert s.logprobs_mode == ""
    for name, bad in [
        ("presence_penalty", 2.5),
        ("repetition_penalty", 0.0),
        ("min_tokens", -1),
        ("top_logprobs", 21),
        ("logprobs_mode", "raw_logits"),
    ]:
        wrong = json.loads(proto.encode(EXAMPLES[GenerateRequest]))
        wrong["sampling"][name] = bad
        with pytest.raises(ProtoError) as info:
            proto.decode(json.dumps(wrong).encode(), "prorsa.work.prefill.any")
        assert info.value.field == f"sampling.{name}"


def test_field_error_names_subject_and_field() -> None:
    payload = json.loads(proto.encode(EXAMPLES[TurnSubmitted]))
    payload["prompt_tokens"] = -5
    with pytest.raises(ProtoError) as info:
        proto.decode(json.dumps(payload).encode(), "prorsa.lifecycle")
    assert info.value.field == "prompt_tokens"
    assert "prorsa.lifecycle" in str(info.value) and "prompt_tokens" in str(info.value)


def test_unexpected_type_on_a_subject() -> None:
    data = proto.encode(EXAMPLE_LIST[0])
    with pytest.raises(ProtoError) as info:
        proto.decode(data, "prorsa.cmd.e1", proto.RoleSwitchCommand)
    assert info.value.kind == "unexpected_type"


def test_unknown_fields_are_skipped_for_evolution() -> None:
    payload = json.loads(proto.encode(EXAMPLES[TurnSubmitted]))
    payload["added_in_a_later_minor"] = {"x": 1}
    assert proto.decode(json.dumps(payload).encode()) == EXAMPLES[TurnSubmitted]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_proto_error(data: bytes) -> None:
    """Arbitrary bytes either decode to a valid message or raise ProtoError: never anything else."""
    try:
        msg = proto.decode(data, "s")
    except ProtoError as err:
        assert err.subject == "s"
    else:
        assert isinstance(msg, proto.Message)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(EXAMPLE_LIST), st.data())
def test_mutated_messages_decode_or_raise_proto_error(msg: proto.Message, data: st.DataObject) -> None:
    """Replace one field of a valid payload with arbitrary JSON: the decoder either accepts it or names the field."""
    payload = json.loads(proto.encode(msg))
    key = data.draw(st.sampled_from(sorted(payload)))
    payload[key] = data.draw(_json)
    raw = json.dumps(payload).encode()
    try:
        out = proto.decode(raw, "s")
    except ProtoError as err:
        assert err.field in (key, "type", "schema_version") or err.field.startswith(key) or err.field == ""
    else:
        assert isinstance(out, proto.Message)


def test_subjects_are_namespaced_and_validated() -> None:
    a, b = Subjects("team-a"), Subjects("team-b")
    assert a.lifecycle != b.lifecycle and a.work_stream != b.work_stream
    assert a.prefill_work_for("engine-1") == "team-a.work.prefill.engine.engine-1"
    with pytest.raises(ValueError):
        a.engine_stats("bad.id")
    with pytest.raises(ValueError):
        Subjects("has space")


def test_struct_is_frozen() -> None:
    msg = EXAMPLES[TurnSubmitted]
    with pytest.raises(AttributeError):
        msg.turn = 4  # type: ignore[misc]
    assert isinstance(msg, msgspec.Struct)


def test_proto_readme_is_generated_from_the_contract() -> None:
    from pathlib import Path

    from proto.docs import render

    readme = Path(__file__).resolve().parents[1] / "proto" / "README.md"
    assert readme.read_text() == render(), "run: python -m proto.docs > proto/README.md"
