"""User-facing errors: one line saying what is wrong and the command that fixes it."""


class EcruError(Exception):
    """An error the CLI reports as one line (no traceback) with exit code 1."""


class MissingAssetError(EcruError, FileNotFoundError):
    """A model package, cache entry or data file is missing or unreadable."""
