"""Errors a user can cause and fix: reported as one line, without a traceback."""


class UserError(Exception):
    """A mistake in data, files or settings; the message names where and how to fix it.

    The command line prints ``error: <message>`` and exits non-zero instead of a traceback
    (set HYDRA_FULL_ERROR=1 to see the traceback anyway).
    """


class DataError(UserError):
    """A data file is missing or malformed; the message names file:line."""


class ConfigError(UserError):
    """A setting is invalid; the message names the setting and the fix."""


class StorageError(UserError):
    """A file could not be written (a full disk, a read-only folder); the message names the file and the fix."""


class DataWarning(UserWarning):
    """Something about the user's data worth knowing that stops nothing; the command line prints
    ``warning: <message>``, one line naming the file."""
