"""The gateway: the only thing a harness sees. It speaks four API dialects, forwards every call to the
policy's inference server and records the exact token data of each call."""
