"""The LoRA adapters loaded at run time (`/v1/load_lora_adapter`), kept where a replica that
starts later can read them: a small named Ray actor. The ingress broadcasts a load to the
replicas that are up; a replica that Serve starts afterwards (scaling up, or replacing one that
died) loads the registered adapters before it takes requests, so every replica serves the same
adapter names. Adapters given at start (`--lora`) are in the engine options and need no entry.

A replica that starts while an adapter is being unloaded may keep it (it read the registry
before the entry went); unloading it again reaches that replica too.
"""

from __future__ import annotations

import ray
from ray.actor import ActorHandle

_NAME = "tutorserve-adapters"
_NAMESPACE = "tutorserve"


@ray.remote(num_cpus=0)
class _Registry:
    def __init__(self) -> None:
        self._paths: dict[str, str] = {}

    def add(self, name: str, path: str) -> None:
        self._paths[name] = path

    def remove(self, name: str) -> None:
        self._paths.pop(name, None)

    def paths(self) -> dict[str, str]:
        return dict(self._paths)


class AdapterRegistry:
    """The ingress's side: it owns the actor, so the actor lives as long as the ingress."""

    def __init__(self) -> None:
        self._actor: ActorHandle = _Registry.options(  # type: ignore[attr-defined]
            name=_NAME, namespace=_NAMESPACE, get_if_exists=True
        ).remote()

    async def add(self, name: str, path: str) -> None:
        await self._actor.add.remote(name, path)

    async def remove(self, name: str) -> None:
        await self._actor.remove.remote(name)


def registered_adapters() -> dict[str, str]:
    """A replica's side, at start: name → folder of every adapter loaded at run time (a missing
    registry is an error, not an empty one: the replica would serve fewer adapters than its
    peers)."""
    actor = ray.get_actor(_NAME, namespace=_NAMESPACE)
    return ray.get(actor.paths.remote())
