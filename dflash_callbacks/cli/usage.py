"""The command line's errors: what a user gave that can not work prints one `error:` line per problem
and exits with status 2."""

from __future__ import annotations


class UsageError(ValueError):
    """A command-line argument that can not work; printed as one `error:` line."""


USER_ERRORS = (ValueError, OSError)  # bad input: CacheError, PreflightError, UsageError, missing files, ...
