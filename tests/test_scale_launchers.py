"""The launcher and DDP trainer presets compose, instantiate, and reach SLURM's submission script as configured."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

CONF = str(Path(__file__).resolve().parent.parent / "conf")


def _compose(overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize(
    "name, cls",
    [("submitit_slurm", "SlurmLauncher"), ("submitit_local", "LocalLauncher"), ("joblib", "JoblibLauncher")],
)
def test_launcher_instantiates(name, cls):
    cfg = _compose([f"hydra/launcher={name}"])
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == cls


def test_slurm_settings_reach_the_sbatch_script(tmp_path, monkeypatch):
    """The real plugin and submitit write the array job's script; only the `sbatch` call is replaced."""
    from hydra.core.utils import setup_globals
    from submitit.core.utils import FailedJobError
    from submitit.slurm.slurm import SlurmExecutor

    cfg = _compose([
        "hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu", "hydra.launcher.gpus_per_node=4",
        "hydra.launcher.tasks_per_node=4", "hydra.launcher.timeout_min=90", "hydra.launcher.array_parallelism=2",
        "hydra.launcher.account=xmc", f"hydra.sweep.dir={tmp_path}", "trainer=ddp", "trainer.devices=4",
    ])
    setup_globals()
    launcher = instantiate(cfg.hydra.launcher)
    launcher.config = cfg
    monkeypatch.setattr(SlurmExecutor, "_make_submission_command", lambda self, path: ["false"])
    bin_dir = tmp_path / "bin"  # submitit looks for `srun` before it writes anything; it is never run here
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    with pytest.raises(FailedJobError):  # `false` for sbatch: fails after the script is written
        launcher.launch([["model=dense"], ["model=uniform"], ["model=unstructured"]], initial_job_idx=0)
    scripts = list(tmp_path.glob(".submitit/**/.submission_file_*.sh"))
    assert len(scripts) == 1
    text = scripts[0].read_text()
    for line in ("--partition=gpu", "--gpus-per-node=4", "--ntasks-per-node=4", "--time=90",
                 "--array=0-2%2", "--account=xmc", "--cpus-per-task=8", "--mem=64GB"):
        assert f"#SBATCH {line}" in text, line


def test_ddp_presets():
    from lightning.pytorch.strategies import DDPStrategy

    ddp = _compose(["trainer=ddp"]).trainer
    assert ddp.batch_size == 32  # the global batch stays the paper's
    strategy = instantiate(ddp.strategy)
    assert isinstance(strategy, DDPStrategy) and strategy._ddp_kwargs == {"broadcast_buffers": False}
