from .kv_config import load_kv_config, parse_kv_config
from .options import KVOptions, resolve_policy
from .plan import KVPolicy, LayerPlan, build_caches, plan_layers
from .profile import load_profile, profile_names

__all__ = ["KVOptions", "KVPolicy", "LayerPlan", "build_caches", "plan_layers", "resolve_policy",
           "load_kv_config", "parse_kv_config", "load_profile", "profile_names"]
