"""What a run prints while it trains: a progress bar that fits 80 columns, or one line per epoch.

`quiet()` keeps Lightning's messages to one line each and drops the lines a user can do nothing about: its
advertising tips and warnings about its own logging cadence or deprecations inside Lightning, and MLflow's
tracebacks of store calls that are retried.
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings

import lightning.pytorch as pl
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import ProcessingSpeedColumn, RichProgressBarTheme

from xmc_repro.errors import DataWarning

# (metric Lightning logs, what the console calls it)
SHOWN = (("train/loss_step", "loss"), ("val/p_at_3", "val P@3"))
# The bar reads the step loss from the device this often: reading it waits for the GPU to finish the step.
LOSS_EVERY_N_STEPS = 50
# The bar is redrawn at most this often (seconds) within an epoch: a redraw costs about 0.2 ms of host time
# (cProfile, a 2-core CPU), a good part of a GPU training step at batch 32.
REDRAW_EVERY_S = 0.1
# Warnings nobody running this tool can act on (Lightning's internals, not the user's settings).
UNACTIONABLE = (
    r".*is smaller than the logging interval.*",  # short epochs: per-step loss then reaches MLflow once an epoch
    r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",  # Lightning vs. a newer torch
    r"Checkpoint directory .* exists and is not empty.*",  # the run's own folder: its writer lock, or a resume
    # torch 2.13 deprecates conf/trainer/ddp.yaml's broadcast_buffers=false and itself advises keeping it for now
    r"`broadcast_buffers` is deprecated.*",
    # no sync needed: the epoch's wall time is rank 0's, the epoch loss is already the mean over all ranks
    r"It is recommended to use `self.log\('(epoch_time_s|train/loss_epoch)', \.\.\., sync_dist=True\)`.*",
)


class _NoTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def quiet() -> None:
    """One line per Lightning message (not also through Hydra's root handler), no tips, no unactionable warnings."""
    # Lightning gives the `lightning` logger a handler of its own (`INFO: ...`) and lets records propagate to the
    # root logger too, which Hydra has also given a console handler: every message came out twice.
    logging.getLogger("lightning").propagate = False
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoTips) for f in rank_zero.filters):
        rank_zero.addFilter(_NoTips())
    for pattern in UNACTIONABLE:
        warnings.filterwarnings("ignore", message=pattern)
    warnings.formatwarning = _one_line
    # MLflow logs every failed store call with SQL and traceback (tens of lines), also those a retry then rides out
    # (`tracking.with_retries`); a call that fails for good ends the run with our own line, which names the cause.
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


_formatwarning = warnings.formatwarning  # as Python, or Lightning (imported above), formats warnings


def _one_line(message, category, filename, lineno, line=None) -> str:
    """A DataWarning as the line it says (it names its file); any other warning as before."""
    if issubclass(category, DataWarning):
        return f"warning: {message}\n"
    return _formatwarning(message, category, filename, lineno, line)


class ProgressBar(RichProgressBar):
    """Lightning's rich bar fitted to 80 columns: two short metrics, no batches-per-second column, no `v_num`
    (the tail of the MLflow run id, which the end-of-run summary prints whole); epochs counted from 1."""

    def __init__(self):
        super().__init__(theme=RichProgressBarTheme(metrics_format=".3g"))
        self._loss: float | None = None
        self._loss_step = -LOSS_EVERY_N_STEPS
        self._drawn = -float("inf")  # time.monotonic() of the last redraw within an epoch

    def _redraw_due(self, batch_idx: int, batches) -> bool:
        now = time.monotonic()
        if now - self._drawn < REDRAW_EVERY_S and batch_idx + 1 != batches:
            return False
        self._drawn = now
        return True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._redraw_due(batch_idx, trainer.num_training_batches):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        batches = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        if self._redraw_due(batch_idx, batches[dataloader_idx] if batches else None):
            super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def configure_columns(self, trainer) -> list:
        columns = [c for c in super().configure_columns(trainer) if not isinstance(c, ProcessingSpeedColumn)]
        for column in columns:
            if isinstance(column, BarColumn):
                column.bar_width = 16  # rich would give the bar the metrics' room
        return columns

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        loss = trainer.callback_metrics.get("train/loss_step")
        if loss is not None and trainer.global_step - self._loss_step >= LOSS_EVERY_N_STEPS:
            self._loss, self._loss_step = float(loss), trainer.global_step
        if self._loss is not None:
            metrics["train/loss_step"] = self._loss
        return {label: metrics[key] for key, label in SHOWN if key in metrics}

    def _get_train_description(self, current_epoch: int) -> str:
        total = f"/{self.trainer.max_epochs}" if self.trainer.max_epochs is not None else ""
        return f"{f'Epoch {current_epoch + 1}{total}':{len(self.validation_description)}}"


def _value(metrics: dict, key: str) -> float | None:
    value = metrics.get(key)
    return None if value is None else float(value)


class EpochLine(pl.Callback):
    """With the progress bar off (logs, cluster jobs): one line per epoch, printed once validation is done:
    `epoch 3/8  loss 0.412  val P@1 41.20 P@3 30.15 P@5 24.02  lr 1.0e-03  12.3 s  2.41 ms/step`
    (the median over the epoch's step windows, xmc_repro.callbacks.EpochTime). An epoch can take an hour (670k labels
    on a CPU): while it runs, a line every `every_s` seconds says where it is
    (`epoch 3/8  batch 1,200/15,327  61 s`)."""

    def __init__(self, every_s: float = 60.0):
        self.every_s = every_s
        self._start = None
        self._last_line = 0.0

    def on_train_start(self, trainer, pl_module):
        self.on_train_epoch_start(trainer, pl_module)  # a run resumed mid-epoch gets no on_train_epoch_start for it

    def on_train_epoch_start(self, trainer, pl_module):
        self._start = time.perf_counter()
        self._last_line = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._where(trainer, "batch", batch_idx, trainer.num_training_batches)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self._where(trainer, "validation batch", batch_idx, trainer.num_val_batches[dataloader_idx])

    def _where(self, trainer, what: str, batch_idx: int, total) -> None:
        now = time.monotonic()
        if now - self._last_line < self.every_s or trainer.global_rank != 0 or self._start is None:
            return
        self._last_line = now
        of = f"/{total:,}" if total != float("inf") else ""  # an iterable dataset's epoch has no known length
        print(f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}  {what} {batch_idx + 1:,}{of}  "
              f"{time.perf_counter() - self._start:.0f} s", flush=True)

    def on_train_epoch_end(self, trainer, pl_module):
        # The model's own mean, over all DDP ranks: a collective, so every rank asks before rank 0 alone prints.
        loss = pl_module.epoch_loss() if hasattr(pl_module, "epoch_loss") else None
        if trainer.global_rank != 0 or self._start is None:
            return
        metrics = trainer.callback_metrics
        parts = [f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        p_at = [(k, _value(metrics, f"val/p_at_{k}")) for k in (1, 3, 5)]
        if any(v is not None for _, v in p_at):
            parts.append("val " + " ".join(f"P@{k} {v:.2f}" for k, v in p_at if v is not None))
        if trainer.optimizers:
            parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.1e}")
        parts.append(f"{time.perf_counter() - self._start:.1f} s")
        windows = next((c.epoch_step_ms for c in trainer.callbacks if hasattr(c, "epoch_step_ms")), None)
        if windows:  # xmc_repro.callbacks.EpochTime's step windows
            parts.append(f"{statistics.median(windows):.2f} ms/step")
        print("  ".join(parts), flush=True)


class EvaluationProgress:
    """The final test and train evaluations, shown while they run: at 670k labels on a CPU a batch of 32 takes about
    0.2 s, so testing 153,025 points and 200,000 training points takes half an hour, after the epochs' progress bar
    has gone. With the progress bar on, a bar like the validation's; off (logs), a line when each starts and one
    every `every_s` seconds while it runs."""

    def __init__(self, bar: bool, every_s: float = 30.0):
        self.bar, self.every_s = bar, every_s

    def track(self, loader, description: str):
        """`loader`'s batches, unchanged, counted as they are taken."""
        total = len(loader)
        if self.bar:
            columns = (TextColumn("{task.description}"), BarColumn(bar_width=16), MofNCompleteColumn(),
                       TimeElapsedColumn(), TextColumn("•"), TimeRemainingColumn())
            with Progress(*columns, refresh_per_second=2) as progress:
                task = progress.add_task(f"{description:10}", total=total)
                for batch in loader:
                    yield batch
                    progress.advance(task)
            return
        start = last = time.monotonic()
        print(f"{description}: {total:,} batches", flush=True)
        for done, batch in enumerate(loader, 1):
            yield batch
            now = time.monotonic()
            if now - last >= self.every_s and done < total:
                last = now
                print(f"{description}: {done:,}/{total:,} batches, {now - start:.0f} s", flush=True)
