"""KV tiers below the engine's block pool: host RAM, then disk, keyed by chained block hash."""

from tutorserve.engine.kv_tiers.store import TieredKVStore, TierMatch, model_fingerprint

__all__ = ["TierMatch", "TieredKVStore", "model_fingerprint"]
