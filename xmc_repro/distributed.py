"""Running one experiment on several processes (Lightning DDP) and sweeps on many machines.

Two things a multi-process run needs beyond what Lightning does by itself:

* every rank must hold the same sparse connections: rewiring draws from a generator seeded identically on
  every rank and picks the lowest-|weight| slots of weights that DDP keeps identical, so the ranks agree by
  construction; `assert_identical_across_ranks` checks it after each rewiring (a silent divergence would
  train a different network on each rank while the gradients are still averaged);
* Lightning's `ddp` strategy starts the extra ranks by re-running the command line, which under a Hydra
  multirun (`-m`) would re-run the whole sweep in every rank: `launch_problem` names that case up front.
"""

from __future__ import annotations

import hashlib
import os
import threading

import torch

# Strategy names (or DDPStrategy start methods) whose extra ranks re-run this process's command line.
_RELAUNCHING = ("ddp", "popen")


# How gloo and NCCL report that the process on the other side of a collective has gone (crashed, killed, stopped).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited",
              "NCCL communicator was aborted")  # fmt: skip


def another_rank_stopped(error: BaseException) -> bool:
    """Whether `error` is a collective failing because another DDP rank stopped, or the rendezvous store (rank 0's)
    closing under a rank that is starting: that rank's line says why. Not a store this rank could not open or
    reach (a port in use, a wrong address): that is this rank's own failure."""
    if isinstance(error, torch.distributed.DistNetworkError):
        return "Broken pipe" in str(error) or "Connection reset by peer" in str(error)
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _PEER_GONE)


class RankDivergenceError(RuntimeError):
    """Ranks of one DDP run hold different values where they must be identical."""


def fingerprint(tensor: torch.Tensor) -> str:
    """A digest of a tensor's dtype, shape and exact bytes (device independent)."""
    data = tensor.detach().contiguous().cpu()
    digest = hashlib.sha1(f"{data.dtype}{tuple(data.shape)}".encode())
    digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def world_size() -> int:
    """Processes in the current torch.distributed group; 1 when there is none."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def assert_identical_across_ranks(tensors: dict[str, torch.Tensor], when: str) -> None:
    """Raise RankDivergenceError on every rank if any rank's `tensors` differ from rank 0's.

    A collective: every rank must call it at the same point with the same names. Without a process group
    (a single process) it does nothing.
    """
    if world_size() == 1:
        return
    mine = {name: fingerprint(t) for name, t in tensors.items()}
    gathered: list[dict[str, str] | None] = [None] * world_size()
    torch.distributed.all_gather_object(gathered, mine)
    reference = gathered[0]
    bad = {
        name: [rank for rank, theirs in enumerate(gathered) if theirs[name] != reference[name]]
        for name in reference
    }
    bad = {name: ranks for name, ranks in bad.items() if ranks}
    if bad:
        detail = "; ".join(f"{name} on rank(s) {ranks}" for name, ranks in bad.items())
        raise RankDivergenceError(
            f"after {when} the ranks disagree with rank 0: {detail}. Every rank must run the same code, seed and "
            "config (trainer.strategy with broadcast_buffers=false relies on it); rerun with identical settings"
        )


def _num_devices(accelerator, devices) -> int:
    """How many devices a `trainer.devices` setting asks for (int, list, "2", "auto" or -1)."""
    if isinstance(devices, (list, tuple)) or (hasattr(devices, "__len__") and not isinstance(devices, str)):
        return len(devices)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if devices in ("auto", -1):
        if str(accelerator) in ("cpu",):
            return 1
        return max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    return int(devices)


def _relaunches(strategy) -> bool:
    """Whether the strategy starts its extra ranks by re-running the command line."""
    if isinstance(strategy, str):
        return strategy.startswith("ddp") and "spawn" not in strategy and "fork" not in strategy
    if hasattr(strategy, "get"):  # a `_target_` config of DDPStrategy
        target = str(strategy.get("_target_", ""))
        return target.endswith("DDPStrategy") and strategy.get("start_method", "popen") in _RELAUNCHING
    return False


def processes_started_externally(env=None) -> bool:
    """True under srun (SLURM tasks) or torchrun: every rank is started by the cluster, none by Lightning."""
    env = os.environ if env is None else env
    slurm = int(env.get("SLURM_NTASKS", "1") or 1) > 1 and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")
    return slurm or "TORCHELASTIC_RUN_ID" in env


def launch_rank(env=None) -> int:
    """This process's global DDP rank as its launcher set it, before Lightning has ranked anything.

    torchrun sets RANK; srun sets SLURM_PROCID; Lightning's `ddp` launcher starts the extra ranks of a node with
    LOCAL_RANK >= 1 (and NODE_RANK on other nodes). The process a user started is rank 0: it alone opens the
    MLflow run.
    """
    env = os.environ if env is None else env
    if "RANK" in env:
        return int(env["RANK"])
    if processes_started_externally(env) and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"])
    local = int(env.get("LOCAL_RANK", "0") or 0)
    node = int(env.get("NODE_RANK", env.get("GROUP_RANK", "0")) or 0)
    return local if node == 0 else max(local, 1) + node  # any non-zero value: not the recording rank


def launch_problem(trainer_cfg, multirun: bool, env=None) -> str | None:
    """Why `trainer_cfg` cannot run in this launch (one line with the fix), or None if it can."""
    devices = _num_devices(trainer_cfg.get("accelerator", "auto"), trainer_cfg.get("devices", 1))
    nodes = int(trainer_cfg.get("num_nodes", 1) or 1)
    if not multirun or devices * nodes <= 1 or not _relaunches(trainer_cfg.get("strategy", "auto")):
        return None
    if processes_started_externally(env):
        return None
    return (
        f"trainer.strategy=ddp with {devices * nodes} devices re-runs this command once per extra device, which "
        "under -m would re-run the whole sweep; in a sweep use one device per job (trainer.devices=1), or "
        "hydra/launcher=submitit_slurm with hydra.launcher.tasks_per_node equal to trainer.devices"
    )


def stop_watching_other_ranks() -> None:
    """Rank 0 under Lightning's own launcher (`trainer=ddp` on one machine): from now on no other rank's exit may
    SIGKILL this process.

    Lightning's child-process observer (a thread of rank 0) SIGKILLs rank 0 within 5 s of any other rank exiting
    non-zero, so that rank 0 does not hang in a collective with a dead peer. Once rank 0 needs no collective any more
    (training ended, stopped or failed) that kill only cuts short what rank 0 still has to do (the final test, marking
    the run FAILED) and leaves the MLflow run RUNNING. The observer reads its list of ranks at every look: emptied, its
    next look ends it without a kill (lightning.fabric.strategies.launchers.subprocess_script._ChildProcessObserver).
    """
    for thread in threading.enumerate():
        if type(thread).__name__ == "_ChildProcessObserver":
            thread._child_processes = []
            thread._finished = True
