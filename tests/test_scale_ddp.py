"""DDP over 2 CPU processes (gloo) through Lightning: ranks agree after every rewiring, and the run equals one
process trained on the same global batches; plus the cross-rank check and the multirun/ddp launch rule."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from xmc_repro.callbacks import Rewiring
from xmc_repro.checkpoints import RandomStateKeptThroughSetup
from xmc_repro.data.datamodule import share_bounds
from xmc_repro.distributed import (
    RankDivergenceError,
    another_rank_stopped,
    assert_identical_across_ranks,
    fingerprint,
    launch_problem,
    launch_rank,
)
from xmc_repro.model import XMCClassifier

N_TRAIN, N_VAL, FEATURES, LABELS = 96, 32, 24, 40
GLOBAL_BATCH = 16
REWIRE_EVERY = 3  # 12 steps in 2 epochs: 4 rewirings


def tiny_data(seed: int):
    """x (n, FEATURES) and 1-3 labels per row, as CSR lists."""
    g = torch.Generator().manual_seed(seed)
    n = N_TRAIN + N_VAL
    x = torch.randn(n, FEATURES, generator=g)
    counts = torch.randint(1, 4, (n,), generator=g)
    label_ptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    label_idx = torch.cat([torch.randperm(LABELS, generator=g)[:c] for c in counts.tolist()])
    return x, label_ptr, label_idx


class TinyData(pl.LightningDataModule):
    """Global batches of GLOBAL_BATCH rows in order; under DDP each rank gets the inputs of every global batch, the
    labels of its share and the share's start, as from the pipeline's DataModule, so both runs step on the same
    points."""

    def __init__(self, data, n_train=N_TRAIN):
        super().__init__()
        self.data, self.n_train = data, n_train

    def _loader(self, rows, world=1, rank=0):
        batches = [rows[i : i + GLOBAL_BATCH] for i in range(0, len(rows), GLOBAL_BATCH)]
        if world > 1:
            batches = [(b, share_bounds(len(b), rank, world)) for b in batches]
        return DataLoader(batches, batch_size=None, shuffle=False, collate_fn=self.collate)

    def train_dataloader(self):
        return self._loader(list(range(self.n_train)), self.trainer.world_size, self.trainer.global_rank)

    def val_dataloader(self):
        return self._loader(list(range(N_TRAIN, N_TRAIN + N_VAL)))

    def collate(self, rows):
        rows, share = rows if isinstance(rows, tuple) else (rows, None)
        x, ptr, idx = self.data
        labels = [idx[ptr[r] : ptr[r + 1]] for r in (rows[slice(*share)] if share else rows)]
        lengths = torch.tensor([0] + [len(lab) for lab in labels])
        labels = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long)
        return (x[rows], lengths.cumsum(0), labels, *([share[0]] if share else []))


class Recorder(pl.Callback):
    """Saves each rank's sparse layer and optimizer state after fit, and probes the cross-rank check."""

    def __init__(self, folder):
        self.folder = folder
        self.epoch_losses = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.epoch_losses.append(pl_module.epoch_loss())  # every rank asks: under DDP, the mean over all ranks

    def on_train_end(self, trainer, pl_module):
        rank = trainer.global_rank
        probe = None
        try:  # ranks deliberately disagree: every rank must get the error, none may hang
            assert_identical_across_ranks({"probe": torch.tensor([rank])}, "a probe")
        except RankDivergenceError as error:
            probe = str(error)
        assert_identical_across_ranks({"agreed": torch.tensor([7])}, "a probe")  # agreement passes
        state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        rewiring = next(c for c in trainer.callbacks if isinstance(c, Rewiring))
        torch.save({"state": state, "rewirings": rewiring.rewirings, "world": trainer.world_size,
                    "steps": trainer.global_step, "probe": probe,
                    "epoch_losses": self.epoch_losses}, self.folder / f"rank{rank}.pt")


def train(model, data, devices: int, folder, rewiring=None, n_train=N_TRAIN, first_callbacks=()):
    pl.seed_everything(3, verbose=False)  # as the pipeline does: Lightning's DDP setup reseeds every rank with it
    torch.rand(7)  # as building the model does
    rewiring = rewiring or Rewiring(0.25, every_n_steps=REWIRE_EVERY, seed=5)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, max_epochs=2,
        strategy="ddp_fork" if devices > 1 else "auto",  # fork: the ranks reuse this process's imports
        use_distributed_sampler=False,  # as the pipeline: the data module shards each global batch
        callbacks=[*first_callbacks, rewiring, Recorder(folder), RandomStateKeptThroughSetup()],  # as train.py adds
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=TinyData(data, n_train))


@pytest.mark.parametrize("head, n_train", [
    ("uniform", N_TRAIN),  # global batches of 16: 8 points a rank
    ("uniform", N_TRAIN + 9),  # the last batch splits 5 / 4: each rank's loss counts as its share of the global batch
    ("uniform", N_TRAIN + 1),  # the last batch's one point goes to rank 0, rank 1's share is empty
    ("unstructured", N_TRAIN + 9),
])  # fmt: skip
def test_ddp_two_ranks_match_one_process(tmp_path, head, n_train):
    torch.manual_seed(0)
    # Dropout on: each rank draws the global batch's mask and keeps its share's rows, as one process would.
    model = XMCClassifier(FEATURES, LABELS, head=head, connectivity=4, intermediate=16, dropout=0.5)
    initial = model.head.indices.clone()
    data = tiny_data(1)
    (tmp_path / "single").mkdir()
    (tmp_path / "ddp").mkdir()
    train(copy.deepcopy(model), data, 1, tmp_path / "single", n_train=n_train)
    train(copy.deepcopy(model), data, 2, tmp_path / "ddp", n_train=n_train)

    single = torch.load(tmp_path / "single" / "rank0.pt")
    ranks = [torch.load(tmp_path / "ddp" / f"rank{r}.pt") for r in (0, 1)]
    steps = 2 * -(-n_train // GLOBAL_BATCH)  # every global batch is a step, the last one too
    assert single["rewirings"] >= 4 and single["steps"] == steps
    for rank in ranks:
        assert rank["world"] == 2 and rank["rewirings"] == single["rewirings"] and rank["steps"] == steps
        assert rank["probe"] is not None and "rank(s) [1]" in rank["probe"]
    assert single["probe"] is None  # one process: nothing to compare

    # The epoch's mean loss (MLflow's train/loss_epoch) is the one process's, on every rank.
    for rank in ranks:
        assert rank["epoch_losses"] == pytest.approx(single["epoch_losses"], rel=1e-5)
    # Every rank holds bit-identical connections and weights ...
    for key in ranks[0]["state"]:
        assert torch.equal(ranks[0]["state"][key], ranks[1]["state"][key]), key
    # ... which rewiring really changed, to exactly the single-process connections ...
    indices = ranks[0]["state"]["head.indices"]
    assert not torch.equal(indices, initial)
    assert torch.equal(indices, single["state"]["head.indices"])
    # ... and the trained weights equal the single-process run on the same global batches.
    for key, value in single["state"].items():
        if value.is_floating_point():
            torch.testing.assert_close(ranks[0]["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)


class RankSeededRewiring(Rewiring):
    """A broken setup: each rank draws new connections from its own seed."""

    def on_fit_start(self, trainer, pl_module):
        self.generator.manual_seed(100 + trainer.global_rank)


def test_ddp_rewiring_divergence_stops_every_rank(tmp_path):
    torch.manual_seed(0)
    model = XMCClassifier(FEATURES, LABELS, head="uniform", connectivity=4, dropout=0.0)
    with pytest.raises(Exception, match=r"after rewiring 1 \(step 1\) the ranks disagree.*head.indices"):
        train(model, tiny_data(2), 2, tmp_path, RankSeededRewiring(0.25, every_n_steps=REWIRE_EVERY))
    assert not list(tmp_path.glob("rank*.pt"))  # no rank trained on


class NanOnRank1(pl.Callback):
    """Rank 1 reads a NaN loss (as a GPU reads its buffered losses) at step 3 (`where="step"`) or at the first
    epoch's end; rank 0 reads none. Each rank writes down what stopped it."""

    def __init__(self, folder, where):
        self.folder, self.where = folder, where

    def on_train_start(self, trainer, pl_module):
        rank, step = trainer.global_rank, pl_module.training_step

        def training_step(*args, **kwargs):
            try:
                return step(*args, **kwargs)
            except Exception as error:
                self._write(rank, error)
                raise

        pl_module.training_step = training_step
        if rank == 1 and self.where == "step":
            add = pl_module._losses.add
            pl_module._losses.add = lambda loss, at, *rest, **kw: (float("nan"), at) if at == 3 else add(loss, at,
                                                                                                          *rest, **kw)

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.global_rank == 1:
            pl_module._losses.flush = lambda: (float("nan"), 5)
        try:
            pl_module.epoch_loss()  # the epoch's first collective, as the console's epoch line asks first
        except Exception as error:
            self._write(trainer.global_rank, error)
            raise

    def _write(self, rank, error):
        (self.folder / f"error{rank}.txt").write_text(f"{type(error).__name__}: {error}")


@pytest.mark.parametrize("where, step", [("step", 3), ("epoch", 5)])
def test_a_nan_loss_one_rank_reads_stops_every_rank_in_step(tmp_path, where, step):
    """Rank 1 raised alone, before the next collective (the gradients' all-reduce, the epoch loss's), and left rank
    0 waiting in it (on NCCL, for the process group's timeout); every rank now learns of it and stops."""
    torch.manual_seed(0)
    model = XMCClassifier(FEATURES, LABELS, head="uniform", connectivity=4, dropout=0.0)
    with pytest.raises(Exception, match="NonFiniteLossError"):
        train(model, tiny_data(2), 2, tmp_path, first_callbacks=[NanOnRank1(tmp_path, where)])
    assert (tmp_path / "error1.txt").read_text().startswith(f"NonFiniteLossError: the training loss is nan at step "
                                                            f"{step}")
    assert (tmp_path / "error0.txt").read_text().startswith(
        "NonFiniteLossError: the training loss is not finite on another DDP rank (by step")


@pytest.mark.parametrize("error, stopped", [
    (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"), True),
    (torch.distributed.DistNetworkError("Broken pipe"), True),  # rank 0's rendezvous store gone while rank 1 starts
    (torch.distributed.DistNetworkError("The server socket has failed to listen on any local network address. "
                                        "port: 29500, useIpv6: 0, code: -98, name: EADDRINUSE"), False),
    (torch.distributed.DistNetworkError("The client socket has timed out after 3000ms while trying to connect to "
                                        "(10.0.0.9, 29500)"), False),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (OSError("Connection reset by peer"), False),
])  # fmt: skip
def test_another_rank_stopping_is_told_from_a_failure_of_this_rank(error, stopped):
    assert another_rank_stopped(error) is stopped


def test_fingerprint_sees_every_bit():
    a = torch.randn(5, 7)
    b = a.clone()
    b.view(-1).view(torch.int32)[3] ^= 1  # one bit of one float
    assert fingerprint(a) == fingerprint(a.clone())
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(torch.zeros(2, 3, dtype=torch.int32)) != fingerprint(torch.zeros(3, 2, dtype=torch.int32))


def test_check_without_process_group_is_a_no_op():
    assert_identical_across_ranks({"x": torch.arange(3)}, "nothing")


def _trainer(**kw):
    base = {"accelerator": "cpu", "devices": 1, "strategy": "auto", "num_nodes": 1}
    return OmegaConf.create({**base, **kw})


DDP_TARGET = {"_target_": "lightning.pytorch.strategies.DDPStrategy", "broadcast_buffers": False}


@pytest.mark.parametrize(
    "trainer_cfg, multirun, env, refused",
    [
        (_trainer(devices=2, strategy="ddp"), True, {}, True),  # relaunch would rerun the sweep
        (_trainer(devices=2, strategy=DDP_TARGET), True, {}, True),
        (_trainer(devices=[0, 1], strategy="ddp"), True, {}, True),
        (_trainer(devices=1, num_nodes=2, strategy="ddp"), True, {}, True),
        (_trainer(devices=2, strategy="ddp"), False, {}, False),  # a single run relaunches itself fine
        (_trainer(devices=2, strategy="ddp_spawn"), True, {}, False),
        (_trainer(devices=2, strategy={**DDP_TARGET, "start_method": "spawn"}), True, {}, False),
        (_trainer(devices=1, strategy="ddp"), True, {}, False),
        (_trainer(devices=2, strategy="ddp"), True, {"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "xmc"}, False),
        (_trainer(devices=2, strategy="ddp"), True, {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "xmc"}, True),
        (_trainer(devices=2, strategy="ddp"), True, {"TORCHELASTIC_RUN_ID": "x"}, False),
    ],
)
def test_launch_problem(trainer_cfg, multirun, env, refused):
    problem = launch_problem(trainer_cfg, multirun=multirun, env=env)
    assert (problem is not None) == refused
    if refused:
        assert "trainer.devices=1" in problem and "tasks_per_node" in problem


@pytest.mark.parametrize(
    "env, rank",
    [
        ({}, 0),  # the process a user started
        ({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}, 1),  # started by Lightning's ddp launcher
        ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, None),  # first process of the second node: not rank 0
        ({"RANK": "3", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}, 3),  # torchrun
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_JOB_NAME": "xmc"}, 2),  # srun
        ({"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_JOB_NAME": "xmc"}, 0),
    ],
)
def test_launch_rank(env, rank):
    if rank is None:
        assert launch_rank(env) != 0
    else:
        assert launch_rank(env) == rank


# The command line under `trainer=ddp` on 2 CPU processes (Lightning's launcher re-runs this script as rank 1, with
# the environment): rank 1 gets a SIGTERM at one point (XMC_SIGTERM_AT), as a scheduler or `kill` would send it.
SIGTERM_RANK_1 = """
import os, signal, sys, time
where, rank = os.environ["XMC_SIGTERM_AT"], int(os.environ.get("LOCAL_RANK", "0"))
from xmc_repro.model import XMCClassifier
if where == "train" and rank == 1:  # in the middle of epoch 2, before the step's all-reduce
    batch_start = XMCClassifier.on_train_batch_start
    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == 30:
            os.kill(os.getpid(), signal.SIGTERM)
        return batch_start(self, batch, batch_idx)
    XMCClassifier.on_train_batch_start = on_train_batch_start
elif where == "validation" and rank == 1:  # at a validation batch of epoch 2
    validation_step = XMCClassifier.validation_step
    def step(self, batch, batch_idx, *args):
        if self.current_epoch == 1 and batch_idx == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return validation_step(self, batch, batch_idx, *args)
    XMCClassifier.validation_step = step
elif where == "after_fit":  # rank 1 dies of it while rank 0 still tests (for longer than Lightning's 5 s look)
    if rank == 1:
        from xmc_repro.callbacks import EpochTime
        EpochTime.on_fit_end = lambda self, trainer, module: os.kill(os.getpid(), signal.SIGTERM)
    else:
        evaluate = XMCClassifier.evaluate
        XMCClassifier.evaluate = lambda self, *a, **k: (time.sleep(6), evaluate(self, *a, **k))[1]
from xmc_repro.entry import main
main()  # sys.argv[0] stays this script: Lightning starts rank 1 with it
"""


@pytest.mark.slow
@pytest.mark.parametrize("where, status, rank_0_exit, step", [
    ("train", "FAILED", 143, 31),  # hung both ranks until the process group's timeout (30 min)
    ("validation", "FAILED", 143, 40),
    ("after_fit", "FINISHED", 0, None),  # Lightning's child-process observer SIGKILLed rank 0: the run stayed RUNNING
])  # fmt: skip
def test_sigterm_to_rank_1_stops_both_ranks_at_the_same_batch(tmp_path, where, status, rank_0_exit, step):
    """A SIGTERM to rank 1 alone stops both ranks where the ranks agree on it (the step or validation batch it came
    in), with one line each and exit 143; rank 0 marks the run FAILED, to be continued with resume=<id>. After rank
    1's last collective it only ends rank 1, and rank 0 finishes the run."""
    import os
    import signal
    import subprocess
    import sys

    from test_reliability_common import TINY, _USED, cli_env, runs, stderr_lines, tracking_uri

    (tmp_path / "sigterm_rank_1.py").write_text(SIGTERM_RANK_1)
    _USED.add(tmp_path)
    args = [*TINY, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "dataset.dropout=0",
            "trainer.max_epochs=3", f"logger.tracking_uri={tracking_uri(tmp_path)}"]
    process = subprocess.Popen([sys.executable, str(tmp_path / "sigterm_rank_1.py"), *args], cwd=tmp_path,
                               env=cli_env({"XMC_SIGTERM_AT": where}), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # rank 0 and rank 1 (same session)
        _, stderr = process.communicate()
        pytest.fail(f"the ranks hung after the SIGTERM: {stderr[-3000:]}")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # a rank left behind
        except ProcessLookupError:
            pass
    (run,) = runs(tmp_path)
    lines = [line for line in stderr_lines(stderr) if line.startswith("error: ")]
    assert process.returncode == rank_0_exit and run.info.status == status, stderr[-3000:]
    if status == "FINISHED":
        assert not lines and "test/p_at_1" in run.data.metrics, stderr[-3000:]
        return
    expected = f"error: interrupted (SIGTERM); continue it with resume={run.info.run_id}"
    assert sorted(lines) == [expected, "error: rank 1: interrupted (SIGTERM); rank 0 records the run"], stderr[-3000:]
    assert run.data.tags["error"] == expected.removeprefix("error: ")
    assert run.data.tags["failed_at_step"] == str(step)  # where rank 1 got it: both ranks stopped there
    assert (tmp_path / "checkpoints" / run.info.run_id / "last.ckpt").is_file()
