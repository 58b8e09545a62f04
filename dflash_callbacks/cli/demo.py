"""`dflash-callbacks demo`: train a toy drafter on the CPU with both callbacks attached (the main job,
`demos.demo`). Its settings are read and checked here before the demo and its frameworks are
imported: a mistake is refused at once."""

from __future__ import annotations

import argparse

from ..demos.settings import check_demo, config_keys, demo_config


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    keys = "\n".join(f"  {key} = {value!r}" for key, value in config_keys(demo_config()))
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (f"settings (conf/demo.yaml over the callbacks' defaults; override any as key=value):\n{keys}\n\n"
                "writes under OUT (default runs/demo): world/ (toy caches), baseline-reports/, dflash/<run id>/ "
                "(results.jsonl, snapshots/), csv/version_N/metrics.csv, wandb/, live_tau.png")
    p.add_argument("overrides", nargs="*", help="key=value settings of DemoConfig, e.g. train.max_steps=300")


def run_demo(args: argparse.Namespace) -> int:
    config = demo_config(args.overrides)
    check_demo(config)
    from ..demos.demo import run_demo as demo

    demo(config)
    return 0
