"""Transport errors. Each message names the channel."""


class ChannelError(RuntimeError):
    """Base class for channel failures."""


class ChannelClosed(ChannelError):
    """End of channel: the writer closed it (and every message before was read),
    or the reader closed it and a writer tried to send."""


class ChannelBroken(ChannelClosed):
    """The peer process died without closing the channel."""


class ChannelFull(ChannelError):
    """``send_nowait`` found no room: the reader is behind (backpressure)."""


class DecodeError(ChannelError):
    """Bytes that are not a message of the channel's union."""


class MessageTooLarge(ChannelError, ValueError):
    """A message larger than the ring could ever hold (a sizing error, not backpressure)."""
