"""`python -m xmc_repro [overrides]`: one experiment; `python -m xmc_repro -m ...`: a sweep (one MLflow run per job).

Whatever goes wrong ends in one line on stderr (`error: ...`) and a non-zero exit; HYDRA_FULL_ERROR=1 shows
the traceback instead. Exit status 2: bad settings or input (fix and rerun); 1: the run failed.
In a sweep a failed job does not stop the others: each failure is reported in one line as it happens, and
the sweep ends with a one-line summary of the failed jobs and exit status 1.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import signal
import sys
import traceback
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig

from xmc_repro.errors import ConfigError, UserError, left_running
from xmc_repro.resources import resource_dir

# conf/hydra/launcher/*.yaml take the names of the launcher plugins' own entries on purpose (every setting the
# launcher reads, with our defaults); Hydra 1.3 warns of the name match in every process of a sweep, and a joblib
# worker imports this module to unpickle its job (entry.py, not `__main__`), so the filter reaches it too.
warnings.filterwarnings("ignore", r"\s*'hydra/launcher/\w+' is validated against ConfigStore schema", UserWarning)

# Jobs of a sweep may run in other processes (joblib, submitit launchers): each job that ends appends a line to
# this file (`ok`, or `failed ` and its failure), which the sweep's own process reads at the end.
OUTCOMES_ENV = "XMC_SWEEP_OUTCOMES"
FAILED = "failed "
RESUME = re.compile(r"\+{0,2}resume=(?!null$)")  # a command line that resumes a run


def full_errors() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def print_summary(cfg: DictConfig, results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from xmc_repro.describe import selection, title

    table = Table(show_header=True)
    table.add_column("split")
    for k in (1, 3, 5):
        table.add_column(f"P@{k}", justify="right")
    for split in ("test", "train"):
        table.add_row(split, *(f"{results[f'{split}/p_at_{k}']:.2f}" for k in (1, 3, 5)))
    console = Console()
    console.print(title(cfg), style="bold", markup=False, highlight=False)
    console.print(table)
    chosen = selection(cfg, results.get("tested_weights"))
    if chosen:
        console.print(chosen, markup=False, highlight=False)
    memory = results.get("peak_gpu_memory_gib")
    step_ms = results.get("train/ms_per_step_median")
    step = f" | ms per step (median): {step_ms:.2f}" if step_ms is not None else ""
    # Not wrapped at the console width: the UI command must stay one line to copy.
    console.print(
        f"peak GPU memory: {f'{memory:.3f} GiB' if memory is not None else 'not applicable (CPU run)'}"
        f" | epochs: {results['epochs']} | seconds per epoch: {results['time_per_epoch_s']:.1f}{step}"
        f" | device: {results['device']}",
        soft_wrap=True, markup=False, highlight=False,
    )
    console.print(f"MLflow run {results['run_id']}; browse with: {results['ui']}",
                  soft_wrap=True, markup=False, highlight=False)


def _sweep_job() -> str | None:
    """`#<num> (<the overrides the sweep varies>)` for a job of a Hydra multirun; None for a single run."""
    from xmc_repro.cli import sweep_config, swept_overrides

    hc = sweep_config()
    if hc is None:
        return None

    varied = swept_overrides(hc)
    return f"#{hc.job.num}" + (f" ({' '.join(varied)})" if varied else "")


@hydra.main(version_base="1.3", config_path=str(resource_dir("conf")), config_name="config")
def _task(cfg: DictConfig):
    try:
        from hydra.core.hydra_config import HydraConfig

        from xmc_repro.cli import added_setting, grid_without_multirun, task_overrides

        problem = added_setting(task_overrides(HydraConfig.get())) or grid_without_multirun(HydraConfig.get())
        if problem:
            raise ConfigError(problem)
        if cfg.get("resume") is None:  # a resumed run's settings are the run's own: checked once they are loaded
            from xmc_repro.validation import validate

            validate(cfg)  # before torch, Lightning and MLflow load: a bad value is reported in a second
        from xmc_repro.console import quiet
        from xmc_repro.train import run

        quiet()
        results = run(cfg)
    except Exception as error:  # not KeyboardInterrupt: Ctrl+C stops a whole sweep
        if full_errors():
            raise
        job = _sweep_job()
        known = isinstance(error, UserError) or _explained(error)
        message = getattr(error, "run_failure", None) or _failure_message(error)
        if isinstance(error, BrokenPipeError):  # nothing reads standard output: Python's flush at exit would fail too
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if job is None:
            if not known and not hasattr(error, "run_failure"):
                raise  # a bug before a run opened: Hydra prints the traceback
            if not known:
                traceback.print_exc()  # a bug: its traceback, then what became of the run (its last line)
            print(f"error: {_rank_prefix()}{message}", file=sys.stderr)
            sys.exit(2 if isinstance(error, UserError) else 1)
        if not known:
            traceback.print_exc()  # a bug in one job: its traceback, and the sweep goes on
        print(f"error: {_rank_prefix()}job {job}: {message}", file=sys.stderr)
        _record_outcome(f"{FAILED}{job}: {message}")
        return None
    except (KeyboardInterrupt, SystemExit) as error:  # Ctrl+C or SIGTERM: the run is FAILED; stop (a sweep too)
        prefix = _rank_prefix()
        if type(error).__name__ == "SIGTERMException" and not hasattr(error, "run_failure"):  # a code-less exit
            error.run_failure = ("interrupted (SIGTERM); rank 0 records the run" if prefix else
                                 "SIGTERM before the MLflow run was opened; nothing was recorded")  # fmt: skip
        if full_errors() or not hasattr(error, "run_failure"):
            raise
        from xmc_repro.train import interruption

        print(f"error: {prefix}{error.run_failure}", file=sys.stderr)
        code = getattr(error, "code", None)
        fallback = code if isinstance(code, int) and code else 1
        sys.exit({"SIGTERM": 143, "Ctrl+C": 130}.get(interruption(error), fallback))
    from xmc_repro.cli import sweep_config

    if sweep_config() is not None:
        _record_outcome("ok")
    if results:  # empty on DDP ranks other than 0, which record and report nothing
        try:
            print_summary(results["config"], results)
        except KeyboardInterrupt as error:  # Ctrl+C or SIGTERM while it prints: the run is recorded all the same
            error.run_failure = f"after run {results['run_id']} had FINISHED; its results are recorded"
            raise
    return results


_TASK_CODE = _task.__wrapped__.__code__  # a run's own frames, below Hydra's


def _failure_message(error: BaseException) -> str:
    if isinstance(error, UserError):  # without loading torch for it: settings errors come before training
        return " ".join(str(error).split())
    from xmc_repro.train import failure_message

    return failure_message(error)


def _explained(error: BaseException) -> bool:
    """Failures whose cause one line explains: bad settings or input, a non-finite loss, out of memory, another
    DDP rank stopping, a data-loading worker killed, a closed standard output."""
    import torch

    from xmc_repro.distributed import another_rank_stopped
    from xmc_repro.model import NonFiniteLossError
    from xmc_repro.train import worker_died

    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    explained = (UserError, NonFiniteLossError, oom, BrokenPipeError)
    return isinstance(error, explained) or another_rank_stopped(error) or worker_died(error)


def _rank_prefix() -> str:
    """`rank N: ` in a DDP rank other than 0, whose lines repeat or precede rank 0's (which records the run)."""
    if not any(key in os.environ for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID")):
        return ""  # no launcher ranked this process (and torch need not load to say so)
    from xmc_repro.distributed import launch_rank

    rank = launch_rank()
    return f"rank {rank}: " if rank else ""


def _record_outcome(line: str) -> None:
    """One line per job, from rank 0 only: the other DDP ranks of a job (submitit_slurm's tasks, srun, torchrun)
    run the same job, and rank 0 records it (also when another rank stopped it: `another DDP rank stopped`)."""
    path = os.environ.get(OUTCOMES_ENV)
    if path and not _rank_prefix():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as handle:  # one short append per job
            handle.write(" ".join(line.split()) + "\n")


def _sweep_summary(outcomes: list[str]) -> str | None:
    """The sweep's last line when a job failed: how many of how many, and each failure as `job #<n> (...): <reason>`,
    separated by ` | ` (the reasons themselves contain `;`)."""
    failures = [f"job {line.removeprefix(FAILED)}" for line in outcomes if line.startswith(FAILED)]
    if not failures:
        return None
    if len(outcomes) == 1:
        failed = "the 1 job"
    elif len(failures) == len(outcomes):
        failed = f"all {len(outcomes)} jobs"
    else:
        failed = f"{len(failures)} of {len(outcomes)} jobs"
    return f"sweep finished; {failed} failed: {' | '.join(failures)}"


def _one_line_hydra_errors() -> None:
    """Hydra reports a config it cannot compose (`model=nope`, a bad override) in several lines; make it one.

    Hydra routes its errors through `hydra._internal.utils.run_and_report` (hydra-core 1.3, pinned in
    pyproject.toml); composition errors are CompactHydraExceptions, printed here as one line. Anything else
    still gets Hydra's own report.
    """
    from hydra._internal import utils as hydra_utils
    from hydra.errors import CompactHydraException, MissingConfigException

    from xmc_repro.cli import closest, unknown_setting, unreadable_override

    original = hydra_utils.run_and_report
    if getattr(original, "one_line", False):
        return

    def run_and_report(func):
        try:
            return func()
        except CompactHydraException as error:
            if full_errors():
                raise
            text = str(error)
            options = getattr(error, "options", None)
            if isinstance(error, MissingConfigException) and options:  # its text lists them over many lines
                match = closest(getattr(error, "missing_cfg_file", "").rpartition("/")[2], options)
                hint = f"did you mean '{match}'? " if match else ""
                text = f"{text.strip().splitlines()[0]}; {hint}choose one of: {', '.join(options)}"
            elif line := unknown_setting(error, resuming=any(RESUME.match(arg) for arg in sys.argv[1:])):
                text = line  # Hydra's own text suggests `+key=...`, which adds a key nothing reads
            elif unreadable_override(error):  # Hydra's text may not name the override, nor say how to write it
                text = unreadable_override(error)
            elif error.__cause__ is not None:
                text += f" ({error.__cause__})"
            print(f"error: {' '.join(text.split())}", file=sys.stderr)
            sys.exit(2)
        except Exception as error:
            if not full_errors() and not _raised_in_a_job(error):
                _report_outside_jobs(error)  # exits if it can say what happened in one line
            return original(functools.partial(_reraise, error))

    run_and_report.one_line = True
    hydra_utils.run_and_report = run_and_report


def _reraise(error: BaseException):
    raise error


def _raised_in_a_job(error: BaseException) -> bool:
    """Whether `error` came out of a run (`_task`), which has said what it can, not out of Hydra around it."""
    return any(frame.f_code is _TASK_CODE for frame, _ in traceback.walk_tb(error.__traceback__))


def _report_outside_jobs(error: Exception) -> None:
    """One line, and exit, for what fails around the runs: Hydra's output folder that cannot be written, and a
    sweep's launcher, after marking FAILED the runs its jobs left RUNNING (joblib's TerminatedWorkerError when a
    worker is killed, by the OOM killer for one: the line alone; anything else, a bug: its traceback first). Outside
    a sweep anything else returns, for Hydra's traceback."""
    full = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(error, OSError) and error.filename:
        fix = "free space on its disk" if full else "fix that folder"
        print(f"error: cannot write {error.filename} ({error.strerror}); {fix} or choose another (hydra.run.dir=..., "
              "with -m hydra.sweep.dir=...)", file=sys.stderr)
        sys.exit(2)
    if full:  # a write to a full disk names no file
        print(f"error: no space left on the device ({error.strerror}) before any run started; free space on the "
              "disk of Hydra's output folder or choose another (hydra.run.dir=..., with -m hydra.sweep.dir=...)",
              file=sys.stderr)
        sys.exit(2)
    if not any(arg in ("-m", "--multirun") or arg == "hydra.mode=MULTIRUN" for arg in sys.argv[1:]):
        return
    from xmc_repro.cli import STARTED_RUNS_ENV
    from xmc_repro.resume import close_interrupted

    if type(error).__name__ != "TerminatedWorkerError":  # its text says it all (joblib's, not imported for it)
        traceback.print_exception(error)

    reason = " ".join(f"{type(error).__name__}: {error}".split())
    closed = close_interrupted(Path(os.environ.get(STARTED_RUNS_ENV, "")), f"the sweep's launcher failed: "
                               f"{type(error).__name__}")
    print(f"error: the sweep's launcher failed ({reason}){_closing(*closed, 'its unfinished jobs')}", file=sys.stderr)
    sys.exit(1)


def _tidy_killed_sweeps(folder: Path) -> None:
    """The hidden files of this host's sweeps killed with SIGKILL, which could not remove them: the runs
    they list that their jobs left RUNNING are marked FAILED (and named), then the files are removed."""
    from xmc_repro import sweep_files

    stale = sweep_files.stale(folder)
    for path in stale:
        if path.name.startswith(".runs-") and sweep_files.listed_runs(path):
            from xmc_repro.resume import close_interrupted  # Ctrl+C meanwhile stops the start; the files stay

            closing = _closing(*close_interrupted(path, "SIGKILL", stop_on_ctrl_c=True), "a process killed here before")
            if closing:
                print(f"note: {closing.removeprefix('; ')}", file=sys.stderr)
    sweep_files.remove(stale)


def _close_killed_jobs(started: Path, why: str) -> str:
    """Close the runs of the jobs a launcher killed (listed in `started`); the `; ...` clauses that say so."""
    from xmc_repro import sweep_files

    try:
        from xmc_repro.resume import close_interrupted  # seconds of imports (Lightning, MLflow)

        return _closing(*close_interrupted(started, why), "killed jobs")
    except KeyboardInterrupt:  # Ctrl+C again during those imports: name the runs, closed or not
        ids = [run_id for run_id, _, _ in sweep_files.listed_runs(started)]
        return _closing([], left_running(ids, ["interrupted again before closing them"]), "killed jobs")


def _closing(closed: list[str], unclosed: str, jobs: str) -> str:
    """`; ...` clauses of the one line saying what became of the runs of `jobs` a sweep's launcher stopped
    (`close_interrupted`'s result)."""
    text = (f"; the runs of {jobs} are marked FAILED ({', '.join(closed)}): continue each with resume=<its id>"
            if closed else "")
    return text + (f"; {unclosed}" if unclosed else "")


# Hydra's flags combined wrongly (`-m --cfg job`): hydra-core 1.3 raises these outside its error reporting.
HYDRA_FLAG_ERRORS = ("Only one of --run, --multirun", "The --resolve flag")


def _run_task() -> None:
    try:
        _task()
    except ValueError as error:
        if full_errors() or not str(error).startswith(HYDRA_FLAG_ERRORS):
            raise
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


class SweepTerminated(KeyboardInterrupt):
    """SIGTERM to the process that runs the sweep (or the single run): it stops as Ctrl+C stops it. The default
    would kill it without a word and orphan a launcher's workers, which keep training."""


def _sigterm_stops_like_ctrl_c(signum, frame):
    raise SweepTerminated()


def _sighup_stops_like_sigterm(signum, frame):
    os.kill(os.getpid(), signal.SIGTERM)  # whichever SIGTERM handler is in place now (the run's, Lightning's) takes it


def main() -> None:
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):  # ours, not Hydra's: what the tool does, its groups
        from xmc_repro.cli import help_text

        print(help_text(), end="")
        return
    _one_line_hydra_errors()
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:  # not under nohup
        # The terminal closed (an ssh session dropped): SIGHUP would end the process without a word and leave its
        # MLflow run RUNNING; it stops the run as SIGTERM does.
        signal.signal(signal.SIGHUP, _sighup_stops_like_sigterm)
    if os.environ.get(OUTCOMES_ENV):  # started by a sweep's own process (a launcher's job): that one reports
        _run_task()
        return
    from xmc_repro import sweep_files
    from xmc_repro.cli import STARTED_RUNS_ENV

    outcomes, started = sweep_files.paths(Path.cwd() / "multirun")
    os.environ[OUTCOMES_ENV] = str(outcomes)  # jobs in other processes inherit it
    os.environ[STARTED_RUNS_ENV] = str(started)
    rank_zero = not _rank_prefix()
    if rank_zero:  # a run replaces it while open, then puts it back
        # Not in a DDP rank other than 0 (torchrun, srun start every rank through main): inside fit, Lightning
        # calls the handler it finds after its own, and a KeyboardInterrupt there ends the rank in a silent
        # exit(1) instead of its one line `rank N: interrupted (SIGTERM)` and exit status 143.
        signal.signal(signal.SIGTERM, _sigterm_stops_like_ctrl_c)
    try:
        if rank_zero:  # torchrun, srun start every rank through main: one closes what a killed sweep left
            _tidy_killed_sweeps(Path.cwd() / "multirun")
        _run_task()
    except KeyboardInterrupt as error:  # outside a run (a run reports its own), e.g. in a launcher's (joblib's) wait
        if full_errors():
            raise
        why = "SIGTERM" if isinstance(error, SweepTerminated) else "Ctrl+C"
        closing = _close_killed_jobs(started, why) if started.is_file() else ""  # none listed: no import
        after = getattr(error, "run_failure", None)  # a run's summary, cut short
        print(f"error: interrupted ({why}){' ' + after if after else ''}{closing}", file=sys.stderr)
        sys.exit(143 if why == "SIGTERM" else 130)
    finally:
        lines = outcomes.read_text(encoding="utf-8").splitlines() if outcomes.is_file() else []
        for bookkeeping in (outcomes, started):
            try:
                bookkeeping.unlink(missing_ok=True)
            except OSError:  # an unwritable multirun/: the error that stopped the sweep says so
                pass
        del os.environ[OUTCOMES_ENV], os.environ[STARTED_RUNS_ENV]
    summary = _sweep_summary(lines)
    if summary:
        print(f"error: {summary}", file=sys.stderr)
        sys.exit(1)
