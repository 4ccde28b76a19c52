"""Lightning callbacks: sparse rewiring, early stopping and the best epoch, peak GPU memory, epoch and step times, a
profile of some training steps, and a SIGTERM that stops every DDP rank at the same batch."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

from xmc_repro.distributed import assert_identical_across_ranks, stop_watching_other_ranks, world_size
from xmc_repro.sparse.rewire import reset_optimizer_state_
from xmc_repro.validation import REWIRE_SCHEDULES


class Rewiring(pl.Callback):
    """Prune-and-regrow (SET) for every layer with a `rewire` method.

    Every `every_n_steps` optimizer steps (or at the start of every epoch but the first), the `fraction` of
    sparse weights with the smallest magnitude get new random sources. As in the authors' code the weight value
    is kept and Adam's moments at the rewired slots are zeroed. The generator is seeded once and checkpointed,
    so a resumed run and every DDP rank draw the same connections.

    `schedule="authors"` rewires after optimizer steps 1, N+1, 2N+1, ... (their `iterations % N == 1`);
    `"multiples"` after steps N, 2N, ....  `exact_count`: see `xmc_repro.sparse.rewire.lowest_magnitude`.
    """

    def __init__(self, fraction: float, every_n_steps: int | None = None, every_epoch: bool = False, seed: int = 0,
                 schedule: str = "authors", exact_count: bool = False):
        if schedule not in REWIRE_SCHEDULES:
            raise ValueError(f"rewiring schedule {schedule!r} is unknown; choose one of {', '.join(REWIRE_SCHEDULES)}")
        self.fraction = fraction
        self.every_n_steps = every_n_steps
        self.every_epoch = every_epoch
        self.schedule = schedule
        self.exact_count = exact_count
        self.generator = torch.Generator().manual_seed(seed)
        self.rewirings = 0

    def due(self, step: int) -> bool:
        """Whether rewiring follows optimizer step `step` (1 = the first step)."""
        n = self.every_n_steps
        if not n or step <= 0:
            return False
        return (step - 1) % n == 0 if self.schedule == "authors" else step % n == 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.due(trainer.global_step):
            self.rewire(trainer, pl_module)

    def on_train_epoch_start(self, trainer, pl_module):
        if self.every_epoch and trainer.current_epoch > 0:
            self.rewire(trainer, pl_module)

    @torch.no_grad()
    def rewire(self, trainer, pl_module):
        if self.fraction <= 0:
            return
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        release = getattr(pl_module, "release_step_graph", None)
        if release is not None:  # rewiring's temporaries then take the graph's place in memory, not its side
            release()
        for layer in pl_module.sparse_layers():
            slots = layer.rewire(self.fraction, self.generator, self.exact_count)
            if optimizer is not None:
                reset_optimizer_state_(optimizer, layer.weight, slots)
        self.rewirings += 1
        if trainer.world_size > 1:  # DDP keeps no buffer in sync by itself (broadcast_buffers=false)
            named = {f"{name}.{attr}": getattr(layer, attr) for name, layer in pl_module.named_modules()
                     if hasattr(layer, "rewire") for attr in ("indices", "weight")}
            named["rewiring generator"] = self.generator.get_state()
            assert_identical_across_ranks(named, f"rewiring {self.rewirings} (step {trainer.global_step})")

    def state_dict(self):
        return {"generator": self.generator.get_state(), "rewirings": self.rewirings}

    def load_state_dict(self, state_dict):
        self.generator.set_state(state_dict["generator"])
        self.rewirings = state_dict["rewirings"]


def early_stopping(patience: int, min_delta: float) -> EarlyStopping:
    """Stop when val P@3 has not improved by `min_delta` for `patience` epochs.

    `min_delta` is a P@3 fraction as in the authors' code; the logged metrics are percentages.
    """
    return EarlyStopping(monitor="val/p_at_3", mode="max", patience=int(patience), min_delta=float(min_delta) * 100)


class BestCheckpoint(ModelCheckpoint):
    """The best epoch's checkpoint, where an epoch is better only by more than `min_delta` (a P@3 fraction), as
    in Keras's EarlyStopping, whose best weights the authors restore. Lightning's keeps any strict improvement."""

    def __init__(self, dirpath=None, filename=None, monitor=None, mode="min", enable_version_counter=True,
                 min_delta: float = 0.0):
        # Each setting named: a callback's config passes only the settings its signature names (instantiate_with).
        super().__init__(dirpath=dirpath, filename=filename, monitor=monitor, mode=mode,
                         enable_version_counter=enable_version_counter)
        self.min_delta = float(min_delta) * 100

    def check_monitor_top_k(self, trainer, current=None):
        if current is not None and self.best_k_models:
            current = current - self.min_delta if self.mode == "max" else current + self.min_delta
        return super().check_monitor_top_k(trainer, current)


class PeakMemory(pl.Callback):
    """Peak GPU memory (torch.cuda.max_memory_allocated, GiB), reset at fit start, logged every epoch.

    On a CPU run there is no such counter: `peak_gib` stays None and nothing is logged.
    """

    def __init__(self):
        self.peak_gib: float | None = None

    @staticmethod
    def _device(pl_module):
        return pl_module.device if pl_module.device.type == "cuda" else None

    def on_fit_start(self, trainer, pl_module):
        if self._device(pl_module) is not None:
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_epoch_end(self, trainer, pl_module):
        self.update(pl_module)
        if self.peak_gib is not None:
            pl_module.log("peak_gpu_memory_gib", self.peak_gib, rank_zero_only=True)

    def update(self, pl_module):
        device = self._device(pl_module)
        if device is not None:
            self.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30


class EpochTime(pl.Callback):
    """Wall time per epoch and per training step. `time_per_epoch_s` follows the paper: whole fit time / epochs
    (evaluation included).

    Steps are timed over windows of `step_window` batches of one epoch, between two device syncs (one per window, so
    the GPU's queued work counts where it runs): a window includes its steps' callbacks (a rewiring, a checkpoint),
    never validation, nor the logging of the previous window's time. Each window's mean is logged as
    `train/ms_per_step` at its last step (a curve over training: early steps, whose squared-hinge gradients are
    dense, are slower); `step_ms_median` is the median over the fit's windows, which a rewiring inside a window does
    not move. An epoch of `step_window` batches or fewer is one window, closed at its last batch.

    A run resumed mid-epoch logs that epoch's `epoch_time_s` as the time up to its checkpoint plus the time since the
    resume (the steps redone after the checkpoint count once).
    """

    def __init__(self, step_window: int = 100):
        self.step_window = step_window
        self.fit_seconds = 0.0
        self.epochs = 0
        self.step_ms: list[float] = []  # every window's mean, in order
        self.epoch_step_ms: list[float] = []  # this epoch's
        self._fit_start = self._epoch_start = None
        self._epoch_seconds_before_resume = 0.0
        self._window: tuple[float, int] | None = None  # (start time, first batch index)

    def on_fit_start(self, trainer, pl_module):
        self._fit_start = time.perf_counter()

    def on_train_start(self, trainer, pl_module):
        # A run resumed mid-epoch gets no on_train_epoch_start for that epoch: start its clocks here.
        self._epoch_start, self._window = time.perf_counter() - self._epoch_seconds_before_resume, None

    def on_train_epoch_start(self, trainer, pl_module):
        self._epoch_start, self._window, self.epoch_step_ms = time.perf_counter(), None, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._window is not None and batch_idx - self._window[1] < self.step_window:
            return
        self._close_window(trainer, pl_module, batch_idx)
        self._window = (time.perf_counter(), batch_idx)  # after the logging (a store write): no window counts it

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # A short epoch: its only window. A longer one's tail is dropped, also after a mid-epoch resume (its last
        # few batches and the restart's warm-up would make a window).
        if batch_idx + 1 == trainer.num_training_batches <= self.step_window:
            self._close_window(trainer, pl_module, batch_idx + 1)
            self._window = None

    def _close_window(self, trainer, pl_module, end_batch: int) -> None:
        """Syncs the device; the open window (if any), of the batches before `end_batch`, logged per step."""
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        if self._window is None or end_batch <= self._window[1]:
            return
        ms = (time.perf_counter() - self._window[0]) * 1000 / (end_batch - self._window[1])
        self.step_ms.append(ms)
        self.epoch_step_ms.append(ms)
        for logger in trainer.loggers:
            logger.log_metrics({"train/ms_per_step": ms}, step=trainer.global_step)

    def on_train_epoch_end(self, trainer, pl_module):
        pl_module.log("epoch_time_s", time.perf_counter() - self._epoch_start, rank_zero_only=True)

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.epochs = trainer.current_epoch + 1

    def on_fit_end(self, trainer, pl_module):
        self.fit_seconds += time.perf_counter() - self._fit_start

    @property
    def time_per_epoch_s(self) -> float:
        return self.fit_seconds / max(self.epochs, 1)

    @property
    def step_ms_median(self) -> float | None:
        return statistics.median(self.step_ms) if self.step_ms else None

    def state_dict(self):  # a resumed run keeps counting the time already spent
        now = time.perf_counter()
        running = now - self._fit_start if self._fit_start is not None else 0.0
        epoch = now - self._epoch_start if self._epoch_start is not None else 0.0
        return {"fit_seconds": self.fit_seconds + running, "step_ms": list(self.step_ms), "epoch_seconds": epoch}

    def load_state_dict(self, state_dict):
        self.fit_seconds = state_dict["fit_seconds"]
        self.step_ms = list(state_dict.get("step_ms", []))  # absent from checkpoints written before step times
        self._epoch_seconds_before_resume = state_dict.get("epoch_seconds", 0.0)


class StepProfile(pl.Callback):
    """`trainer.profile_steps=N`: torch.profiler over N training steps of the run, from step `start` on (past the
    warm-up and the first capture of the step graph), rank 0 only.

    Writes to the run's folder `profile-trace.json.gz` (a Chrome trace: Perfetto, chrome://tracing) and
    `profile.txt`: on a GPU, the device's idle time per step with what the host did meanwhile and any blocking
    CUDA call (`xmc_repro.trace_gaps`), then the top ops; written and printed at the end of fit. Whatever the
    steps include (a rewiring, a validation) is in the profile; profiling them adds a little to their time.
    """

    def __init__(self, dirpath: Path, steps: int, start: int = 100):
        self.dirpath, self.steps, self.start = Path(dirpath), steps, start
        self._profiler = None
        self._first: int | None = None
        self._stopped = None  # (profiler, steps, device) until written at the end of fit

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._first is None and trainer.global_step >= self.start and trainer.global_rank == 0:
            from torch.profiler import ProfilerActivity

            cuda = pl_module.device.type == "cuda"
            self._profiler = torch.profiler.profile(
                activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            self._profiler.start()
            self._first = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._profiler is not None and trainer.global_step - self._first >= self.steps:
            self._stop(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        if self._profiler is not None:  # the run ended first
            self._stop(trainer, pl_module)

    def _stop(self, trainer, pl_module):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self._profiler.stop()
        self._stopped, self._profiler = (self._profiler, trainer.global_step - self._first, pl_module.device), None

    def on_fit_end(self, trainer, pl_module):
        """Written once training is over, so that the epoch times do not include it."""
        if self._first is None and trainer.global_rank == 0:
            print(f"no profile: training ended at step {trainer.global_step}, before step {self.start + 1} where "
                  "trainer.profile_steps starts", flush=True)
        if self._stopped is None:
            return
        from xmc_repro import trace_gaps

        profiler, steps, device = self._stopped
        self._stopped = None
        self.dirpath.mkdir(parents=True, exist_ok=True)
        trace = self.dirpath / "profile-trace.json.gz"
        gaps, table = trace_gaps.profile_report(profiler, trace, steps, device.type == "cuda")
        summary = f"profile of training steps {self._first + 1}-{self._first + steps} ({trace})\n{gaps}"
        (self.dirpath / "profile.txt").write_text(summary + table)
        print(summary, end="", flush=True)


class MemoryPeakReport(pl.Callback):
    """`trainer.memory_report=true`: what was allocated at the run's peak GPU memory, by allocation site
    (`xmc_repro.memory_peak`), written to the run's folder as `memory-peak.txt` and printed at the end of fit.

    The allocator's history is recorded from setup on (the model's parameters included), rank 0 only; recording
    adds host time to every allocation, so epoch times of such a run are not for comparison.
    """

    def __init__(self, dirpath: Path):
        self.dirpath = Path(dirpath)
        self._device = None

    def setup(self, trainer, pl_module, stage):
        if stage != "fit" or trainer.global_rank != 0:
            return
        if trainer.strategy.root_device.type != "cuda":
            print("no memory report: the run is not on a CUDA device", flush=True)
            return
        from xmc_repro.memory_peak import start_recording

        self._device = trainer.strategy.root_device
        start_recording()

    def on_fit_end(self, trainer, pl_module):
        """Written once training is over, so that the epoch times do not include it."""
        if self._device is None:
            return
        from xmc_repro.memory_peak import peak_report, stop_recording

        text = peak_report(self._device)
        stop_recording()
        self._device = None
        self.dirpath.mkdir(parents=True, exist_ok=True)
        (self.dirpath / "memory-peak.txt").write_text(text + "\n")
        print(f"{text}\n({self.dirpath / 'memory-peak.txt'})", flush=True)


class _SigtermNoted(_SignalConnector):
    """Lightning's signal connector, whose SIGTERM handler only notes the signal when there are several ranks.

    Lightning 2.6's handler (`_SignalConnector._sigterm_notifier_fn`) runs `torch.distributed.broadcast(src=0)`
    inside the signal handler, wherever the main thread is: on a rank other than 0 that broadcast meets rank 0's next
    collective (a gradient all-reduce, a rewiring check), and both ranks wait for each other until the process group's
    timeout (30 min). Here the signal is only noted (`pending`); `SigtermStopsEveryRank` lets the ranks agree on it at
    the next batch. With one process the flag is Lightning's own, as before."""

    pending = False

    def register_signal_handlers(self) -> None:
        self.pending = False
        super().register_signal_handlers()

    def _sigterm_notifier_fn(self, signum, frame) -> None:
        if world_size() > 1:
            self.pending = True  # no collective in a signal handler
        else:
            self.received_sigterm = True


def sigterm_noted(trainer) -> bool:
    """Whether this process got a SIGTERM during `trainer.fit` (flagged by Lightning, or noted and not yet agreed)."""
    connector = getattr(trainer, "_signal_connector", None)
    return bool(getattr(connector, "received_sigterm", False) or getattr(connector, "pending", False))


class SigtermStopsEveryRank(pl.Callback):
    """A SIGTERM to any DDP rank stops every rank at the same batch, with Lightning's own SIGTERMException.

    After every training and validation batch (the same count on every rank: each rank takes its share of every global
    batch and validates on the whole set) and at the end of training, the ranks all-reduce whether any of them got a
    SIGTERM; if one did, every rank sets Lightning's flag at that same point, and Lightning's loops raise
    SIGTERMException on every rank at the same check. Rank 0 then marks the run FAILED (resumable from the last
    checkpoint) and the other ranks say that rank 0 records it. Rank 0 first stops Lightning's child-process observer
    (`stop_watching_other_ranks`): the other ranks exit first, and it would SIGKILL rank 0 before the run is closed.
    """

    def setup(self, trainer, pl_module, stage):  # before Lightning registers its handlers (Trainer._run)
        if not isinstance(trainer._signal_connector, _SigtermNoted):
            trainer._signal_connector = _SigtermNoted(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._agree(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self._agree(trainer)

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:  # the last collective of the run follows: other ranks may exit from there on
            stop_watching_other_ranks()
        self._agree(trainer)

    def on_exception(self, trainer, pl_module, exception):
        if trainer.global_rank == 0:  # no collective follows; another rank that stops must not kill this one
            stop_watching_other_ranks()

    @staticmethod
    def _agree(trainer) -> None:
        connector = trainer._signal_connector
        if trainer.world_size == 1 or not isinstance(connector, _SigtermNoted) or connector.received_sigterm:
            return
        if trainer.strategy.reduce_boolean_decision(connector.pending, all=False):
            if trainer.global_rank == 0:
                stop_watching_other_ranks()
            trainer.strategy.barrier("sigterm")  # no rank exits before rank 0 stopped the observer
            connector.received_sigterm = True
