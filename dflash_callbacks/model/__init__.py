from .config import DrafterConfig, build_target_layer_ids
from .drafter import DFlashDrafter, build_drafter, drafter_class
from .io import load_drafter, read_checkpoint, save_drafter
from .target_head import TargetHead

__all__ = ["DrafterConfig", "DFlashDrafter", "build_drafter", "drafter_class", "TargetHead", "build_target_layer_ids", "load_drafter", "read_checkpoint",
           "save_drafter"]
