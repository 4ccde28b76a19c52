"""What a run is, in words: its MLflow run name and the title of its end-of-run summary.

Both name the dataset and the whole model (head with its size, intermediate layer, loss), so that runs of
one sweep can be told apart in the MLflow runs table and on the console. Reads only the composed config;
settings it does not find are left out.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf


def dataset_label(dataset) -> str:
    """`Amazon-670K slice`: the features only where one dataset comes with several (slice | cascade)."""
    name, features = dataset["name"], dataset.get("features")
    return f"{name} {features}" if features in ("slice", "cascade") else str(name)


def _head(cfg: DictConfig, short: bool) -> str:
    """The head with its size, as its config words it (`model.label`, `model.description`; conf/model/*.yaml)."""
    head = OmegaConf.select(cfg, "model.head")
    fallback = str(head) if short else f"{head} head"
    try:  # a size left null (or an older config without these keys) leaves just the head's name
        text = OmegaConf.select(cfg, "model.label" if short else "model.description", default=None)
    except Exception:
        return fallback
    return fallback if text is None or "None" in str(text) else str(text)


def run_name(cfg: DictConfig) -> str:
    """`Synthetic uniform-32 int-256 squared_hinge seed0` (the tracker appends a piece of the run id)."""
    intermediate = OmegaConf.select(cfg, "model.intermediate")
    return " ".join(
        [dataset_label(cfg.dataset), _head(cfg, short=True), f"int-{intermediate}" if intermediate else "no-int",
         str(OmegaConf.select(cfg, "loss.name")), f"seed{OmegaConf.select(cfg, 'seed')}"]
    )


def title(cfg: DictConfig) -> str:
    """`Synthetic: uniform head, 32 connections per label, intermediate layer 256, squared_hinge loss, seed 0`."""
    parts = [_head(cfg, short=False)]
    if OmegaConf.select(cfg, "model.intermediate"):
        parts.append(f"intermediate layer {cfg.model.intermediate}")
    elif OmegaConf.select(cfg, "model") is not None and "intermediate" in cfg.model:
        parts.append("no intermediate layer")
    if OmegaConf.select(cfg, "loss.name"):
        parts.append(f"{cfg.loss.name} loss")
    if OmegaConf.select(cfg, "seed") is not None:
        parts.append(f"seed {cfg.seed}")
    return f"{dataset_label(cfg.dataset)}: {', '.join(parts)}"


def selection(cfg: DictConfig, tested_weights: str | None = None) -> str | None:
    """Which weights were tested (`tested_weights`: "best epoch" | "last epoch") and which split chose the best
    epoch and stopped training (None when the config does not say)."""
    if tested_weights == "last epoch":  # trainer.restore_best=early_stop, as the authors' Keras code
        if OmegaConf.select(cfg, "callbacks.early_stop") is None:
            return "tested with the last epoch's weights: no early stopping (~callbacks.early_stop)"
        return "tested with the last epoch's weights: max_epochs ended the run before early stopping"
    split = OmegaConf.select(cfg, "validate_on")
    if split == "test":  # the early-stopping and LR-halving monitor too, see conf/trainer/default.yaml
        return "epoch chosen on test P@3 (validate_on=test, the authors' protocol)"
    if split == "holdout":
        return "epoch chosen on P@3 of a held-out part of train (validate_on=holdout)"
    return None
