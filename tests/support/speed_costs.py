"""A costs file (`profile/costs.py`'s format) for the synthetic world (tests/support/synthetic.py), written by
hand: a target forward of n tokens after L tokens of 10 ms + 1 ms per token + 2 ms per 100 tokens of context,
a drafter round of 3 ms at each block size, 0.5 ms of bookkeeping. Its shapes are the world's (the target's
head H 32, V 16 and its 4 layers; the DFlash drafter's H 32 and 2 layers), on the CPU in float32."""

from __future__ import annotations

from pathlib import Path

from dflash_callbacks.scoring.costs import Costs

CONTEXTS = [8, 40]


def world_costs(**changes) -> Costs:
    fields = dict(device="hand-made", device_type="cpu", dtype="float32", batch_size=1,
                  target={"hidden_size": 32, "vocab_size": 16, "num_layers": 4},
                  drafter={"family": "dflash", "hidden_size": 32, "num_layers": 2}, contexts=list(CONTEXTS),
                  verify={L: [0.010 + 0.001 * (n - 1) + 0.0002 * L for n in range(1, 17)] for L in CONTEXTS},
                  draft={b: 0.003 for b in range(2, 17)}, overhead=0.0005)
    fields.update(changes)
    return Costs(**fields)


def write_costs(path: Path, **changes) -> Path:
    world_costs(**changes).to_json(path)
    return Path(path)
