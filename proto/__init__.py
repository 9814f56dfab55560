"""Prorsa's wire contract: every message on the bus, every subject, and the codec.

Services and trainers couple only through this package. Messages are frozen msgspec Structs, tagged by `type`,
encoded as JSON (readable from any language), each carrying the contract's `schema_version`. Decoding malformed bytes
or a wrong version raises one error type, `ProtoError`, which names the subject and the offending field.
See proto/README.md for every subject with an example payload.
"""

from proto.codec import ProtoError, decode, decode_as, encode
from proto.messages import *  # noqa: F403 - the message catalogue is the package's public API
from proto.messages import SCHEMA_VERSION
from proto.messages import __all__ as _message_names
from proto.subjects import POLICY_KEY_CURRENT, POLICY_KEY_PAUSED, POLICY_KEY_TRANSFER, Subjects, check_token

__all__ = [
    *_message_names,
    "SCHEMA_VERSION",
    "POLICY_KEY_CURRENT",
    "POLICY_KEY_PAUSED",
    "POLICY_KEY_TRANSFER",
    "ProtoError",
    "Subjects",
    "check_token",
    "decode",
    "decode_as",
    "encode",
]
