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


def left_running(run_ids: list[str], reasons: list[str], how: str = "") -> str:
    """The clause naming MLflow runs that could not be marked FAILED and saying `how` to close them (by default
    resume=<id>, which continues a run or closes it); "" when there are none."""
    if not run_ids:
        return ""
    if len(run_ids) == 1:
        which, how = f"the MLflow run {run_ids[0]}", how or f"resume={run_ids[0]} continues or closes it"
    else:
        which, how = f"the MLflow runs {', '.join(run_ids)}", how or "resume=<its id> continues or closes each"
    return (f"{which} could not be marked FAILED ({'; '.join(reasons)}) and may show RUNNING: once the store is "
            f"writable, {how}")


class DataWarning(UserWarning):
    """Something about the user's data worth knowing that stops nothing; the command line prints
    ``warning: <message>``, one line naming the file."""
