from .measure import measure_mlx_lm, measure_mlxkv, seeded_prompts, weight_bytes
from .shapes import SHAPES, build_random_model, shape_names

__all__ = ["SHAPES", "build_random_model", "measure_mlx_lm", "measure_mlxkv", "seeded_prompts", "shape_names",
           "weight_bytes"]
