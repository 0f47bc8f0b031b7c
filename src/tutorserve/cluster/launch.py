"""Start engine replicas on Ray Serve: join the cluster at `ray_address` (or `RAY_ADDRESS`), or
start a local Ray instance that lives as long as this process (the embedded default). Serve's
own HTTP proxy stays off: our server is the ingress, and reaches the replicas through a
deployment handle, so Serve's router (ours, `router.py`) picks each request's replica. The
replica count is fixed or Serve's autoscaler's (`scaling.py`).

With prefill/decode disaggregation, a second application's deployment of prefill replicas
stands beside the decode replicas (`disagg.py`): the same engines, sharing the disk tier's
folder, through which a prompt's blocks move from one to the other."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from tutorserve.cluster.adapters import AdapterRegistry
from tutorserve.cluster.replica import EngineReplica
from tutorserve.cluster.router import TutorserveRouter
from tutorserve.cluster.scaling import Scale

log = logging.getLogger(__name__)
APP = "tutorserve"
PREFILL_APP = "tutorserve-prefill"
# A prefill replica keeps a prompt's blocks as a session's for this long: enough for a decode
# replica to read them from disk, not so long that they crowd out the replica's other KV.
_HANDOFF_TTL_S = 60.0
# Serve would otherwise hold a replica's requests past 5 in its own queue; the engine batches
# whatever it is given, and admission is the ingress's (`ClusterFront`).
_MAX_ONGOING = 4096


class Replicas(NamedTuple):
    handle: DeploymentHandle
    adapters: AdapterRegistry
    stop: Callable[[], None]  # stops the replicas, and the local Ray instance if we started it
    prefill: DeploymentHandle | None = None  # prefill replicas (disaggregation), or None


def start_replicas(
    engine_options: dict[str, Any],
    *,
    scale: Scale,
    routing: str,
    ray_address: str | None = None,
    cpus_per_replica: float | None = None,
) -> Replicas:
    """Engines built from `engine_options`, as many as `scale` says, on Ray Serve (with
    prefill replicas, as a second deployment, if it says so)."""
    address = ray_address or os.environ.get("RAY_ADDRESS")
    own = address is None
    if own:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        adapters = AdapterRegistry()  # before any replica starts: each reads it
        prefill_replicas = scale.prefill_replicas
        cpus = cpus_per_replica or max(0.1, (os.cpu_count() or 1) / scale.most_engines)
        name = "decode" if prefill_replicas else "engine"
        handle = _run(name, APP, engine_options, scale.deployment_options(), cpus, routing)
        prefill = None
        if prefill_replicas:
            options = engine_options | {"session_ttl": _HANDOFF_TTL_S}
            prefill = _run("prefill", PREFILL_APP, options, {"num_replicas": prefill_replicas},
                           cpus, routing)  # fmt: skip
    except BaseException:
        _stop(own)
        raise
    log.info("%s on Ray Serve, routing %s", scale.describe(), routing)
    return Replicas(handle, adapters, lambda: _stop(own), prefill)


def _run(name: str, app: str, engine_options: dict[str, Any], size: dict[str, Any],
         cpus: float, routing: str) -> DeploymentHandle:  # fmt: skip
    """One deployment of engine replicas, as its own Serve application."""
    deployment = serve.deployment(
        EngineReplica,
        name=name,
        **size,
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
    return serve.run(deployment.bind(engine_options), name=app, route_prefix=None)


def _stop(own_ray: bool) -> None:
    try:
        serve.shutdown()
    finally:
        if own_ray:
            ray.shutdown()
