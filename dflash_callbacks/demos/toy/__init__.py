"""The small world the demo and the tests run in: a tiny real Qwen3 target trained on the
Python standard library (shipped), a drafter config that fits it, and caches built from it."""

from .world import build_toy_cache, build_toy_training_cache, toy_drafter_config, toy_target_path

__all__ = ["build_toy_cache", "build_toy_training_cache", "toy_drafter_config", "toy_target_path"]
