"""polar: agentic reinforcement learning over any agent harness, unmodified."""

__version__ = "0.1.0"
