"""Text to speech: Orpheus's prompt and codec-token format (``orpheus``, pure),
the SNAC decoder on its own thread (``snac_codec``), and a request's stream of
PCM as frames complete (``stream``). The frontend serves it as ``/v1/audio/speech``."""
