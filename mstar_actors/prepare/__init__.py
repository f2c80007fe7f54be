"""Prepare's cores: pure classes the prepare actor (``actors/prepare.py``) runs around."""

from mstar_actors.prepare.ordering import PendingRequest, PendingRequests

__all__ = ["PendingRequest", "PendingRequests"]
