"""Tests run servers with the product's own helper; re-exported here for the fakes and fixtures."""

from polar.serving import ServerThread, free_port, serve

__all__ = ["ServerThread", "free_port", "serve"]
