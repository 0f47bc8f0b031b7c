"""Start engine replicas on Ray Serve: join the cluster at `ray_address` (or `RAY_ADDRESS`), or
start a local Ray instance that lives as long as this process (the embedded default). Serve's
own HTTP proxy stays off: our server is the ingress, and reaches the replicas through a
deployment handle, so Serve's router (ours, `router.py`) picks each request's replica."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from tutorserve.cluster.replica import EngineReplica
from tutorserve.cluster.router import TutorserveRouter

log = logging.getLogger(__name__)
APP = "tutorserve"
# Serve would otherwise hold a replica's requests past 5 in its own queue; the engine batches
# whatever it is given, and admission is the ingress's (`ClusterFront`).
_MAX_ONGOING = 4096


def start_replicas(
    engine_options: dict[str, Any],
    *,
    replicas: int,
    routing: str,
    ray_address: str | None = None,
    cpus_per_replica: float | None = None,
) -> tuple[DeploymentHandle, Callable[[], None]]:
    """A handle to `replicas` engines, each built from `engine_options`, and a function that
    stops them (and the local Ray instance, if this call started it)."""
    address = ray_address or os.environ.get("RAY_ADDRESS")
    own = address is None
    if own:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        cpus = cpus_per_replica or max(0.1, (os.cpu_count() or 1) / replicas)
        deployment = serve.deployment(
            EngineReplica,
            name="engine",
            num_replicas=replicas,
            ray_actor_options={"num_cpus": cpus},
            max_ongoing_requests=_MAX_ONGOING,
            health_check_period_s=5,
            # Requests still running at shutdown end with the server anyway.
            graceful_shutdown_timeout_s=2,
            request_router_config=RequestRouterConfig(
                request_router_class=TutorserveRouter,
                request_router_kwargs={"policy": routing},
                request_routing_stats_period_s=2,  # adapters resident in slots
            ),
        )
        handle = serve.run(deployment.bind(engine_options), name=APP, route_prefix=None)
    except BaseException:
        _stop(own)
        raise
    log.info("%d engine replicas on Ray Serve, routing %s", replicas, routing)
    return handle, lambda: _stop(own)


def _stop(own_ray: bool) -> None:
    try:
        serve.shutdown()
    finally:
        if own_ray:
            ray.shutdown()
