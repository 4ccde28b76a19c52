"""Config values checked before anything heavy is imported or any run is opened.

Only omegaconf and the standard library are imported here, so the command line can run `validate` before
torch, Lightning and MLflow load. Every problem is a ConfigError: one line naming the setting and the fix.
`positive_int` is the one check of positive integer sizes (the model and the sparse layers use it too).
"""

from __future__ import annotations

import copy
import math
import numbers
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from xmc_repro.errors import ConfigError
from xmc_repro.resources import resource_dir

INT32_LIMIT = 2**31
SEED_MAX = 2**32 - 1  # numpy's seeds (np.random.seed, seed_everything) lie in [0, 2**32 - 1]
# What the uniform sparse op takes (xmc_repro.sparse.op; a test keeps these in step with it): tensors of these
# dtypes, and under autocast (`-mixed` precisions) 16-bit activations, which it computes in float32. A precision
# that would hand it 16-bit weights is refused up front instead of failing at the first forward.
SPARSE_OP_DTYPES = ("float32", "float64")
SPARSE_OP_AUTOCAST = True
_SPARSE_OP_HEADS = ("uniform", "mach")  # heads that run the uniform op (MACH decodes through it)
# Settings with named choices; the code that acts on them takes these tuples from here.
INITS = ("authors", "fan_in")  # model.init: the authors' Keras initialisation, or torch's nn.Linear bounds
REWIRE_SCHEDULES = ("authors", "multiples")  # model.rewire_schedule: after steps 1, N+1, ... or N, 2N, ...
MACH_DECODINGS = ("probability", "score")  # model.mach.decode (xmc_repro.mach)
BOTTLENECK_ACTIVATIONS = ("relu", "linear")  # model.bottleneck_activation: the authors' Dense(64, relu), or none
RESTORE_BEST = ("early_stop", "always")  # trainer.restore_best: when the best epoch's weights are tested
EPS_PLACEMENTS = ("keras", "torch")  # trainer.adam_eps_placement: Adam's epsilon before or after the bias correction
# The value a run's stored config implies when it predates the setting: how that run trained (and resumes).
BEFORE_THE_SETTING = {"restore_best": "always", "adam_eps_placement": "torch"}
# Their defaults now (conf/trainer/default.yaml; a test keeps the two equal).
DEFAULT_SINCE_THE_SETTING = {"restore_best": "early_stop", "adam_eps_placement": "keras"}
# Lightning's precisions (its short names too) and accelerators, refused here in one line rather than by Lightning
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "64-true", "bf16-true", "16-true", "32", "bf16", "16", "64")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
# Lightning strategies by name that the pipeline runs (trainer=ddp sets a DDPStrategy config); the spawning and
# forking ones failed to start their ranks, the sharding ones do not fit a sparse layer's int32 buffer.
STRATEGIES = ("auto", "ddp", "ddp_find_unused_parameters_false", "ddp_find_unused_parameters_true", "single_device")
DATASET_KINDS = ("synthetic", "xc", "npy")  # dataset.kind: generated, one XC text file per split, the authors' layout
NORMALIZATIONS = ("tfidf", "l2", "none")  # dataset.normalize of bag-of-words (XC text) features
# Settings that one kind's reader alone takes (xmc_repro.data.sources, .synthetic): set on another kind, ignored.
KIND_SETTINGS = {
    "xc": ("train_file", "test_file", "normalize"),
    "npy": ("train_labels", "test_labels", "train_features", "test_features", "feature_dim"),
    "synthetic": ("num_train", "num_test", "num_features", "num_labels", "latent_dim", "labels_per_point",
                  "zipf_exponent", "sign_flip", "latent_noise", "feature_noise", "data_seed", "chunk_size"),
}


def authors_unstructured_rewire_fraction(intermediate) -> float:
    """The authors' rewiring fraction of their unstructured layer: their run.py builds it without a selector when
    there is no intermediate layer ("sparse" architecture), so it keeps RewireLayer's default 0.01; after an
    intermediate layer ("dense-sparse") it gets the task's 0.1, the fraction the paper states."""
    return 0.1 if intermediate else 0.01


# conf/model/unstructured.yaml's default: ${authors_unstructured_rewire_fraction:${.intermediate}}
OmegaConf.register_new_resolver("authors_unstructured_rewire_fraction", authors_unstructured_rewire_fraction,
                                replace=True)


def positive_int(value, setting: str, example: int | None = None) -> int:
    """`value` as an int if it is a positive integer (not a bool, not 2.5); ConfigError naming `setting` else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _is_int(value) or int(value) < 1:
        hint = f"; set e.g. {setting}={example}" if example is not None else ""
        raise ConfigError(f"{setting}={value!r} must be a positive integer{hint}")
    return int(value)


def choice(value, setting: str, choices: tuple[str, ...]) -> str:
    """`value` if it is one of `choices`; ConfigError naming `setting` and the choices else."""
    if value not in choices:
        raise ConfigError(f"{setting}={value!r} is unknown; choose one of {', '.join(choices)}")
    return value


def _is_int(value) -> bool:
    try:
        return float(value) == int(float(value)) and int(value) == float(value)
    except (TypeError, ValueError, OverflowError):
        return False


def implied_before(key: str, head: str | None):
    """What a run whose stored config lacks setting `key` (dotted: `trainer.adam_eps_placement`) trained with, as it
    resumes and as the report counts it; None where that is not known. An unstructured run from before
    `model.distinct_sources` had distinct positions."""
    section, _, name = key.partition(".")
    if section == "trainer" and name in BEFORE_THE_SETTING:
        return BEFORE_THE_SETTING[name]
    if key == "model.distinct_sources" and head == "unstructured":
        return True
    return None


def check_layer_sizes(in_features: int, out_features: int, connectivity: int) -> tuple[int, int, int]:
    """The sizes a sparse layer is built with (they come straight from the config and the data), as Python ints
    (in_features, out_features, connectivity): integers of any kind (numpy's too, as ``nn.Linear`` takes them).
    Messages name the layer's arguments and, for connectivity, the run's setting ``model.connectivity``."""
    for name, value in (("connectivity", connectivity), ("out_features", out_features),
                        ("in_features", in_features)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # 8.0 is a caller's mistake
            raise ConfigError(f"{name}={value!r} must be a positive integer")
        positive_int(int(value), name)
    in_features, out_features, connectivity = int(in_features), int(out_features), int(connectivity)
    if connectivity > in_features:
        raise ConfigError(
            f"connectivity={connectivity} exceeds the layer's {in_features} input features; set connectivity "
            f"(model.connectivity in a run) <= {in_features}, or use a dense layer (model=dense)")
    if connectivity * out_features >= INT32_LIMIT:
        raise ConfigError(
            f"connectivity * labels = {connectivity} * {out_features} >= 2**31 does not fit the int32 indices; "
            "lower connectivity (model.connectivity in a run)")
    return in_features, out_features, connectivity


def number(cfg: DictConfig, key: str, kind=float, low=None, high=None, low_open=False, high_open=False,
           fix: str = ""):
    """The setting `key` as `kind` (int or a finite float) within the given bounds; ConfigError otherwise."""
    value = OmegaConf.select(cfg, key)
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok and kind is int:
        ok = _is_int(value)
    if ok:
        value = kind(value)
        ok = math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        what = "an integer" if kind is int else "a finite number"
        if low is not None and high is not None:
            what += f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        elif low is not None:
            what += f" {'>' if low_open else '>='} {low}"
        raise ConfigError(f"{key}={OmegaConf.select(cfg, key)!r} must be {what}{'; ' + fix if fix else ''}")
    return value


def _optional_positive(cfg: DictConfig, key: str, fix: str) -> None:
    value = OmegaConf.select(cfg, key, default=None)
    if value is not None:
        number(cfg, key, int, low=1, fix=fix)


def _resolvable(cfg: DictConfig) -> None:
    """A `${...}` that cannot be resolved (`trainer.max_epochs=${dataset.max_epoch}`, an unset `${oc.env:VAR}`) would
    end in OmegaConf's traceback wherever the setting is first read."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as error:
        key = error.full_key or "a setting"
        reason = str(error.msg).strip().splitlines()[0].strip()  # then OmegaConf adds full_key, object_type
        null = re.search(r"node `([^`]+)` is not a container", reason)  # `model.mach=null`: its settings are read
        nulled = [path for path in _null_settings(OmegaConf.to_container(cfg, resolve=False))
                  if null and path.rpartition(".")[2] == null.group(1)]
        if nulled:
            raise ConfigError(f"{nulled[0]}=null, but {key} reads its settings; drop {nulled[0]}=null (or give "
                              f"{nulled[0]}.<setting>=... for the ones to change)") from None
        raise ConfigError(f"{key} cannot be resolved ({reason}); fix its ${{...}} reference or give the value itself "
                          "(python -m xmc_repro --cfg job shows the composed config)") from None


def _null_settings(node, prefix: str = "") -> list[str]:
    """The dotted paths of the settings set to null in a config's tree."""
    paths = []
    for key, value in node.items() if isinstance(node, dict) else ():
        path = f"{prefix}{key}"
        paths += [path] if value is None else _null_settings(value, path + ".")
    return paths


def _flag(cfg: DictConfig, key: str) -> None:
    """A true/false setting: any other value (`no`, `off`, `yes please`) would be read as true where it is used."""
    value = OmegaConf.select(cfg, key, default=False)  # absent (a run from before the setting): its default
    if isinstance(value, str) and value.lower() in ("true", "false"):  # `key="false"`, or `${oc.env:VAR}`: a string
        raise ConfigError(f"{key}={value!r} is a string, not true or false: write it unquoted (a variable: "
                          "${oc.decode:${oc.env:VAR}})")
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false")


def validate(cfg: DictConfig) -> None:
    """Settings that would otherwise fail deep inside training, or silently train something else."""
    _resolvable(cfg)
    for key in ("trainer.batch_size", "trainer.eval_batch_size", "trainer.max_epochs"):
        positive_int(OmegaConf.select(cfg, key), key)
    number(cfg, "seed", int, low=0, high=SEED_MAX, fix="numpy's seeds lie in [0, 2**32 - 1]")
    t = "trainer."
    # Above 1e37 Adam's first step, lr / (1 - beta_1), overflows float32: torch fails with a traceback.
    number(cfg, t + "lr", low=0, high=1e37, low_open=True, fix="e.g. trainer.lr=1e-3")
    number(cfg, t + "lr_factor", low=0, high=1, low_open=True, high_open=True,
           fix="the LR is multiplied by it on a plateau, e.g. trainer.lr_factor=0.5")
    number(cfg, t + "min_lr", low=0)
    number(cfg, t + "lr_patience", int, low=0)
    number(cfg, t + "lr_threshold", low=0)
    number(cfg, t + "early_stop_patience", int, low=0, fix="epochs without improvement before stopping")
    number(cfg, t + "early_stop_min_delta", low=0)
    for key, choices in (("restore_best", RESTORE_BEST), ("adam_eps_placement", EPS_PLACEMENTS)):
        choice(OmegaConf.select(cfg, t + key, default=BEFORE_THE_SETTING[key]), t + key, choices)
    _optional_positive(cfg, t + "shuffle_buffer", "or null for a uniform permutation every epoch")
    _optional_positive(cfg, t + "train_eval_max_points", "or null for every training point")
    number(cfg, t + "num_workers", int, low=0, fix="processes loading batches; 0 loads them in the training process")
    _devices(cfg)
    _limit_train_batches(cfg)
    choice(str(OmegaConf.select(cfg, t + "precision")), t + "precision", PRECISIONS)
    choice(str(OmegaConf.select(cfg, t + "accelerator")), t + "accelerator", ACCELERATORS)
    strategy = OmegaConf.select(cfg, t + "strategy")
    if not OmegaConf.is_dict(strategy) and str(strategy).lower() not in STRATEGIES:  # a dict: a `_target_` config
        raise ConfigError(f"trainer.strategy={strategy!r} is not one this pipeline runs; use trainer=ddp for several "
                          f"devices, or one of {', '.join(STRATEGIES)}")
    for key in (t + "progress_bar", t + "cuda_graph", t + "memory_report", "dataset.rewire_every_epoch",
                "model.distinct_sources", "model.rewire_exact_count"):
        _flag(cfg, key)
    _optional_positive(cfg, t + "checkpoint_every_n_steps", "or null for a checkpoint at every epoch end only")
    _optional_positive(cfg, t + "profile_steps", "or null for no profile")
    if OmegaConf.select(cfg, t + "cublas_workspace_mib", default=None) is not None:
        number(cfg, t + "cublas_workspace_mib", low=0, low_open=True, fix="in MiB, or null for torch's default")
    _optional_positive(cfg, "dataset.rewire_every_n_steps", "or null for no rewiring by steps")
    _needed_callbacks(cfg)
    _best_checkpoint(cfg)
    positive_int(OmegaConf.select(cfg, "callbacks.time.step_window", default=100), "callbacks.time.step_window",
                 example=100)
    _callback_wiring(cfg)
    number(cfg, "dataset.dropout", low=0, high=1, high_open=True)
    if OmegaConf.select(cfg, "dataset.holdout_fraction", default=None) is not None:
        number(cfg, "dataset.holdout_fraction", low=0, high=1, low_open=True, high_open=True,
               fix="the share of the training points that validate_on=holdout sets aside, e.g. 0.1")
    name = OmegaConf.select(cfg, "logger.experiment_name", default="default")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"logger.experiment_name={name!r} must be a non-empty name, e.g. logger.experiment_name=xmc")
    uri = OmegaConf.select(cfg, "logger.tracking_uri", default="sqlite:///mlruns.db")
    if not isinstance(uri, str) or not uri.strip():  # MLflow would take its own default store, Lightning ./mlruns
        raise ConfigError(f"logger.tracking_uri={uri!r} names no store (an empty MLFLOW_TRACKING_URI?); set it to "
                          "sqlite:///mlruns.db or an http://host:port tracking server, or unset MLFLOW_TRACKING_URI")
    if not cfg.get("resume"):  # a resumed run is its stored config, which no file fixes: it goes on as it started
        _names(cfg)
        _dataset_keys(cfg)
        _best_filename(cfg)
    _dataset(cfg)
    if cfg.validate_on not in ("test", "holdout"):
        raise ConfigError(f"validate_on={cfg.validate_on!r} must be 'test' (the authors' protocol) or 'holdout'")
    _model(cfg)


_WIRED = re.compile(r"\$\{(?:oc\.select:)?([\w.]+)")  # the setting a `${...}` (or `${oc.select:...,default}`) reads


def callback_wiring(name: str) -> dict[str, str]:
    """The settings of callback `name` that its file (conf/callbacks/<name>.yaml) wires to a run setting, with their
    `${...}` text: `{'patience': '${trainer.early_stop_patience}', ...}`; {} for a callback without a file."""
    path = resource_dir("conf") / "callbacks" / f"{name}.yaml"
    own = OmegaConf.to_container(OmegaConf.load(path), resolve=False).get(name) if path.is_file() else None
    return {key: text for key, text in (own or {}).items() if isinstance(text, str) and _WIRED.match(text)}


# The callbacks the run reads at its end (xmc_repro/train.py): removing one (~callbacks.time) failed the run after
# its training. rewiring and early_stop may go (a static sparse layer; every epoch trained).
NEEDED_CALLBACKS = {"memory": "its peak memory", "time": "its epoch and step times",
                    "best": "testing the best epoch's weights", "last": "the checkpoints a resume continues from"}


def _needed_callbacks(cfg: DictConfig) -> None:
    present = cfg.get("callbacks") or {}
    for name, why in NEEDED_CALLBACKS.items():
        if not OmegaConf.is_dict(present.get(name)):
            raise ConfigError(f"~callbacks.{name}: the run needs this callback for {why}; keep it (only "
                              "~callbacks.rewiring and ~callbacks.early_stop may be removed)")
    for name, node in present.items():  # `callbacks.early_stop=null` met a TypeError further on
        if not OmegaConf.is_dict(node):
            raise ConfigError(f"callbacks.{name}={'null' if node is None else node}: remove a callback with "
                              f"~callbacks.{name}")


# What the best checkpoint may watch: the metrics every epoch's validation logs (XMCClassifier.on_validation_epoch_end).
# Lightning finds another name missing only after the first epoch has trained, and fails the run with a traceback.
MONITORED = ("val/p_at_1", "val/p_at_3", "val/p_at_5")


def _best_checkpoint(cfg: DictConfig) -> None:
    best = (cfg.get("callbacks") or {}).get("best")
    monitor, mode = best.get("monitor"), best.get("mode")
    if monitor not in MONITORED:
        raise ConfigError(f"callbacks.best.monitor={monitor!r} is not a metric the run logs every epoch; choose one of "
                          f"{', '.join(MONITORED)}")
    choice(mode, "callbacks.best.mode", ("max", "min"))


def _best_filename(cfg: DictConfig) -> None:
    """The run's folder also holds last.ckpt, written every epoch: a best checkpoint of that name overwrote it, so a
    resume continued from the best epoch and the test read whichever was written last."""
    filename = cfg.callbacks.best.get("filename")
    if filename is not None and (str(filename) in ("last", "") or Path(str(filename)).name != str(filename)):
        raise ConfigError(f"callbacks.best.filename={filename!r} must name a file of its own in the run's checkpoint "
                          "folder (not last, the checkpoint resume= continues from; no folders); e.g. best")


# Names a run is named and reported by (run names, the summary's title, the report's columns): a file of one's own
# without one trained, then named its run "None" or failed as its MLflow run opened, blaming the store.
NAMES = {"dataset.name": "name: MyData", "dataset.features": "features: bow",
         "loss.name": "name: <the loss's file name>"}


def _names(cfg: DictConfig) -> None:
    for key, example in NAMES.items():
        value = OmegaConf.select(cfg, key, default=None)
        if not isinstance(value, str) or not value.strip():
            group = key.split(".")[0]
            raise ConfigError(f"{key}={value!r} must be a name (run names and the report name the run by it); add "
                              f"`{example}` to the {group}'s file (conf/{group}/<file>.yaml)")


def _callback_wiring(cfg: DictConfig) -> None:
    """A callback setting that its file wires to a run setting (`patience: ${trainer.early_stop_patience}`) but that
    the command line sets to another value: the run would train with it while MLflow records the wired setting, whose
    value is the one params show (wired callback settings are not logged: `tracking.run_params`). A resumed run's
    stored config holds the wired values resolved: equal, so accepted."""
    probe = None
    for name, node in (cfg.get("callbacks") or {}).items():
        for key, text in callback_wiring(name).items():
            source = _WIRED.match(text)
            if key not in node or OmegaConf.is_interpolation(node, key):
                continue
            if probe is None:  # the config with the file's wiring put back, to resolve it
                probe = copy.deepcopy(cfg)
                OmegaConf.set_struct(probe, False)
            probe.callbacks[name][key] = text
            if OmegaConf.select(probe, f"callbacks.{name}.{key}") != node[key]:
                raise ConfigError(f"callbacks.{name}.{key}={node[key]} would not be recorded: it is {source[1]}; set "
                                  f"{source[1]}={node[key]}")


def _dataset_keys(cfg: DictConfig) -> None:
    """A dataset file of one's own: a key no reader takes (`normalise: tfidf`) was ignored while MLflow recorded it as
    a param, and one without `rewire_every_n_steps` trained a sparse head that was never rewired."""
    from xmc_repro.cli import closest, declared_settings

    known = {key for key in declared_settings("dataset") if "." not in key} | {"chunk_size"}  # synthetic, undeclared
    for key in cfg.dataset:
        if key not in known:
            match = closest(str(key), known)
            hint = f"did you mean dataset.{match}?" if match else "python -m xmc_repro --cfg job shows a dataset's keys"
            raise ConfigError(f"dataset.{key} is not a setting any dataset reader takes ({hint}), so it would be "
                              "ignored; fix or remove it in the dataset's file (conf/dataset/<file>.yaml)")
    # `normalize: l2` in an npy dataset's file left its embeddings as they were, while MLflow recorded it.
    kind = cfg.dataset.get("kind")
    if kind in KIND_SETTINGS:
        for other, keys in KIND_SETTINGS.items():
            for key in keys:
                if other != kind and key in cfg.dataset and key not in KIND_SETTINGS[kind]:
                    raise ConfigError(f"dataset.{key} is read only for dataset.kind={other}, and this dataset is "
                                      f"kind={kind}, so it would be ignored; remove it from the dataset's file "
                                      "(conf/dataset/<file>.yaml) or its override")
    fraction = OmegaConf.select(cfg, "model.rewire_fraction", default=0)
    rewires = isinstance(fraction, (int, float)) and fraction > 0 and "rewiring" in (cfg.get("callbacks") or {})
    if rewires and "rewire_every_n_steps" not in cfg.dataset and not cfg.dataset.get("rewire_every_epoch"):
        raise ConfigError(f"dataset.rewire_every_n_steps is not set, so model.head={cfg.model.get('head')} would never "
                          "be rewired; add `rewire_every_n_steps: 1000` (the authors' interval) or `null` (no "
                          "rewiring) to the dataset's file")


def _dataset(cfg: DictConfig) -> None:
    """What the data sources would refuse after the run has opened (xmc_repro.data.sources, .synthetic)."""
    kind = choice(OmegaConf.select(cfg, "dataset.kind"), "dataset.kind", DATASET_KINDS)
    for key in ("A", "B"):  # B > 0 keeps a label without training points finite: (0 + B)^-A
        number(cfg, f"dataset.propensity.{key}", low=0, low_open=True,
               fix="Jain et al.'s constants: A=0.55 B=1.5, Amazon A=0.6 B=2.6, Wikipedia A=0.5 B=0.4")
    if kind == "synthetic":
        for key in ("num_train", "num_test", "num_features", "num_labels", "latent_dim", "chunk_size"):
            _optional_positive(cfg, f"dataset.{key}", "")
        if OmegaConf.select(cfg, "dataset.data_seed", default=None) is not None:
            number(cfg, "dataset.data_seed", int, low=0, high=SEED_MAX, fix="numpy's seeds lie in [0, 2**32 - 1]")
        if OmegaConf.select(cfg, "dataset.labels_per_point", default=None) is not None:
            number(cfg, "dataset.labels_per_point", low=1, fix="labels per point on average")
    if kind == "xc":
        for key in ("train_file", "test_file"):
            if not OmegaConf.select(cfg, f"dataset.{key}", default=None):
                raise ConfigError(f"dataset.{key} is not set; pass dataset.train_file=PATH dataset.test_file=PATH")
        choice(OmegaConf.select(cfg, "dataset.normalize", default="l2"), "dataset.normalize", NORMALIZATIONS)


def _devices(cfg: DictConfig) -> None:
    """A number of devices (-1: all), auto, or device ids as a list or a comma string ("0,1"), as Lightning takes."""
    value = OmegaConf.select(cfg, "trainer.devices")
    if OmegaConf.is_list(value):
        ids = list(value)
    elif isinstance(value, str) and "," in value:
        ids = [part for part in value.split(",") if part.strip()]
    else:
        ids = None
    if ids is not None:
        ok = bool(ids) and all(_is_int(i) and int(i) >= 0 and not isinstance(i, bool) for i in ids)
    else:
        count = not isinstance(value, bool) and _is_int(value) and (int(value) >= 1 or int(value) == -1)
        ok = value == "auto" or count
    if not ok:
        raise ConfigError(f"trainer.devices={value!r} must be a number of devices (-1 or auto: all), or device ids "
                          "such as [0,1]")


def _limit_train_batches(cfg: DictConfig) -> None:
    """null (all), a number of batches >= 1, or a fraction of the epoch in (0, 1]; 0 would train nothing."""
    key = "trainer.limit_train_batches"
    value = OmegaConf.select(cfg, key, default=None)
    if value is None:
        return
    if isinstance(value, float) and not _is_int(value):
        number(cfg, key, low=0, high=1, low_open=True, fix="a fraction of each epoch, or a number of batches")
    else:
        number(cfg, key, int, low=1, fix="a number of batches, a fraction of each epoch, or null for all")


def _head_target(head) -> str | None:
    """The class conf/model/<head>.yaml builds; None for a head this project does not define."""
    path = resource_dir("conf") / "model" / f"{head}.yaml"
    return OmegaConf.load(path).get("_target_") if isinstance(head, str) and path.is_file() else None


def _model(cfg: DictConfig) -> None:
    m = cfg.model
    target = _head_target(m.get("head"))  # `model.head` names what model=<head> builds; it does not choose it
    if target is not None and m.get("_target_") != target:
        raise ConfigError(f"model.head={m.head} names the class a head config builds, not a choice: this config builds "
                          f"{m.get('_target_')}; pick the head with model={m.head}")
    # 16.0 would build the layer, but be recorded as another configuration than 16
    if m.intermediate is not None and (isinstance(m.intermediate, float) or not (_is_int(m.intermediate)
                                                                                 and int(m.intermediate) > 0)):
        raise ConfigError(
            f"model.intermediate={m.intermediate} must be a positive layer size (an integer), or null for no "
            "intermediate layer"
        )
    number(cfg, "model.rewire_fraction", low=0, high=1, high_open=True)
    choice(m.get("init", "authors"), "model.init", INITS)
    choice(m.get("rewire_schedule", "authors"), "model.rewire_schedule", REWIRE_SCHEDULES)
    if m.get("head") == "bottleneck":
        choice(m.get("bottleneck_activation", "relu"), "model.bottleneck_activation", BOTTLENECK_ACTIVATIONS)
    if m.get("head") == "mach" and OmegaConf.select(m, "mach") is not None:
        choice(OmegaConf.select(m, "mach.decode", default="probability"), "model.mach.decode", MACH_DECODINGS)
    # Sizes a head's config sets (conf/model/<head>.yaml), checked before anything loads; one left null fails
    # when the head is built, with the same message.
    for key, example in (("connectivity", 32), ("bottleneck", 64), ("mach.num_hashes", 8), ("mach.num_buckets", 1024)):
        if OmegaConf.select(m, key.split(".")[0]) is not None:
            value = OmegaConf.select(m, key)
            if isinstance(value, float):  # a layer is built from ints; 8.0 would fail only once the run has opened
                raise ConfigError(f"model.{key}={value!r} must be a positive integer; set e.g. model.{key}={example}")
            positive_int(value, f"model.{key}", example=example)
    _precision(cfg)


def _precision(cfg: DictConfig) -> None:
    """A 16-bit precision that would hand the uniform op 16-bit tensors it does not take."""
    precision = str(OmegaConf.select(cfg, "trainer.precision", default="32-true"))
    if "16" not in precision or cfg.model.head not in _SPARSE_OP_HEADS:
        return
    dtype = "bfloat16" if "bf16" in precision else "float16"
    mixed = not precision.endswith("-true")  # "16" and "bf16" are Lightning's names for the mixed ones
    if dtype in SPARSE_OP_DTYPES or (mixed and SPARSE_OP_AUTOCAST):
        return
    what = f"{dtype} activations" if mixed else f"{dtype} weights"
    raise ConfigError(
        f"trainer.precision={precision}: the sparse op of model.head={cfg.model.head} would get {what}; it computes "
        f"in {' or '.join(SPARSE_OP_DTYPES)} only: use trainer.precision=bf16-mixed (16-bit activations, float32 "
        "weights) or 32-true"
    )
