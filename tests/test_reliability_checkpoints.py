"""Checkpoints from disk are distrusted: nothing in them runs, nothing malformed reaches the kernels, and a
failed write (a full disk) is one line that leaves no partial file and no stale failure on the resumed run.

One tiny real run (module fixture) provides a genuine checkpoint; the faults are made from copies of it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from test_reliability_common import cli, copy_store, make_store, runs, stderr_lines, tiny_config
from test_reliability_common import no_run_left_running  # noqa: F401  (autouse)
from xmc_repro import checkpoints
from xmc_repro.errors import ConfigError, StorageError


@pytest.fixture(scope="module")
def finished(finished_run):
    """(directory, run id) of a tiny finished run with its last.ckpt (conftest's, shared with other files)."""
    directory, run_id, _ = finished_run
    return directory, run_id


def _crashed_copy(finished, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the finished run's directory whose run looks crashed (FAILED): resumable."""
    from mlflow.tracking import MlflowClient

    source, run_id = finished
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns.db'}")
    client.set_terminated(run_id, "FAILED")
    return tmp_path, run_id


def _model(checkpoint: dict):
    from xmc_repro.model import XMCClassifier

    hp = checkpoint["hyper_parameters"]
    return XMCClassifier(**{k: v for k, v in hp.items() if k != "inv_propensity"})


def _corrupt(state: dict, how: str) -> None:
    weights = state["state_dict"]
    if how == "index_out_of_range":
        weights["head.indices"][3, 5] = 24  # in_features is 24: one past the end
    elif how == "negative_index":
        weights["head.indices"][0, 0] = -1
    elif how == "wrong_shape":
        weights["head.weight"] = weights["head.weight"][:, :-1].clone()
    elif how == "wrong_dtype":
        weights["head.indices"] = weights["head.indices"].long()
    elif how == "nan_weight":
        weights["head.weight"][2, 2] = float("nan")
    elif how == "missing_tensor":
        del weights["head.bias"]
    elif how == "other_sizes":  # same tensor shapes, another layer: 25 inputs
        weights["head._extra_state"][0] = 25
    elif how == "nan_adam_moment":
        next(iter(state["optimizer_states"][0]["state"].values()))["exp_avg"].view(-1)[0] = float("inf")


CORRUPTIONS = ["index_out_of_range", "negative_index", "wrong_shape", "wrong_dtype", "nan_weight",
               "missing_tensor", "other_sizes", "nan_adam_moment"]
MESSAGES = {"index_out_of_range": "head.indices holds values in [0, 24], outside [0, 24)",
            "negative_index": "head.indices holds values in [-1,", "wrong_shape": "head.weight is (8, 39)",
            "wrong_dtype": "head.indices is (8, 40) torch.int64, the model needs (8, 40) torch.int32",
            "nan_weight": "head.weight holds NaN or Inf", "missing_tensor": "missing head.bias",
            "other_sizes": "foreign checkpoint: head._extra_state holds the sizes [25, 40, 8], the model's are "
                           "[24, 40, 8]",
            "nan_adam_moment": "optimizer exp_avg of parameter"}


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupted_checkpoint_is_refused_before_the_kernels(finished, tmp_path, how, monkeypatch):
    directory, run_id = finished
    state = torch.load(directory / "checkpoints" / run_id / "last.ckpt", weights_only=True)
    model = _model(state)
    _corrupt(state, how)
    path = tmp_path / "bad.ckpt"
    torch.save(state, path)
    import xmc_repro.sparse.op as op

    def never(*args, **kwargs):
        raise AssertionError("a corrupted checkpoint reached the sparse op")

    monkeypatch.setattr(op, "uniform_sparse_linear", never)
    io = checkpoints.SafeCheckpointIO(model)
    with pytest.raises(ConfigError) as info:
        io.load_checkpoint(path)
    message = str(info.value)
    kind = "foreign" if how == "other_sizes" else "corrupted"
    assert message.startswith(f"{path}: {kind}") and MESSAGES[how] in message and "\n" not in message, message


def test_a_checkpoint_from_before_the_layers_saved_their_sizes_loads(finished, tmp_path):
    directory, run_id = finished
    state = torch.load(directory / "checkpoints" / run_id / "last.ckpt", weights_only=True)
    model = _model(state)
    sizes = state["state_dict"].pop("head._extra_state")
    assert sizes.tolist() == [24, 40, 8]
    path = tmp_path / "old.ckpt"
    torch.save(state, path)
    loaded = checkpoints.SafeCheckpointIO(model).load_checkpoint(path)
    model.load_state_dict(loaded["state_dict"])  # strict
    assert torch.equal(model.head.indices, state["state_dict"]["head.indices"])


def test_corrupted_checkpoint_through_the_command_line(finished, tmp_path):
    """resume=<corrupted last.ckpt>: exit 2, one error line, the run FAILED (the op once read out of bounds)."""
    directory, run_id = _crashed_copy(finished, tmp_path)
    last = directory / "checkpoints" / run_id / "last.ckpt"
    state = torch.load(last, weights_only=True)
    _corrupt(state, "index_out_of_range")
    torch.save(state, last)
    result = cli(directory, [f"resume={run_id}", "trainer.max_epochs=2"])
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in stderr_lines(result.stderr) if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "corrupted checkpoint: head.indices holds values in [0, 24], outside [0, 24)" in errors[0]
    (run,) = runs(directory)
    assert run.info.status == "FAILED" and run.data.tags["error"] == errors[0].removeprefix("error: ")


class _WritesAFile:
    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (Path.write_text, (self.target, "pwned"))


def test_checkpoint_that_would_run_code_is_refused_unloaded(finished, tmp_path):
    directory, run_id = finished
    state = torch.load(directory / "checkpoints" / run_id / "last.ckpt", weights_only=True)
    target = tmp_path / "written-by-the-checkpoint"
    state["xmc_repro"]["payload"] = _WritesAFile(target)
    path = tmp_path / "evil.ckpt"
    torch.save(state, path)
    for load in (checkpoints.read, checkpoints.load, lambda p: checkpoints.SafeCheckpointIO(None).load_checkpoint(p)):
        with pytest.raises(ConfigError, match=r"evil.ckpt: refused, the checkpoint would import .*pathlib.Path"):
            load(path)
    assert not target.exists()
    # and through the command line: one line, exit 2, nothing written, no run touched
    result = cli(tmp_path, [f"resume={path}"])
    assert result.returncode == 2 and stderr_lines(result.stderr)[-1].startswith(f"error: resume={path}: refused")
    assert len(stderr_lines(result.stderr)) == 1, result.stderr[-3000:]
    assert not target.exists()


def test_garbage_and_truncated_files_are_one_line(finished, tmp_path):
    directory, run_id = finished
    data = (directory / "checkpoints" / run_id / "last.ckpt").read_bytes()
    (tmp_path / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.ckpt").write_text("hello")
    for name in ("truncated.ckpt", "text.ckpt"):
        with pytest.raises(ConfigError, match=rf"{name}: not a readable checkpoint"):
            checkpoints.read(tmp_path / name)


def test_an_unreadable_last_checkpoint_names_the_runs_other_one(finished, tmp_path):
    """`resume=<run id>` with a truncated last.ckpt said to give a run id (it was one), not that best.ckpt is
    there to continue from."""
    directory, run_id = finished
    run_dir = tmp_path / run_id
    shutil.copytree(directory / "checkpoints" / run_id, run_dir)  # with its lock file: a run's folder
    data = (run_dir / "last.ckpt").read_bytes()
    (run_dir / "last.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError) as info:
        checkpoints.read(run_dir / "last.ckpt")
    assert str(info.value).endswith(f"; its folder also holds best.ckpt: continue from that checkpoint's epoch with "
                                    f"resume={run_dir / 'best.ckpt'}")
    assert checkpoints.read(run_dir / "best.ckpt")["run_id"] == run_id
    (run_dir / checkpoints.LOCK).unlink()  # a folder of downloads: its other checkpoint may be another run's
    with pytest.raises(ConfigError, match="; give a run id or a .ckpt file written by python -m xmc_repro$"):
        checkpoints.read(run_dir / "last.ckpt")


def test_a_flipped_bit_in_a_checkpoints_weights_is_refused(finished, tmp_path):
    """torch loads a tensor without checking the zip entry's CRC-32: the changed weights loaded silently."""
    import zipfile

    directory, run_id = finished
    path = tmp_path / "flipped.ckpt"
    shutil.copy(directory / "checkpoints" / run_id / "last.ckpt", path)
    with zipfile.ZipFile(path) as archive:
        weight = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size >= 64)
    data = bytearray(path.read_bytes())
    header = weight.header_offset  # its local header: 30 bytes, then its name and extra field (lengths at 26, 28)
    start = header + 30 + int.from_bytes(data[header + 26 : header + 28], "little") + int.from_bytes(
        data[header + 28 : header + 30], "little")
    data[start + 5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=rf"^resume={path}: corrupted checkpoint \(.*/data/\d+ fails its checksum\)"):
        checkpoints.read(path)


def test_full_disk_while_checkpointing(tmp_path):
    """ENOSPC: a StorageError in one line, the partial file removed, the previous checkpoint untouched."""
    previous = tmp_path / "last.ckpt"
    previous.write_bytes(b"previous")
    tmp = tmp_path / "last.ckpt.tmp"
    tmp.symlink_to("/dev/full")  # every write there fails with ENOSPC
    with pytest.raises(StorageError) as info:
        checkpoints.SafeCheckpointIO(None).save_checkpoint({"x": torch.zeros(100_000)}, tmp)
    message = str(info.value)
    assert "no space left on the device" in message and "resume=<run id>" in message and "\n" not in message
    assert not tmp.exists() and not tmp.is_symlink() and previous.read_bytes() == b"previous"
    previous.unlink()  # the run's first checkpoint: nothing to continue from
    tmp.symlink_to("/dev/full")
    with pytest.raises(StorageError, match=r"no checkpoint yet; free space on that disk, then start it again$"):
        checkpoints.SafeCheckpointIO(None).save_checkpoint({"x": torch.zeros(100_000)}, tmp)


def test_a_large_checkpoint_is_announced_before_its_seconds_of_writing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(checkpoints, "ANNOUNCED_BYTES", 5000)
    state = {"state_dict": {"w": torch.zeros(500)}, "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(500)}}}]}
    checkpoints.SafeCheckpointIO(None).save_checkpoint(state, tmp_path / "small.ckpt")  # 2,000 bytes a tensor
    assert capsys.readouterr().out == ""
    state["optimizer_states"][0]["state"][0]["exp_avg_sq"] = torch.zeros(250, dtype=torch.float64)
    checkpoints.SafeCheckpointIO(None).save_checkpoint(state, tmp_path / "large.ckpt")  # 6,000 bytes in all
    assert capsys.readouterr().out == f"writing checkpoint {tmp_path / 'large.ckpt'} (0.0 GiB)\n"
    assert torch.load(tmp_path / "large.ckpt")["optimizer_states"][0]["state"][0]["exp_avg_sq"].dtype == torch.float64


def test_disk_filling_up_mid_file_is_one_line(tmp_path, monkeypatch):
    """A disk that fills up after part of the file was written: torch's zip writer raises a RuntimeError while
    closing the archive, over the ENOSPC; still one StorageError line, and no partial file left."""
    import errno

    def save_until_full(obj, handle):
        handle.write(b"the first part")
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 144064 vs 143984")

    monkeypatch.setattr(torch, "save", save_until_full)
    tmp = tmp_path / "best.ckpt.tmp"
    with pytest.raises(StorageError, match=r"^cannot write checkpoint .*best.ckpt.tmp \(no space left on the device\)"):
        checkpoints.SafeCheckpointIO(None).save_checkpoint({}, tmp)
    assert not tmp.exists()
    monkeypatch.setattr(torch, "save", lambda obj, handle: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="^a bug$"):  # not a storage problem: not dressed up as one
        checkpoints.SafeCheckpointIO(None).save_checkpoint({}, tmp)
    assert not tmp.exists()


def test_ctrl_c_while_a_checkpoint_is_written_leaves_no_partial_file(tmp_path, monkeypatch):
    """Ctrl+C during the write (seconds for a large checkpoint) left `best.ckpt.tmp` or `last.ckpt.tmp`, as large as
    it had got, beside the run's checkpoints; where torch's zip writer failed again as it closed the archive, its
    RuntimeError hid the Ctrl+C: a traceback, exit status 1 and no word of resume=."""
    def save_until_ctrl_c(obj, handle):
        handle.write(b"the first part")
        raise KeyboardInterrupt

    def save_until_ctrl_c_then_fail_closing(obj, handle):
        try:
            save_until_ctrl_c(obj, handle)
        except KeyboardInterrupt:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 11712 vs 11606")

    tmp = tmp_path / "best.ckpt.tmp"
    for save in (save_until_ctrl_c, save_until_ctrl_c_then_fail_closing):
        monkeypatch.setattr(torch, "save", save)
        with pytest.raises(KeyboardInterrupt):
            checkpoints.SafeCheckpointIO(None).save_checkpoint({}, tmp)
        assert not tmp.exists()


def test_full_disk_through_the_command_line_then_resume(finished, tmp_path):
    """The resumed run's first checkpoint hits a full disk: exit 2, one line, FAILED with failed_at_step, no .tmp
    left; resumed again with space: FINISHED, and the old failure tags are gone."""
    directory, run_id = _crashed_copy(finished, tmp_path)
    folder = directory / "checkpoints" / run_id
    (folder / "last.ckpt.tmp").symlink_to("/dev/full")
    result = cli(directory, [f"resume={run_id}", "trainer.max_epochs=2"])
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in stderr_lines(result.stderr) if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "no space left on the device" in errors[0] and f"resume={run_id}" in errors[0], errors[0]
    assert not (folder / "last.ckpt.tmp").is_symlink() and not (folder / "last.ckpt.tmp").exists()
    (run,) = runs(directory)
    assert run.info.status == "FAILED" and "failed_at_step" in run.data.tags
    result = cli(directory, [f"resume={run_id}", "trainer.max_epochs=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(directory)
    assert run.info.status == "FINISHED"
    assert "failed_at_step" not in run.data.tags and "error" not in run.data.tags


def test_store_full_when_marking_failed_is_one_line(monkeypatch, tmp_path):
    """Writing FAILED itself fails (the store's disk is full too): one line saying so, no chained tracebacks."""
    import sqlite3

    from xmc_repro import train
    from xmc_repro.tracking import RunTracker

    monkeypatch.chdir(tmp_path)
    copy_store(make_store(tmp_path / "store"), tmp_path)

    def fit_fails(*args, **kwargs):
        raise OSError(28, "No space left on device")

    def finish_fails(self, *args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(train, "_fit_and_test", fit_fails)
    monkeypatch.setattr(RunTracker, "finish", finish_fails)
    cfg = tiny_config(tmp_path / "mlruns.db")
    with pytest.raises(StorageError) as info:
        train.run(cfg)
    error = info.value
    assert error.__suppress_context__ and error.__cause__ is None  # printed alone, not as a chain
    message = error.run_failure
    assert message.startswith("no space left on the device") and "\n" not in message
    assert "could not be marked FAILED (OperationalError: database or disk is full)" in message
    assert "resume=" in message
    # the run really is left RUNNING here (the store refused): resume closes it
    (run,) = runs(tmp_path)
    assert run.info.status == "RUNNING"
    from xmc_repro.resume import close_orphan

    assert "now marked FAILED" in close_orphan(cfg.logger.tracking_uri, run.info.run_id,
                                               tmp_path / "checkpoints" / run.info.run_id)
    (run,) = runs(tmp_path)
    assert run.info.status == "FAILED"


def test_best_checkpoint_reload_is_checked(finished, monkeypatch):
    """The end-of-run reload of best.ckpt goes through the same checks (never torch.load with pickle)."""
    import inspect

    from xmc_repro import train

    source = inspect.getsource(train)
    assert "weights_only=False" not in source and "checkpoints.load_checked(best, model" in source
    directory, run_id = finished
    best = directory / "checkpoints" / run_id / "best.ckpt"
    state = checkpoints.load(best, "best checkpoint")
    checkpoints.check_state(state, _model(state), best)
