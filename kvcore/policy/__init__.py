__all__ = ["KVOptions", "KVPolicy", "LayerPlan", "build_caches", "plan_layers", "resolve_policy",
           "load_kv_config", "parse_kv_config", "load_profile", "profile_names"]

from ..lazy import exports  # noqa: E402

__getattr__ = exports(__name__, {
    "load_kv_config": "kv_config", "parse_kv_config": "kv_config",
    "KVOptions": "options", "resolve_policy": "options",
    "KVPolicy": "plan", "LayerPlan": "plan", "build_caches": "plan", "plan_layers": "plan",
    "load_profile": "profile", "profile_names": "profile",
})
