__all__ = ["SHAPES", "build_random_model", "measure_mlx_lm", "measure_mlxkv", "seeded_prompts", "shape_names",
           "weight_bytes"]

from ..lazy import exports  # noqa: E402

__getattr__ = exports(__name__, {
    "measure_mlx_lm": "measure", "measure_mlxkv": "measure", "seeded_prompts": "measure", "weight_bytes": "measure",
    "SHAPES": "shapes", "build_random_model": "shapes", "shape_names": "shapes",
})
