"""The gateway node: the capturing gateway plus the session lifecycle INIT -> READY -> RUNNING -> POSTRUN,
each stage with its own bounded pool (see `node.py`)."""

from polar.rollout.node.admission import AdmissionError
from polar.rollout.node.config import NodeConfig
from polar.rollout.node.node import Node

__all__ = ["AdmissionError", "Node", "NodeConfig"]
