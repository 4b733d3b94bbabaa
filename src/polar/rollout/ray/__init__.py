"""Gateway nodes as Ray actors: `polar serve --ray` and `polar run --ray` (docs/deploy.md).

One actor per eligible Ray node hosts an ordinary gateway node (`polar.rollout.node.Node`, what
`polar node --server URL` runs): it registers with the rollout server over HTTP with the server's token and
heartbeats like any node, so the server's one scheduler places sessions on Ray nodes and HTTP nodes alike.
Ray places the actors, restarts a crashed one on its Ray node (same node id, same store: the journal
reports what it owed), and tells the driver when a Ray node dies; the driver (`cluster.RayNodes`) then
tells the server at once (`POST /nodes/{id}/lost`), which ends that node's sessions ERROR with the reason
instead of waiting for `node_lost_after_s` of silence. Sessions are never re-run elsewhere.

`import ray` happens only in this subpackage's functions, so polar without the `ray` extra never needs it.
"""

from __future__ import annotations

from polar.rollout.ray.spec import NodeRequest, RayNodeSpec, RayPlacement

__all__ = ["NodeRequest", "RayNodeSpec", "RayPlacement"]
