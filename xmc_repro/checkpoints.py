"""Checkpoints a killed run resumes from exactly: `checkpoints/<run_id>/last.ckpt`, every epoch and every N steps.

Lightning restores by itself the model (sparse `indices` buffers included), optimizer, LR scheduler, loop
progress, the train loader's position (the DataModule's loader is stateful) and every callback's state
(rewiring generator, epoch time, early stopping, best checkpoint). `LastCheckpoint` adds what a resumed run
needs on top of that to continue as if it had never stopped:

* the global RNG states (dropout). They are re-applied where the uninterrupted run would go on, not at restore
  time: restarting builds a DataLoader iterator, which draws from the global RNG, that the other run did not;
* the loader position as the number of batches trained: Lightning fetches one batch ahead, so the loader's own
  count is one too high at a step checkpoint and a resumed run would skip a batch;
* the plateau scheduler step that Lightning skips at the end of the epoch a run resumed in, and
  `trainer.should_stop` (early stopping), which it does not save;
* the run's resolved config and MLflow run id, so `resume=<run id or path>` alone continues the run.

A file is written whole or not at all (temporary file + rename), and weights that are no longer finite never
replace the last good checkpoint; a failed write (a full disk) removes its temporary file and ends the run in
one line.

Loading (`load`, `SafeCheckpointIO`) never unpickles anything outside `ALLOWED_GLOBALS`: a checkpoint from
someone else cannot run code. Before a checkpoint's tensors reach a model they are checked against it (names,
shapes, dtypes, finite values, sparse indices in range), so the compiled op never reads out of bounds on data
from disk. `RunLock` gives a run one writer: a second process continuing it is refused.
"""

from __future__ import annotations

import errno
import os
import pickletools
import random
import zipfile
from pathlib import Path

import numpy as np
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, Checkpoint

from xmc_repro.errors import ConfigError, StorageError
from xmc_repro.sparse.layers import SIZES, SIZES_KEY

try:
    import fcntl
except ImportError:  # not POSIX: no lock
    fcntl = None

LAST = "last.ckpt"
_UNREADABLE_FIX = "give a run id or a .ckpt file written by python -m xmc_repro"
STATE_KEY = "xmc_repro"  # our section of a checkpoint
ANNOUNCED_BYTES = 1 << 30  # a checkpoint this large takes seconds to write (dense 670k head, Adam: 5.8 GiB, ~15 s)
LOCK = "writer.lock"
# Everything a checkpoint's pickle may name: containers and tensors (RNG states are stored as tensors and plain
# numbers for this). Anything else (a class, a function such as os.system) is refused before unpickling.
ALLOWED_GLOBALS = frozenset(
    ["collections.OrderedDict", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter"]
    + [f"torch.{kind}Storage" for kind in (
        "Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool")]
)


def rng_states() -> dict:
    """The global RNG states, as tensors and plain numbers (loadable with torch.load(weights_only=True))."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])


class RandomStateKeptThroughSetup(Callback):
    """Lightning's DDP setup reseeds every rank with the run's seed (`reset_seed`), which the model was built from
    already: the ranks would draw their dropout masks from the start of the stream, one process from where building
    the model left it. Puts back the state the ranks had when fit was called (the same on every rank)."""

    def __init__(self):
        self.states = rng_states()

    def on_fit_start(self, trainer, pl_module):
        if trainer.world_size > 1:
            set_rng_states(self.states)


def pickled_globals(path: Path) -> set[str]:
    """Every global (`module.name`) the checkpoint's pickle would import, found without unpickling anything.

    STACK_GLOBAL takes its two names from the stack: literal strings, or strings fetched back from the memo.
    A name that cannot be told this way is reported as "?" (and so refused).
    """
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(names) != 1:
            raise ValueError(f"{len(names)} pickles in the archive, expected 1")
        data = archive.read(names[0])
    found, recent, memo, last = set(), [], {}, None
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in ("GLOBAL", "INST"):
            found.add(arg.replace(" ", "."))
        elif name == "STACK_GLOBAL":
            found.add(".".join(recent[-2:]) if len(recent) >= 2 and None not in recent[-2:] else "?")
        if name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
            memo[len(memo) if name == "MEMOIZE" else arg] = last
            continue
        last = arg if "UNICODE" in name else memo.get(arg) if name in ("GET", "BINGET", "LONG_BINGET") else None
        recent = (recent + [last])[-2:]
    return found


_INTACT: set[tuple[str, int, int]] = set()  # checkpoints found intact by this process: (path, size, mtime)


def _damaged_entry(path: Path) -> str | None:
    """The first zip entry that fails its CRC-32 (torch reads tensors without checking: a flipped bit loads), once
    per file version in a process (a resume reads its checkpoint twice; a read is ~1 s a GB)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _INTACT:
        return None
    with zipfile.ZipFile(path) as archive:
        damaged = archive.testzip()
    if damaged is None:
        _INTACT.add(key)
    return damaged


def _unreadable_fix(path: Path, setting: str) -> str:
    """What to do about an unreadable checkpoint given to `resume=`: continue from another of its run's, if its
    run's folder (the one with the run's lock) holds one."""
    others = sorted(p.name for p in path.parent.glob("*.ckpt") if p.name != path.name)
    if setting == "resume" and others and (path.parent / LOCK).exists():
        return (f"its folder also holds {', '.join(others)}: continue from that checkpoint's epoch with "
                f"resume={path.parent / others[0]}")
    return _UNREADABLE_FIX


def load(path: str | Path, setting: str = "resume") -> dict:
    """A checkpoint file as a dict of tensors and plain values; ConfigError (one line) for anything else.

    Nothing outside ALLOWED_GLOBALS is unpickled (then torch's weights-only unpickler loads it); tensors are
    memory-mapped, so checking a large checkpoint does not need its size in memory.
    """
    path = Path(path)

    def unreadable(what: str) -> ConfigError:
        return ConfigError(f"{setting}={path}: {what}; {_unreadable_fix(path, setting)}")

    try:
        unknown = sorted(pickled_globals(path) - ALLOWED_GLOBALS)
        damaged = _damaged_entry(path)
    except Exception as error:  # unreadable, truncated, not a torch zip file
        raise unreadable(f"not a readable checkpoint ({type(error).__name__}: {error})") from None
    if damaged is not None:
        raise unreadable(f"corrupted checkpoint ({damaged} fails its checksum)")
    if unknown:
        raise ConfigError(
            f"{setting}={path}: refused, the checkpoint would import {', '.join(unknown[:3])} (a checkpoint holds only "
            "tensors and plain values; loading this one could run code); use a checkpoint written by python -m xmc_repro"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        reason = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
        raise unreadable(f"not a readable checkpoint ({reason})") from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ConfigError(f"{setting}={path}: not a Lightning checkpoint (no state_dict in it)")
    return checkpoint


def read(path: str | Path) -> dict:
    """Our section of a checkpoint file (config as YAML, run_id, ...) and `completed_epochs`, the epochs it has
    trained whole; ConfigError when it is not one of ours."""
    checkpoint = load(path)
    section = checkpoint.get(STATE_KEY)
    if not isinstance(section, dict) or not isinstance(section.get("config"), str):
        raise ConfigError(f"resume={path}: not a checkpoint written by python -m xmc_repro (no run config in it)")
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    # An epoch-end checkpoint is written before Lightning counts its epoch as completed, not before "processed".
    done = section.get("epochs_done", progress.get("processed", progress.get("completed", 0)))
    return {**section, "completed_epochs": int(done)}


def load_checked(path: str | Path, model: torch.nn.Module, setting: str = "resume") -> dict:
    """`load`, then `check_state` against `model`: a checkpoint whose tensors may reach the model's kernels."""
    checkpoint = load(path, setting)
    check_state(checkpoint, model, path)
    return checkpoint


def check_state(checkpoint: dict, model: torch.nn.Module, path) -> None:
    """ConfigError unless the checkpoint's weights fit `model` exactly: names, shapes, dtypes, finite values,
    and every sparse index within its layer (the compiled op does not check them while it runs)."""
    state, expected = checkpoint.get("state_dict"), model.state_dict()
    if not isinstance(state, dict):
        raise ConfigError(f"{path}: corrupted checkpoint (no state_dict); use another checkpoint of the run")
    # A sparse layer's sizes (its extra state) are absent from checkpoints written before they were saved.
    missing = sorted(key for key in set(expected) - set(state) if not key.endswith(SIZES_KEY))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise ConfigError(
            f"{path}: corrupted or foreign checkpoint: {'missing ' + ', '.join(missing[:3]) if missing else ''}"
            f"{'; ' if missing and extra else ''}{'unexpected ' + ', '.join(extra[:3]) if extra else ''}; "
            "use a checkpoint of this run"
        )
    for name, want in expected.items():
        if name not in state:
            continue
        got = state[name]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            shown = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__
            raise ConfigError(
                f"{path}: corrupted checkpoint: {name} is {shown}, the model needs {tuple(want.shape)} {want.dtype}; "
                "use another checkpoint of the run"
            )
        if not all_finite(got):
            raise ConfigError(f"{path}: corrupted checkpoint: {name} holds NaN or Inf; use another checkpoint of the run")
        if name.endswith(SIZES_KEY) and not torch.equal(got, want):  # a sparse layer's sizes
            raise ConfigError(f"{path}: foreign checkpoint: {name} holds the sizes {got.tolist()}, the model's "
                              f"are {want.tolist()} ({', '.join(SIZES)}); use a checkpoint of this run")
    for module_name, module in model.named_modules():
        # Exclusive upper bound of each row of the module's indices (one bound: for all rows).
        bounds = [size for _, size in module.index_bounds()] if hasattr(module, "index_bounds") else []
        for row, limit in enumerate(bounds):
            indices = state[f"{module_name}.indices" if module_name else "indices"]
            values = indices if len(bounds) == 1 else indices[row]
            if values.numel() and (int(values.min()) < 0 or int(values.max()) >= limit):
                raise ConfigError(
                    f"{path}: corrupted checkpoint: {module_name}.indices holds values in [{int(values.min())}, "
                    f"{int(values.max())}], outside [0, {limit}); use another checkpoint of the run"
                )
    _check_optimizer(checkpoint, model, path)


def _check_optimizer(checkpoint: dict, model: torch.nn.Module, path) -> None:
    """Adam's moments must have their parameter's shape and be finite (a resumed run steps with them)."""
    params = list(model.parameters())
    for optimizer in checkpoint.get("optimizer_states") or []:
        for key, slot in (optimizer.get("state") or {}).items() if isinstance(optimizer, dict) else ():
            if not isinstance(key, int) or not 0 <= key < len(params) or not isinstance(slot, dict):
                raise ConfigError(f"{path}: corrupted checkpoint: optimizer state {key!r}; use another checkpoint")
            for name, value in slot.items():
                if name in ("exp_avg", "exp_avg_sq") and (
                    not isinstance(value, torch.Tensor) or value.shape != params[key].shape or not all_finite(value)
                ):
                    raise ConfigError(
                        f"{path}: corrupted checkpoint: optimizer {name} of parameter {key} does not fit the model "
                        "or is not finite; use another checkpoint of the run"
                    )


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint reading and writing, made safe for this project.

    Reading: `load` (no code runs) and `check_state` against the model before Lightning restores anything.
    Writing: straight to the file (no in-memory copy of the whole checkpoint), flushed to disk, through a
    temporary file unless the path is one already; a failed write removes what it wrote and is one line.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        return load_checked(path, self.model)

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        path = Path(path)
        tmp = path if path.suffix == ".tmp" else path.with_name(path.name + ".tmp")
        size = _tensor_bytes(checkpoint)
        if size >= ANNOUNCED_BYTES:  # seconds of writing: the pause at an epoch's end is explained
            print(f"writing checkpoint {tmp.with_suffix('')} ({size / 2**30:.1f} GiB)", flush=True)
        write(checkpoint, tmp)
        if tmp != path:
            os.replace(tmp, path)


def write(checkpoint: dict, path: Path) -> None:
    """torch.save to `path`, flushed to disk; on failure the partial file is removed and a StorageError says why (Ctrl+C
    removes it too)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as handle:
            torch.save(checkpoint, handle)
            handle.flush()
            os.fsync(handle.fileno())
    except (OSError, RuntimeError) as raised:
        path.unlink(missing_ok=True)
        interrupt = _cause(raised, KeyboardInterrupt)
        if interrupt is not None:  # Ctrl+C mid-write, under the zip writer's own failure as it closes the archive
            raise interrupt from None
        error = _cause(raised, OSError)
        if error is None:
            raise
        full = error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        reason = "no space left on the device" if full else (error.strerror or str(error))
        fix = "free space on that disk" if full else "fix the folder"
        if any(path.parent.glob("*.ckpt")):
            then = f"the partial file is removed and the previous checkpoint kept; {fix}, then continue the run with " \
                   "resume=<run id>"
        else:  # the run's first checkpoint: nothing to continue from
            then = f"the partial file is removed and the run has no checkpoint yet; {fix}, then start it again"
        raise StorageError(f"cannot write checkpoint {path} ({reason}); {then}") from None
    except BaseException:  # Ctrl+C mid-write (seconds for a large checkpoint): no partial file left either
        path.unlink(missing_ok=True)
        raise


def _tensor_bytes(value) -> int:
    """The bytes of every tensor in a checkpoint's nested dicts and lists."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _cause(error: BaseException | None, kind: type) -> BaseException | None:
    """`error` or the first exception of type `kind` in its chain of contexts (None when there is none): when the disk
    fills up mid-file or Ctrl+C comes, torch's zip writer fails again while closing the archive, and its RuntimeError
    ("unexpected pos ...") hides the ENOSPC or the KeyboardInterrupt."""
    while error is not None and not isinstance(error, kind):
        error = error.__context__
    return error


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf in ``tensor``, without a tensor-sized temporary.

    ``torch.isfinite`` builds |x| and three boolean masks: 3.4 GiB next to a 670k-label dense layer's 2 GiB.
    Its minimum and maximum are NaN when any entry is, and infinite when an entry is.
    """
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(tensor.detach()))).all())


class LastCheckpoint(Checkpoint):
    """Keeps `<dirpath>/last.ckpt` current: every `every_n_steps` optimizer steps and at every epoch end.

    A `Checkpoint` subclass, so Lightning calls it after the other callbacks of a hook: a checkpoint taken at
    a step includes that step's rewiring. `info` (the run config, run id) is stored in every checkpoint.
    """

    def __init__(self, dirpath: str | Path, every_n_steps: int | None = None, info: dict | None = None):
        self.dirpath = Path(dirpath)
        self.every_n_steps = int(every_n_steps) if every_n_steps else None
        self.info = dict(info or {})
        self._saving_at: str | None = None  # "step" | "epoch" while this callback writes
        self._restored: dict | None = None  # our section of the checkpoint a resumed run started from
        self._plateau_due: tuple[int, float | None] | None = None  # (epoch, val P@3) of a skipped scheduler step
        self.epochs_done = 0  # epochs validated before the restored checkpoint

    @property
    def path(self) -> Path:
        return self.dirpath / LAST

    # ------------------------------------------------------------------ saving

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.every_n_steps or trainer.global_step % self.every_n_steps:
            return
        # On an epoch's last batch the epoch-end checkpoint follows; Lightning would also resume a step
        # checkpoint taken there by skipping that epoch's validation.
        progress = trainer.fit_loop.epoch_loop.batch_progress
        if progress.is_last_batch or progress.current.processed >= trainer.num_training_batches:
            return
        self._save(trainer, pl_module, "step")

    def on_train_epoch_end(self, trainer, pl_module):
        if self._plateau_due is not None and trainer.current_epoch == self._plateau_due[0]:
            self._step_plateau_schedulers(trainer)  # the checkpoint's own epoch end, re-run: nothing new to save
            return
        self._save(trainer, pl_module, "epoch")
        if trainer.fit_loop.restarting:  # resumed mid-epoch: Lightning steps no scheduler at this epoch end
            self._step_plateau_schedulers(trainer)

    def _save(self, trainer, pl_module, at: str) -> None:
        if not all(all_finite(p) for p in pl_module.parameters()):
            return  # keep the last good checkpoint; the non-finite loss check stops the run
        self._saving_at = at
        tmp = self.path.with_name(LAST + ".tmp")
        try:
            trainer.save_checkpoint(tmp, weights_only=False)  # SafeCheckpointIO.write: a failure removes tmp
        finally:
            self._saving_at = None
        if trainer.is_global_zero:
            os.replace(tmp, self.path)  # atomic: a kill leaves the old or the new file, never half of one
        trainer.strategy.barrier("LastCheckpoint")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        """Called for every checkpoint written during fit (ours and the best-model one)."""
        at = self._saving_at
        if at == "step":
            # The loader counts batches fetched, one more than trained (Lightning prefetches one).
            trained = trainer.fit_loop.epoch_loop.batch_progress.current.processed
            loop_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
            for state in loop_state.get("combined_loader", []):
                if isinstance(state, dict) and "consumed" in state:
                    state["consumed"] = trained
        monitor = trainer.callback_metrics.get("val/p_at_3")
        checkpoint[STATE_KEY] = {
            **self.info,
            "at": at or "validation",
            "rng": rng_states(),
            "should_stop": bool(trainer.should_stop),
            "monitor": None if monitor is None else float(monitor),
            "epochs_done": trainer.current_epoch + (0 if at == "step" else 1),  # epochs validated so far
        }
        if pl_module.device.type == "cpu":  # a resumed CPU run trains with them too (`resume.keep_cpu_threads`)
            checkpoint[STATE_KEY]["cpu_threads"] = torch.get_num_threads()
        if at == "epoch":  # Lightning logs the epoch's metrics after this hook: a kill in between would lose them
            step = trainer.fit_loop.epoch_loop._batches_that_stepped - 1  # the step Lightning logs them at
            logged = {key: float(value) for key, value in trainer._logger_connector.metrics["log"].items()}
            checkpoint[STATE_KEY]["epoch_metrics"] = [step, {"epoch": trainer.current_epoch, **logged}]

    # ------------------------------------------------------------------ resuming

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self._restored = checkpoint.get(STATE_KEY)
        if self._restored:
            self.epochs_done = int(self._restored.get("epochs_done", 0))

    def on_train_start(self, trainer, pl_module):
        if not self._restored:
            return
        if self._restored["at"] == "epoch":  # taken before that epoch's scheduler step, which is still due
            self._plateau_due = (self._restored["epochs_done"] - 1, self._restored.get("monitor"))
            step, metrics = self._restored.get("epoch_metrics") or (None, {})  # absent from older checkpoints
            for logger in trainer.loggers if metrics else ():  # a resumed run's logger skips a step logged already
                logger.log_metrics(metrics, step=step)
        if self._restored.get("should_stop"):
            trainer.should_stop = True  # early stopping had ended the run when the checkpoint was taken

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._restored and self._restored["at"] == "step":
            self._apply_rng()

    def on_train_epoch_start(self, trainer, pl_module):
        if self._plateau_due is not None:  # Lightning went straight on to the next epoch
            self._step_plateau_schedulers(trainer)
        if self._restored and self._restored["at"] != "step":
            self._apply_rng()

    def _apply_rng(self) -> None:
        set_rng_states(self._restored["rng"])
        self._restored = None

    def _step_plateau_schedulers(self, trainer) -> None:
        """The ReduceLROnPlateau step Lightning skips at the end of the epoch a run resumed in.

        The monitored value is that epoch's validation: the checkpoint's when it was taken at the epoch end
        (Lightning keeps no metrics), else the one just computed.
        """
        value = trainer.callback_metrics.get("val/p_at_3")
        if self._plateau_due is not None:
            value, self._plateau_due = self._plateau_due[1], None
        if value is None:
            return
        for config in trainer.lr_scheduler_configs:
            if config.reduce_on_plateau and config.interval == "epoch":
                config.scheduler.step(float(value))

    # Lightning stores a Checkpoint callback's state under its state_key; ours lives in STATE_KEY instead.
    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


class RunLock:
    """One writer per run: an exclusive lock on `<checkpoint dir>/writer.lock`, held while a process writes the run.

    The operating system releases it when the process ends, however it ends (kill -9 included), so a lock is
    never stale; the file itself stays and marks a folder where a run was started.
    """

    def __init__(self, directory: str | Path):
        self.path = Path(directory) / LOCK
        self._handle = None

    def acquire(self) -> bool:
        """Take the lock (False when another process holds it); records this process id in the file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.close()
                return False
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._handle = handle
        return True

    def holder(self) -> str:
        """The process id recorded by the lock's holder, for messages."""
        try:
            return self.path.read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def is_held(self) -> bool:
        """Whether another process holds the lock now (a probe: takes and releases it)."""
        if not self.path.is_file() or fcntl is None:
            return False
        with open(self.path, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
        return False

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing drops the lock
            self._handle = None


def hold_run(directory: str | Path, run_id: str | None) -> RunLock:
    """The run's writer lock, taken; ConfigError (one line) when another process is writing the run."""
    lock = RunLock(directory)
    try:
        acquired = lock.acquire()
    except OSError as error:
        raise StorageError(f"cannot create the run's lock file {lock.path} ({error.strerror}); fix that folder") from None
    if not acquired:
        raise written_elsewhere(run_id, lock)
    _remove_partial_writes(Path(directory))
    return lock


def _remove_partial_writes(directory: Path) -> None:
    """Remove the temporary files of checkpoint writes that a killed process left (kill -9 mid-write: as large as
    the checkpoint). Only with the run's lock held, when no other process can be writing them; a link is not a
    write's leftover and stays."""
    for partial in sorted(directory.glob("*.ckpt.tmp")):
        if partial.is_file() and not partial.is_symlink():
            size = partial.stat().st_size
            partial.unlink()
            print(f"removed {partial} ({size / 2**20:.1f} MiB), a checkpoint write its process did not finish",
                  flush=True)


def written_elsewhere(run_id: str | None, lock: RunLock) -> ConfigError:
    """The one-line refusal of a second writer of run `run_id`, whose `lock` another process holds."""
    return ConfigError(f"resume={run_id}: run {run_id} is being written by another process (pid {lock.holder()}, lock "
                       f"{lock.path}); a run has one writer: wait for that process to end, or stop it, then resume")
