"""The drafter (every family's backbone), its config, its checkpoints, and the target's head."""

from ..lazy import exports

__all__ = ["DrafterConfig", "DFlashDrafter", "TargetHead", "build_drafter", "build_target_layer_ids", "drafter_class",
           "load_drafter", "read_checkpoint", "save_drafter"]
__getattr__ = exports(__name__, {
    "DrafterConfig": ".config", "build_target_layer_ids": ".config", "DFlashDrafter": ".drafter",
    "build_drafter": ".drafter", "drafter_class": ".drafter", "load_drafter": ".io", "read_checkpoint": ".io",
    "save_drafter": ".io", "TargetHead": ".target_head",
})
