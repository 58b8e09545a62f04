"""What rank 0 knows and the other ranks must: news, in one collective every `sync_every_n_steps`
steps (and at every sharded snapshot, whose gather is itself collective). Rank 0's snapshot decision,
the history entries and means published since the last exchange, its counts, and a stop decided:
every rank then holds the same history and metrics, and stops at the same step."""

from __future__ import annotations


def exchange(engine, step: int, skip: bool) -> tuple[bool, str | None]:
    """One collective on every rank of `engine` (an EvalEngine): returns rank 0's `skip` and the stop's
    reason when a stop reaches the ranks at `step` (None otherwise)."""
    host, state = engine.host, engine.state
    news = None
    if host.rank == 0:
        news = {"skip": skip, "history": state.outgoing, "errors": engine.errors, "skipped": engine.skipped,
                "metrics": dict(state.metrics) if state.changed else None, "stop": engine.stops.take()}
        state.outgoing, state.changed = [], False
    news = host.broadcast(news)
    if host.rank != 0:
        for entry in news["history"]:
            state.add(entry)
        if news["history"]:
            for policy in engine.stops.policies:  # every rank's state_dict holds the same history
                policy.load_history(state.history)
        engine.reports.errors, engine.schedule.skipped = news["errors"], news["skipped"]
    if news["metrics"] is not None:
        state.metrics = news["metrics"]
        state.show(host)
    return news["skip"], engine.stops.deliver(news["stop"], step)
