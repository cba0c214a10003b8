#!/usr/bin/env bash
# up-2node.sh -- 2-node SLURM cluster on ONE host for vlmrun's multi-node tests: nodes n1, n2, each
# slurmd in its own network namespace with its own address (10.200.0.11, .12) on a private bridge.
# vlmrun needs the namespaces (SLURM_NETNS=1, the default here): Ray rewrites a 127.0.0.1 node address
# to the host's outward address, so two nodes on 127.0.0.1 cannot form a Ray cluster.
# SLURM_NETNS=0 gives the older layout (two slurmd on 127.0.0.1, ports 17001/17002): SLURM only.
# Stop it with down.sh. See up.sh for the other knobs.
exec env SLURM_NNODES="${SLURM_NNODES:-2}" SLURM_NETNS="${SLURM_NETNS:-1}" bash "$(dirname "$0")/up.sh" "$@"
