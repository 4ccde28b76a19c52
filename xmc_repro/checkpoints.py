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
replace the last good checkpoint.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.callbacks import Checkpoint

from xmc_repro.errors import ConfigError

LAST = "last.ckpt"
STATE_KEY = "xmc_repro"  # our section of a checkpoint


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


def read(path: str | Path) -> dict:
    """Our section of a checkpoint file: config (YAML), run_id, ...; ConfigError when it is not one of ours."""
    path = Path(path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # truncated or not a checkpoint at all
        raise ConfigError(f"resume={path}: not a readable checkpoint ({type(error).__name__}: {error})") from None
    section = checkpoint.get(STATE_KEY) if isinstance(checkpoint, dict) else None
    if not section or "config" not in section:
        raise ConfigError(f"resume={path}: not a checkpoint written by python -m xmc_repro (no run config in it)")
    return section


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
            trainer.save_checkpoint(tmp, weights_only=False)
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
