"""The demo as a script: train a toy drafter on the CPU with both callbacks attached.

    python examples/train_toy_drafter.py [key=value ...]     (same as `dflash-callbacks demo`)
"""

import sys

from dflash_callbacks.demos.demo import demo_config, run_demo

if __name__ == "__main__":
    run_demo(demo_config(sys.argv[1:]))
