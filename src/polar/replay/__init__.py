"""Record and replay: a session a gateway recorded, served back as an inference server (`polar replay`).

A harness run reproduced offline, a CLI upgrade diffed against a recording, a bug report carried as a store
file: the replay answers each request that is a recorded call with exactly what the policy answered then
(message, token ids, logprobs), and names where any other request first differs.
"""

from polar.replay.recording import Mismatch, Recording, RecordingError
from polar.replay.server import create_replay_app

__all__ = ["Mismatch", "Recording", "RecordingError", "create_replay_app"]
