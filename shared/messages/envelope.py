"""What every wire message shares: the protocol version it carries, and a bound both sides keep."""

from __future__ import annotations

import msgspec

__all__ = ["PROTOCOL_VERSION", "MAX_TOP_LOGPROBS", "Msg"]

PROTOCOL_VERSION = 1

# OpenAI's bound on the alternatives a token's logprobs list; every door and the worker take the same.
MAX_TOP_LOGPROBS = 20


class Msg(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=False):
    """Base of every wire message: the protocol version rides in each one."""

    v: int = PROTOCOL_VERSION
