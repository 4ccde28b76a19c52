"""One experiment, from a composed config to a closed MLflow run: data -> model -> fit -> test -> summary."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, RichProgressBar
from omegaconf import DictConfig

from xmc_repro.callbacks import EpochTime, PeakMemory, Rewiring
from xmc_repro.data import build_datamodule
from xmc_repro.errors import ConfigError
from xmc_repro.metrics import inverse_propensity
from xmc_repro.model import XMCClassifier
from xmc_repro.tracking import RunTracker, device_name, git_commit

CHECKPOINT_ROOT = Path("checkpoints")


def validate(cfg: DictConfig) -> None:
    """Settings that would otherwise fail deep inside training."""
    t = cfg.trainer
    for key in ("batch_size", "eval_batch_size", "max_epochs"):
        if int(t[key]) <= 0:
            raise ConfigError(f"trainer.{key}={t[key]} must be positive")
    if cfg.model.intermediate is not None and int(cfg.model.intermediate) <= 0:
        raise ConfigError(
            f"model.intermediate={cfg.model.intermediate} must be a positive layer size, or null for no intermediate layer"
        )
    if cfg.validate_on not in ("test", "holdout"):
        raise ConfigError(f"validate_on={cfg.validate_on!r} must be 'test' (the authors' protocol) or 'holdout'")
    if not 0 <= float(cfg.model.rewire_fraction) < 1:
        raise ConfigError(f"model.rewire_fraction={cfg.model.rewire_fraction} must be in [0, 1)")


def build_model(cfg: DictConfig, dm) -> XMCClassifier:
    t, m = cfg.trainer, cfg.model
    inv_prop = inverse_propensity(dm.train_label_counts, cfg.dataset.propensity.A, cfg.dataset.propensity.B)
    return XMCClassifier(
        num_features=dm.num_features,
        num_labels=dm.num_labels,
        head=m.head,
        connectivity=m.connectivity,
        intermediate=m.intermediate,
        bottleneck=m.bottleneck,
        mach=None if m.mach is None else dict(m.mach),
        dropout=float(cfg.dataset.dropout),
        loss=cfg.loss.name,
        lr=t.lr,
        lr_factor=t.lr_factor,
        lr_patience=t.lr_patience,
        lr_threshold=t.lr_threshold,
        min_lr=t.min_lr,
        inv_propensity=inv_prop,
    )


def build_callbacks(cfg: DictConfig, checkpoint_dir: Path) -> dict[str, pl.Callback]:
    t, d = cfg.trainer, cfg.dataset
    callbacks = {
        "rewiring": Rewiring(
            fraction=float(cfg.model.rewire_fraction),
            every_n_steps=d.get("rewire_every_n_steps"),
            every_epoch=bool(d.get("rewire_every_epoch", False)),
            seed=int(cfg.seed),
        ),
        "memory": PeakMemory(),
        "time": EpochTime(),
        # Both thresholds are P@3 fractions in the authors' code; our metrics are percentages.
        "early_stop": EarlyStopping(
            monitor="val/p_at_3", mode="max", patience=t.early_stop_patience, min_delta=t.early_stop_min_delta * 100
        ),
        "best": ModelCheckpoint(
            dirpath=checkpoint_dir, filename="best", monitor="val/p_at_3", mode="max", save_last=True
        ),
    }
    if t.checkpoint_every_n_steps:
        callbacks["steps"] = ModelCheckpoint(
            dirpath=checkpoint_dir, filename="step", every_n_train_steps=int(t.checkpoint_every_n_steps)
        )
    if t.progress_bar:
        callbacks["progress"] = RichProgressBar()
    return callbacks


def sweep_tags() -> dict[str, str]:
    """sweep_id and job number of a Hydra multirun job; nothing for a single run."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except ValueError:  # not launched by Hydra (tests, library use)
        return {}
    if hc.mode != RunMode.MULTIRUN:
        return {}
    return {"sweep_id": Path(hc.sweep.dir).as_posix(), "job_num": str(hc.job.num)}


def run(cfg: DictConfig) -> dict:
    """Train and test one configuration; returns the final metrics and run id."""
    validate(cfg)
    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    dm = build_datamodule(
        cfg.dataset,
        batch_size=int(cfg.trainer.batch_size),
        num_workers=int(cfg.trainer.num_workers),
        seed=int(cfg.seed),
        validate_on=cfg.validate_on,
        eval_batch_size=int(cfg.trainer.eval_batch_size),
    )
    dm.setup("fit")
    model = build_model(cfg, dm)

    tracker = RunTracker(cfg.logger.tracking_uri, cfg.logger.experiment_name, run_id=None)
    try:
        return _fit_and_test(cfg, dm, model, tracker)
    except BaseException as error:  # KeyboardInterrupt included: the run must not stay RUNNING
        tracker.finish("FAILED", f"{type(error).__name__}: {error}")
        raise


def _fit_and_test(cfg, dm, model, tracker) -> dict:
    from xmc_repro.sparse import backend

    checkpoint_dir = CHECKPOINT_ROOT / tracker.run_id
    callbacks = build_callbacks(cfg, checkpoint_dir)
    t = cfg.trainer
    trainer = pl.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        strategy=t.strategy,
        precision=t.precision,
        max_epochs=int(t.max_epochs),
        limit_train_batches=t.limit_train_batches,
        callbacks=list(callbacks.values()),
        logger=tracker.lightning_logger(),
        enable_progress_bar=bool(t.progress_bar),
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=50,
    )
    device = trainer.strategy.root_device
    tracker.log_config(
        cfg,
        {
            "table": cfg.table,
            "scale": cfg.scale,
            "git_commit": git_commit(),
            "sparse_backend": backend(device) if cfg.model.head in ("uniform", "mach") else "none",
            "device": device_name(device),
            "dataset": cfg.dataset.name,
            **sweep_tags(),
        },
    )
    trainer.fit(model, datamodule=dm)

    best = callbacks["best"].best_model_path
    if best:  # restore the best weights, as the authors' early stopping does
        state = torch.load(best, map_location=model.device, weights_only=False)["state_dict"]
        model.load_state_dict(state)
    model.to(device)
    inv_prop = model.val_metrics.inv_propensity
    test = model.evaluate(dm.test_dataloader(), inv_prop)
    train = model.evaluate(dm.train_eval_dataloader(), inv_prop, max_points=t.train_eval_max_points)
    callbacks["memory"].update(model)
    results = {f"test/{k}": v for k, v in test.items()}
    results.update({f"train/{k}": v for k, v in train.items()})
    results["epochs"] = callbacks["time"].epochs
    results["time_per_epoch_s"] = callbacks["time"].time_per_epoch_s
    if callbacks["memory"].peak_gib is not None:
        results["peak_gpu_memory_gib"] = callbacks["memory"].peak_gib
    tracker.log_metrics(results)
    tracker.finish("FINISHED")
    results["run_id"] = tracker.run_id
    results["ui"] = tracker.ui_command()
    results["device"] = device_name(device)
    return results
