"""The trainer's client of the rollout server: `RolloutClient` (submit tasks, stream results, manage nodes).

This is the public import path; the code lives beside the server's wire types in `polar.rollout.client`, so
that parts of the rollout service that call the server (the Ray node manager) import nothing above them.
"""

from polar.rollout.client import RolloutClient as RolloutClient
from polar.rollout.client import RolloutError as RolloutError
