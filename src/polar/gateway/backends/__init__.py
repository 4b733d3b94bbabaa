"""Clients of the policy's inference server, one module per server kind."""
