"""msgspec msgpack codec: one typed decoder per channel, made once."""

from __future__ import annotations

from typing import Any

import msgspec

from transport.errors import DecodeError


class Codec:
    """Encodes any message of ``union`` and decodes only those.

    An undecodable record, or a message outside the union, raises
    ``DecodeError`` naming the channel: it is never skipped.
    """

    def __init__(self, union: Any, channel: str):
        self.union = union
        self.channel = channel
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(union)

    def encode(self, msg: Any) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes | memoryview) -> Any:
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            raise DecodeError(f"channel {self.channel!r}: undecodable message ({err})") from None
