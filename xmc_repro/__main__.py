"""`python -m xmc_repro [overrides]`: one experiment; `python -m xmc_repro -m ...`: a sweep (one MLflow run per job)."""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from xmc_repro.errors import UserError


def print_summary(cfg: DictConfig, results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{cfg.dataset.name}: {cfg.model.head} head", show_header=True)
    table.add_column("split")
    for k in (1, 3, 5):
        table.add_column(f"P@{k}", justify="right")
    for split in ("test", "train"):
        table.add_row(split, *(f"{results[f'{split}/p_at_{k}']:.2f}" for k in (1, 3, 5)))
    console = Console()
    console.print(table)
    memory = results.get("peak_gpu_memory_gib")
    console.print(
        f"peak GPU memory: {f'{memory:.3f} GiB' if memory is not None else 'not applicable (CPU run)'}"
        f" | epochs: {results['epochs']} | seconds per epoch: {results['time_per_epoch_s']:.1f}"
        f" | device: {results['device']}"
    )
    console.print(f"MLflow run {results['run_id']}; browse with: {results['ui']}")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig):
    from xmc_repro.train import run

    try:
        results = run(cfg)
    except UserError as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print_summary(cfg, results)
    return results


if __name__ == "__main__":
    main()
