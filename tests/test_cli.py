"""The command line as a user meets it: typos refused with a suggestion, a help that says what the tool does,
and a sweep whose MLflow runs read well (distinct names, every param once, the dataset recorded) while the
console prints one line per epoch and nothing a user cannot act on."""

from __future__ import annotations

import pytest

from test_reliability_common import cli, runs, stderr_lines

# One job trains 2 batches of one epoch on a tiny synthetic set.
TINIEST = [
    "dataset.num_train=64", "dataset.num_test=32", "dataset.num_features=16", "dataset.num_labels=24",
    "dataset.latent_dim=4", "model.connectivity=4", "trainer.batch_size=16", "trainer.max_epochs=1",
    "trainer.limit_train_batches=2", "trainer.train_eval_max_points=32", "trainer.progress_bar=false",
]


@pytest.mark.parametrize(
    "typo, line",
    [
        ("modle=uniform", "error: unknown setting 'modle'; did you mean 'model'?"),
        ("model.conectivity=16", "error: unknown setting 'model.conectivity'; did you mean 'model.connectivity'?"),
        ("experimnt=table1", "error: unknown setting 'experimnt'; did you mean 'experiment'?"),
    ],
)
def test_a_mistyped_key_gets_one_line_with_a_suggestion_and_exit_2(tmp_path, typo, line):
    result = cli(tmp_path, [typo], timeout=60)
    assert result.returncode == 2, result.stderr
    assert stderr_lines(result.stderr) == [line]
    assert "+" not in result.stderr  # never Hydra's hint to append the typo as a new key
    assert not runs(tmp_path)


@pytest.mark.parametrize("typo, line", [
    ("+modle=1", "error: unknown setting 'modle': '+' added it, but nothing reads it; did you mean 'model'?"),
    ("+trainer.max_epoch=3",
     "error: unknown setting 'trainer.max_epoch': '+' added it, but nothing reads it; did you mean 'trainer.max_epochs'?"),
])
def test_a_key_added_with_plus_that_nothing_reads_is_refused_before_any_run(tmp_path, typo, line):
    """Hydra takes `+key=value` for a key no config has; the run would ignore it without a word."""
    result = cli(tmp_path, [typo, *TINIEST], timeout=60)
    assert result.returncode == 2, result.stderr
    assert stderr_lines(result.stderr) == [line]
    assert not runs(tmp_path)


def test_keys_added_with_plus_that_some_config_declares_pass():
    from xmc_repro.cli import added_setting

    assert added_setting([
        "+trainer.num_nodes=2",       # declared by trainer=ddp, read by every trainer
        "++trainer.max_epochs=2",     # forced: an existing setting
        "+hydra.launcher.n_jobs=2",   # Hydra's own
        "+dataset.data_dir=/data",    # declared by the file-backed datasets
        "model=dense", "seed=3",
    ]) is None
    assert added_setting(["+model.intermediat=8", "+seeds=2"]).startswith("unknown setting 'model.intermediat'")
    assert "--cfg job" in added_setting(["+zzz.q=1"])


def test_a_callback_added_with_plus_and_its_class_passes():
    """Every key under `callbacks` is a callback the run builds: one added on the command line was refused as a key
    "nothing reads". Without its class, or under a near miss of a callback's name, it is still refused."""
    from xmc_repro.cli import added_setting

    assert added_setting(["+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor",
                          "+callbacks.lr.logging_interval=epoch"]) is None
    assert added_setting(["+callbacks.lr={_target_: lightning.pytorch.callbacks.LearningRateMonitor}"]) is None
    assert added_setting(["+callbacks.lr.logging_interval=epoch"]) == (
        "unknown setting 'callbacks.lr.logging_interval': '+' added it, but nothing reads it; a new callback needs its "
        "class too: +callbacks.lr._target_=package.module.Class")
    assert "did you mean 'callbacks.early_stop._target_'?" in added_setting(["+callbacks.erly_stop._target_=x.Y"])
    assert "did you mean 'callbacks.time.step_window'?" in added_setting(["+callbacks.time.step_windw=5"])


def test_a_sweeps_job_is_named_by_the_overrides_its_sweep_varies(tmp_path):
    """A failed job's line repeated every override of the sweep (every job's alike but one value), twice per failure
    with the sweep's last line: hundreds of characters before the reason."""
    from omegaconf import OmegaConf

    from xmc_repro.cli import swept_overrides

    job = ["dataset=bibtex", "+experiment/row=dense", "experiment=table1", "seed=1", "trainer.max_epochs=1"]
    hydra = OmegaConf.create({"runtime": {"cwd": str(tmp_path)}, "sweep": {"dir": "multirun/1"},
                              "overrides": {"task": job}})
    assert swept_overrides(hydra) == job  # no multirun.yaml (another sweeper): the whole command line
    (tmp_path / "multirun" / "1").mkdir(parents=True)
    OmegaConf.save({"hydra": {"sweeper": {"params": {"dataset": "bibtex,delicious", "+experiment/row": "dense,mach"}},
                              "overrides": {"task": ["experiment=table1", "seed=range(0,3)", "trainer.max_epochs=1"]}}},
                   tmp_path / "multirun" / "1" / "multirun.yaml")
    assert swept_overrides(hydra) == ["dataset=bibtex", "+experiment/row=dense", "seed=1"]
    OmegaConf.save({"hydra": {"sweeper": {"params": {"dataset": "bibtex,delicious", "+experiment/row": "dense,mach"}},
                              "overrides": {"task": ["experiment=table1", "dataset=bibtex", "seed=1"]}}},
                   tmp_path / "multirun" / "1" / "multirun.yaml")
    assert swept_overrides(hydra) == ["+experiment/row=dense"]  # the command line pins the preset's dataset


def test_a_key_without_any_close_match_lists_the_keys_there(tmp_path):
    result = cli(tmp_path, ["model.zzz=1"], timeout=60)
    assert result.returncode == 2
    [line] = stderr_lines(result.stderr)
    assert line.startswith("error: unknown setting 'model.zzz'; model has: head, ")
    assert {"connectivity", "intermediate", "rewire_fraction"} <= set(line.split("model has: ")[1].split(", "))


def test_a_mistyped_choice_gets_a_suggestion(tmp_path):
    result = cli(tmp_path, ["model=unifrom"], timeout=60)
    assert result.returncode == 2
    [line] = stderr_lines(result.stderr)
    assert "did you mean 'uniform'?" in line and "choose one of: bottleneck, dense" in line


def test_help_says_what_the_tool_does_and_lists_the_user_groups(tmp_path):
    result = cli(tmp_path, ["--help"], timeout=60)
    assert result.returncode == 0
    text = result.stdout
    assert "extreme multi-label classifier" in text and "MLflow run" in text
    for group in ("dataset", "model", "loss", "trainer", "experiment", "scale"):
        assert f"\n  {group} " in text
    assert "synthetic (default)" in text and "uniform (default)" in text
    assert "experiment/grid" not in text and "experiment/row" not in text and "powered by Hydra" not in text


def test_a_sweep_of_20_runs_reads_well_in_mlflow_and_on_the_console(tmp_path):
    sweep = ["seed=0,1,2,3,4", "model=uniform,dense", "model.intermediate=null,8"]
    result = cli(tmp_path, [*TINIEST, *sweep], multirun=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = runs(tmp_path)
    assert len(found) == 20 and {r.info.status for r in found} == {"FINISHED"}

    names = [r.info.run_name for r in found]
    assert len(set(names)) == 20, names
    # Without the run-id piece at its end a name still tells the 20 configurations apart.
    assert len({name.rsplit(" ", 1)[0] for name in names}) == 20
    assert "Synthetic uniform-4 int-8 squared_hinge seed3" in {name.rsplit(" ", 1)[0] for name in names}

    for run in found:
        params = run.data.params
        # Each setting once, under its Hydra key: no Lightning copies such as `lr` beside `trainer/lr`.
        assert not {"lr", "connectivity", "head", "loss", "num_labels"} & set(params)
        assert {"trainer/lr", "model/connectivity", "model/head", "loss/name", "seed"} <= set(params)
        assert not {"table", "scale"} & set(params)  # tags, when set
        # Nor the callbacks' wiring, which repeats model/dataset/trainer settings, nor class paths; but the
        # callbacks in use and their own settings; the head's class and the loss's function are (a head or loss of
        # one's own may share a name).
        assert sorted(k for k in params if k.endswith(("_target_", "_partial_"))) == ["loss/_target_", "model/_target_"]
        assert {k for k in params if k.startswith("callbacks")} == {
            "callbacks", "callbacks/time/step_window", "callbacks/best/filename", "callbacks/best/monitor",
            "callbacks/best/mode", "callbacks/best/enable_version_counter"}
        assert params["callbacks"] == "rewiring,memory,time,early_stop,best,last"
        [data] = run.inputs.dataset_inputs
        assert data.dataset.name == "Synthetic" and len(data.dataset.digest) == 8
    assert len({r.inputs.dataset_inputs[0].dataset.digest for r in found}) == 1  # the same data in every job

    epoch_lines = [line for line in result.stdout.splitlines() if line.startswith("epoch 1/1  loss ")]
    assert len(epoch_lines) == 20 and all(" val P@1 " in line and "  lr " in line for line in epoch_lines)
    console = result.stdout + result.stderr
    assert "Tip" not in console and "logging interval" not in console and "LeafSpec" not in console
    assert "exists and is not empty" not in console  # the run's own checkpoint folder
    assert "[lightning" not in console  # Lightning's lines are not repeated through Hydra's logger
    assert console.count("/#/experiments/") == 20  # each summary links the runs table



def test_the_progress_bar_redraws_at_most_ten_times_a_second_and_at_an_epochs_end(monkeypatch):
    """A redraw costs as much host time as a GPU step: most batches of a fast epoch must not draw."""
    import types

    from lightning.pytorch.callbacks import RichProgressBar

    from xmc_repro import console

    drawn = []
    monkeypatch.setattr(RichProgressBar, "on_train_batch_end", lambda self, *args: drawn.append(args[-1]))
    clock = iter([0.0, 0.01, 0.05, 0.12, 0.15, 0.16, 0.17])
    monkeypatch.setattr(console.time, "monotonic", lambda: next(clock))
    bar, trainer = console.ProgressBar(), types.SimpleNamespace(num_training_batches=7)
    for batch_idx in range(7):
        bar.on_train_batch_end(trainer, None, None, None, batch_idx)
    assert drawn == [0, 3, 6]  # the first batch, 0.12 s later, and the last batch


def test_two_sweeps_started_in_one_second_get_folders_of_their_own(tmp_path):
    """Two sweeps started together (the README's split of table 1 over two GPUs) must not share a folder,
    where Hydra's files of one job would overwrite the other's, nor a `sweep_id`."""
    import re
    import subprocess

    from test_reliability_common import cli_env, command

    def folders_of_two_started_together() -> list[list[str]]:
        started = [subprocess.Popen(command(tmp_path, ["--cfg", "hydra", "--resolve"]), cwd=tmp_path, env=cli_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        printed = [process.communicate(timeout=120)[0] for process in started]
        return [sorted(line.split()[1] for line in text.splitlines() if line.strip().startswith("dir: "))
                for text in printed]

    for _ in range(4):  # until both start within one second, as a shell's `&` usually does
        first, second = folders_of_two_started_together()
        assert len(first) == len(second) == 2, (first, second)  # the run's folder and the sweep's
        if [re.sub(r"-\d{6}$", "", d) for d in first] == [re.sub(r"-\d{6}$", "", d) for d in second]:
            break
    else:
        pytest.skip("the two never started within one second")
    assert not set(first) & set(second), (first, second)


@pytest.mark.parametrize("override, line", [
    # Hydra said "mismatched input '.' expecting <EOF>": neither the override nor what to do
    ("dataset.train_file=data(1).txt", "error: cannot read the override 'dataset.train_file=data(1).txt' (mismatched "
     "input '.' expecting <EOF>); quote the value: 'dataset.train_file=\"data(1).txt\"'"),
    ("dataset.data_dir=dätä", "error: cannot read the override 'dataset.data_dir=dätä' ('ä' is not allowed there "
     "unquoted); quote the value: 'dataset.data_dir=\"dätä\"'"),
])
def test_an_override_hydra_cannot_read_is_named_with_how_to_quote_it(tmp_path, override, line):
    result = cli(tmp_path, [override], timeout=60)
    assert result.returncode == 2, result.stderr
    assert stderr_lines(result.stderr) == [line]


def test_a_quoted_home_folder_is_expanded(tmp_path, monkeypatch):
    """`~` reaches the program only quoted (Hydra's grammar refuses it bare), so the shell did not expand it."""
    from xmc_repro.data.sources import absolute

    monkeypatch.setenv("HOME", str(tmp_path))
    assert absolute("~/data/train.txt") == tmp_path / "data" / "train.txt"


@pytest.mark.parametrize("flags", [["--cfg", "job"], ["--resolve"]])
def test_hydra_flags_combined_wrongly_get_one_line(tmp_path, flags):
    result = cli(tmp_path, flags, multirun=True, timeout=60)
    assert result.returncode == 2 and len(stderr_lines(result.stderr)) == 1, result.stderr
    assert stderr_lines(result.stderr)[0].startswith(("error: Only one of --run", "error: The --resolve flag"))


def test_a_key_for_an_empty_mapping_is_shown_with_its_plus():
    """sbatch's `additional_parameters` starts empty: Hydra takes its keys only with `+` (the line said to look
    the setting up in --cfg job, where it is not)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from xmc_repro.cli import unknown_setting
    from xmc_repro.resources import resource_dir

    override = "hydra.launcher.additional_parameters={mail-type: END}"
    with initialize_config_dir(str(resource_dir("conf")), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as caught:
            compose("config", ["hydra/launcher=submitit_slurm", override], return_hydra_config=True)
    assert unknown_setting(caught.value) == (
        "unknown setting 'hydra.launcher.additional_parameters.mail-type'; hydra.launcher.additional_parameters "
        f"starts empty: add to it with '+{override}'")


def test_a_setting_of_another_choice_of_its_group_names_that_choice_not_a_plus():
    """`model.mach.num_hashes=4` under the default model=uniform: `+model.mach.num_hashes=4`, which the line
    suggested, trains the uniform head and reads nothing of it."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from xmc_repro.cli import unknown_setting
    from xmc_repro.resources import resource_dir

    with initialize_config_dir(str(resource_dir("conf")), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as caught:
            compose("config", ["model.mach.num_hashes=4"])
    assert unknown_setting(caught.value) == (
        "unknown setting 'model.mach.num_hashes'; it is a setting of model=mach only: choose it (in a sweep of other "
        "choices too, sweep it on its own)")
    # `resume=<a mach run> model.mach.num_hashes=4`: composed with the defaults before the run's own choices load
    assert unknown_setting(caught.value, resuming=True) == (
        "unknown setting 'model.mach.num_hashes'; a resumed run keeps its settings: drop model.mach.num_hashes=...")


def test_lightnings_ddp_advice_that_the_pipeline_follows_on_purpose_is_not_shown(monkeypatch):
    """Under trainer=ddp every rank printed Lightning's deprecation of broadcast_buffers (its successor is not in
    torch 2.11) and its advice to sync the metrics rank 0 logs alone on purpose."""
    import warnings

    from xmc_repro import console

    monkeypatch.setattr(warnings, "filters", list(warnings.filters))  # put back after the test
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    console.quiet()
    with warnings.catch_warnings(record=True) as shown:
        for message in ("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead.",
                        "It is recommended to use `self.log('epoch_time_s', ..., sync_dist=True)` when logging on "
                        "epoch level in distributed setting to accumulate the metric across devices.",
                        "It is recommended to use `self.log('train/loss_epoch', ..., sync_dist=True)` when ...",
                        "It is recommended to use `self.log('val/p_at_3', ..., sync_dist=True)` when ..."):
            warnings.warn(message, UserWarning)
    assert [str(w.message) for w in shown] == ["It is recommended to use `self.log('val/p_at_3', ..., sync_dist=True)` "
                                               "when ..."]
