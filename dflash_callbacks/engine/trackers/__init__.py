"""Where a run's reports go beside results.jsonl: one destination per file behind `base.Tracker`."""
