"""Lightning callbacks that score a DFlash drafter against a baseline while it trains."""

from .model import DFlashDrafter, DrafterConfig, TargetHead, load_drafter, save_drafter

__all__ = ["DFlashDrafter", "DrafterConfig", "TargetHead", "load_drafter", "save_drafter"]
__version__ = "0.1.0"
