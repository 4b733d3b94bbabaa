"""Durable capture: completion records in an embedded SQLite store."""

from polar.store.records import CompletionRecord, FailureRecord, SessionInfo

__all__ = ["CompletionRecord", "FailureRecord", "SessionInfo"]
