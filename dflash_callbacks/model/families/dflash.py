"""DFlash (v1), z-lab's published drafter: the backbone of every family, and its plain head.

Configs: z-lab's published layout (`model_type: qwen3` with a `dflash_config`), SpecForge's export (the
same), speculators' `speculators_model_type: dflash` (mapped by `config.from_speculators`). Block: row 0
holds the anchor and drafts nothing; row i (1 <= i < B) drafts the token at anchor + i. Each slot's
distribution is softmax(lm_head(h_i)): it does not depend on the token before it.
"""

from __future__ import annotations

from typing import Any

from ..config import from_speculators
from ..drafter import DFlashDrafter as Drafter  # noqa: F401  (the family's drafter)

Settings = None  # DFlash has no fields beyond the backbone's


def read_config(raw: dict[str, Any]) -> tuple[dict[str, Any], None]:
    """`raw` in the published layout (a speculators config mapped onto it); DFlash has no settings of its own."""
    if "speculators_model_type" in raw or "transformer_layer_config" in raw:
        kind = raw.get("speculators_model_type")
        if kind != "dflash":
            raise ValueError(f"field 'speculators_model_type' is {kind!r}: a speculators folder names its drafter "
                             "family there ('dflash' for a DFlash drafter)")
        return from_speculators(raw), None
    return raw, None


def write_config(settings: None, out: dict[str, Any]) -> None:
    """Nothing to add to the published layout."""
