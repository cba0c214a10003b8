"""`ray start` for one node of a SLURM job, without the head's processes that vlmrun never talks to.

`python -m vlmrun.cluster.ray.start ARGS` runs Ray's own `ray start ARGS` in this process
(`ray.scripts.scripts`), so this process is the node's Ray, as `ray start --block` would be. Two of the
head's processes are left out, as the embedded default's Ray leaves them out (local.py):

- The API server (`dashboard.py`): `ray start` starts it even with `--include-dashboard=false`, then
  without the dashboard's pages, for Ray's job-submission and state APIs over HTTP.
- The Ray Client server (`ray.util.client.server`): `ray start --head` starts it whenever Ray's client
  extras are installed, on port 10001 unless told another, and refuses port 0.

vlmrun's driver joins through the GCS and uses neither; each would be one more Python process at every
attempt's start (docs/measurements.md has what they cost). The autoscaler's monitor is left out by
Ray's own `--no-monitor` (nodes.py). `Node.start_api_server` and `Node.start_ray_client_server` are
Ray's private API (2.60): tests/test_local_ray.py names them, so an upgrade that changes them fails there.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from ray._private import node
    from ray.scripts.scripts import main as ray_main

    node.Node.start_api_server = lambda self, **kw: None
    node.Node.start_ray_client_server = lambda self: None
    sys.argv = ["ray", *argv]
    ray_main()


if __name__ == "__main__":
    main(sys.argv[1:])
