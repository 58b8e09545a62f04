"""The small world the demo and the tests run in: a tiny real Qwen3 target trained on the
Python standard library (shipped), a drafter config that fits it, and caches built from it."""

from .world import ToyWorld, build_toy_cache, build_toy_training_cache, toy_drafter_config, toy_target_path, toy_world

__all__ = ["ToyWorld", "build_toy_cache", "build_toy_training_cache", "toy_drafter_config", "toy_target_path",
           "toy_world"]
