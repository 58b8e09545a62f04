"""The command line's errors: what a user gave that can not work prints one `error:` line per problem
and exits with status 2."""

from __future__ import annotations


class UsageError(ValueError):
    """A command-line argument that can not work; printed as one `error:` line."""


from ..engine.trackers.optional import MissingExtra  # noqa: E402  (stdlib only: no torch)

# bad input: CacheError, PreflightError, UsageError, missing files, a tracker asked for without its extra, ...
USER_ERRORS = (ValueError, OSError, MissingExtra)
