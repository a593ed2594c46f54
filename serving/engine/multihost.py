"""One engine across hosts (`jax.distributed`, serving/executor/distributed.py): every
process builds the same engine over one global mesh; process 0 runs the command and its
scheduler, the others run each step it broadcasts until it stops."""

from __future__ import annotations

from collections.abc import Callable

from serving.executor import distributed


def run_multihost(command: Callable[[], int], make_engine: Callable[[], object], *,
                  coordinator_address: str, num_processes: int | None,
                  process_id: int | None) -> int:
    """Join the processes, then run `command()` on process 0 (and tell the others to stop
    when it returns) or follow process 0's steps on a `make_engine()` engine."""
    distributed.initialize(coordinator_address, num_processes, process_id)
    if not distributed.is_leader():
        steps = distributed.follower_loop(make_engine())
        print(f"process {process_id}: followed {steps} steps; leader stopped")
        return 0
    try:
        return command()
    finally:
        distributed.publish_stop()
