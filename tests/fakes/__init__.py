"""Test doubles. Only the policy's inference server is ever faked, and only here."""
