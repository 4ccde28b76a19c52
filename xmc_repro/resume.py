"""Resuming a run: `resume=<run id or .ckpt path>` continues the same MLflow run from its last checkpoint,
with the run's own settings; only settings that do not change what is trained may differ."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from xmc_repro import checkpoints
from xmc_repro.errors import ConfigError

CHECKPOINT_ROOT = Path("checkpoints")
# Settings a resumed run may change: none of them alters what is trained. Everything else comes from the run.
RESUMABLE_SETTINGS = (
    "trainer.max_epochs",
    "trainer.progress_bar",
    "trainer.num_workers",
    "trainer.eval_batch_size",
    "trainer.checkpoint_every_n_steps",
)
LIVE_SECTIONS = ("resume", "logger", "hydra")  # always taken from the command line


def resume_checkpoint(value) -> Path:
    """The checkpoint named by `resume=`: a file path, or the run id of a run started in this directory."""
    given = Path(str(value)).expanduser()
    if given.is_file():
        return given
    by_run = CHECKPOINT_ROOT / str(value) / checkpoints.LAST
    if by_run.is_file():
        return by_run
    raise ConfigError(
        f"resume={value}: neither a checkpoint file nor a run with {by_run}; pass the run id from the directory "
        "the run was started in, or the path of its last.ckpt"
    )


def resume_config(cfg: DictConfig, stored: DictConfig, explicit: list[str]) -> DictConfig:
    """The run's stored config, with this command line's `logger`, `resume` and any RESUMABLE_SETTINGS.

    A setting given explicitly that would change what the run trains is refused: a resumed run equals the
    run it continues. Sections this code has and the run's config lacks come from the command line.
    """
    merged = stored.copy()
    for key in explicit:
        if key.split(".")[0] in LIVE_SECTIONS or key in RESUMABLE_SETTINGS:
            continue
        now, then = (OmegaConf.select(c, key, default=None) for c in (cfg, stored))
        if now is not None and then is not None and _plain(now) != _plain(then):
            raise ConfigError(
                f"resume: {key} was {_short(then)} in the run and is {_short(now)} on this command line; a resumed "
                f"run keeps its settings (only {', '.join(RESUMABLE_SETTINGS)} may change): drop {key}=..."
            )
    for key in RESUMABLE_SETTINGS:
        if key in explicit:
            OmegaConf.update(merged, key, OmegaConf.select(cfg, key), force_add=True)
    for key in cfg:
        if key in LIVE_SECTIONS or key not in merged:
            merged[key] = _plain(cfg[key])
    return merged


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


def _short(value) -> str:
    text = OmegaConf.to_yaml(value).strip() if isinstance(value, DictConfig) else repr(value)
    return text if len(text) < 80 else text[:77] + "..."


def prepare(cfg: DictConfig, explicit: list[str], multirun: bool) -> tuple[DictConfig, Path | None, str | None]:
    """(config to run, checkpoint to resume from, MLflow run id to continue); the last two None for a new run.

    `explicit`: the config keys given on the command line; `multirun`: launched by `-m`.
    """
    if not cfg.get("resume"):
        return cfg, None, None
    if multirun:
        raise ConfigError(f"resume={cfg.resume} continues one run: run it without -m")
    path = resume_checkpoint(cfg.resume)
    saved = checkpoints.read(path)
    merged = resume_config(cfg, OmegaConf.create(saved["config"]), explicit)
    return merged, path, saved["run_id"]
