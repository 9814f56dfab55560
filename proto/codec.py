"""Encode and decode bus messages; one error type for everything a receiver may reject.

Decoding is strict about what matters and lenient about what may evolve: unknown fields are skipped (a newer sender
may add fields with defaults), but a wrong `schema_version`, a missing required field, a wrong type, a value out of
range or bytes that are not JSON raise `ProtoError`, which names the subject and the field so the receiver can log,
count and answer it without crashing.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any, TypeVar, Union

import msgspec

from proto.messages import ALL_MESSAGES, SCHEMA_VERSION, Message

M = TypeVar("M", bound=Message)

_encoder = msgspec.json.Encoder()
_PATH = re.compile(r"at `\$\.?([^`]*)`")


class ProtoError(ValueError):
    """Bytes on `subject` that are not a valid message of the expected kind.

    kind: "decode" (malformed bytes or field), "schema_version", "unexpected_type".
    """

    def __init__(self, subject: str, field: str, reason: str, kind: str = "decode") -> None:
        self.subject = subject
        self.field = field
        self.reason = reason
        self.kind = kind
        where = f" field `{field}`:" if field else ""
        super().__init__(f"proto: cannot decode message on `{subject}`:{where} {reason}")


class _Envelope(msgspec.Struct):
    """Just enough of any message to tell its version and type before a full decode."""

    schema_version: Any = None
    type: Any = None


_envelope_decoder = msgspec.json.Decoder(_Envelope)


def encode(msg: Message) -> bytes:
    """JSON bytes of a message (the tag `type` and `schema_version` included)."""
    return _encoder.encode(msg)


@cache
def _decoder(types: tuple[type[Message], ...]) -> msgspec.json.Decoder:
    target = types[0] if len(types) == 1 else Union[types]  # noqa: UP007 - runtime Union of a tuple
    return msgspec.json.Decoder(target)


def decode(data: bytes | bytearray | memoryview, subject: str = "", expected: Any = None) -> Message:
    """Decode bytes received on `subject` into a message.

    `expected` is a message class or a tuple of them (default: any message of the contract).
    Raises ProtoError (never anything else) on malformed bytes, a wrong schema version or an unexpected type, and
    on any other failure of the decoder on these bytes (e.g. RecursionError on deep nesting).
    """
    types: tuple[type[Message], ...]
    if expected is None:
        types = ALL_MESSAGES
    elif isinstance(expected, tuple):
        types = expected
    else:
        types = (expected,)
    try:
        msg = _decoder(types).decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _explain(data, subject, types, exc) from None
    except Exception as exc:  # noqa: BLE001 - the peer's bytes, not our bug (see below)
        # Not msgspec's own error types, but still caused by the peer's bytes alone: msgspec's decoder recurses
        # per nesting level and raises RecursionError on `{"a":{"a":...` a few hundred deep (MemoryError on a
        # huge payload is the same story). Every such failure is bad input like any other: the caller counts it
        # and terminates the message. Letting it escape once killed a service's consuming task for good.
        raise ProtoError(subject, "", f"undecodable payload ({type(exc).__name__}: {exc})") from None
    if msg.schema_version != SCHEMA_VERSION:
        raise _version_error(subject, msg.schema_version)
    return msg


def decode_as(data: bytes | bytearray | memoryview, cls: type[M], subject: str = "") -> M:
    """Decode a message that must be of class `cls` (typed convenience over `decode`)."""
    msg = decode(data, subject, cls)
    assert isinstance(msg, cls)
    return msg


def _version_error(subject: str, version: Any) -> ProtoError:
    return ProtoError(
        subject,
        "schema_version",
        f"schema version {version!r} is not supported (this build speaks {SCHEMA_VERSION})",
        kind="schema_version",
    )


def _explain(data: Any, subject: str, types: tuple[type[Message], ...], exc: Exception) -> ProtoError:
    """Turn msgspec's error into one that names the field; a wrong version wins over a field error."""
    try:
        env = _envelope_decoder.decode(data)
    except Exception:  # noqa: BLE001 - only a better message is at stake here
        env = None
    if env is not None and env.schema_version is not None and env.schema_version != SCHEMA_VERSION:
        return _version_error(subject, env.schema_version)
    text = str(exc)
    if env is not None and "type" in text and "Invalid value" in text:
        names = ", ".join(t.__struct_config__.tag for t in types)  # type: ignore[attr-defined]
        return ProtoError(
            subject,
            "type",
            f"unexpected message type {env.type!r} (expected one of: {names})",
            kind="unexpected_type",
        )
    match = _PATH.search(text)
    field = match.group(1) if match else ""
    reason = _PATH.sub("", text).rstrip(" -") or text
    return ProtoError(subject, field, reason)
