"""What configuration a run is, and which of the paper's rows it reproduces.

A run's *configuration* is read from its flattened config (MLflow params such as `model/head`) and tags
(`table`, `scale`); seeds are not part of it, they are what the export averages over. Other training settings
(`SETTINGS`: init, learning rate, dropout, ...) join it where runs of one configuration differ in them. The
paper names rows by (dataset, features, setup, connectivity, intermediate, loss); `paper_key` translates a
configuration into that name, so that published and measured values can stand side by side.
"""

from __future__ import annotations

import yaml

from xmc_repro.resources import resource_dir
from xmc_repro.validation import DEFAULT_SINCE_THE_SETTING, implied_before

# The paper's datasets and feature sets -> our config of it (conf/dataset/<name>.yaml), which also names figures.
# Our configs carry the paper's names (`dataset.name`, `dataset.features`); the smoke scale's stand-ins
# (conf/dataset/smoke_*.yaml) are named `Smoke-<the paper's name>` with the features they stand in for.
PAPER_DATASETS = {
    ("Wiki10-31K", "cascade"): "wiki10_31k",
    ("Amazon-670K", "slice"): "amazon670k_slice",
    ("Amazon-670K", "cascade"): "amazon670k_cascade",
    ("Wikipedia-500K", "slice"): "wikipedia500k_slice",
    ("Wikipedia-500K", "cascade"): "wikipedia500k_cascade",
}
SMOKE_PREFIX = "Smoke-"
# The paper lists a dense layer's connectivity as its input size: the feature dimension.
FEATURE_DIMS = {"slice": "512", "cascade": "768"}

# The smoke scale keeps the grid's shape with every intermediate layer 128 times narrower
# (conf/experiment/grid/*_smoke.yaml): 64 stands for 8k, 128 for 16k, ..., 781 for 100k.
SMOKE_WIDTH_DIVISOR = 128
PAPER_WIDTHS = (8192, 16384, 32768, 65536, 100000)

# Columns that name a configuration, in runs.csv and the rendered tables.
CONFIG_COLUMNS = (
    "table", "scale", "dataset", "features", "setup", "connectivity", "intermediate", "bottleneck", "mach_hashes",
    "mach_buckets", "loss", "precision", "settings",
)  # fmt: skip
# Tables whose runs use the project's default settings (the paper's presets and the claims sweep): there a run
# whose settings differ from an earlier one's is a rerun after the defaults changed, and replaces it.
DEFAULT_SETTINGS_TABLES = ("claims", "table1", "table2", "table3", "table4", "table5")
# Settings that change what a run trains or measures besides the columns above (shown by `setting_name`). In other
# tables (`differences` changes one at a time), where runs of one configuration differ in some of them, the
# `settings` column gives each run's values of those, so that such runs are never averaged as seeds of one
# another or replace one another as reruns. Elsewhere the column stays empty, as in the expected grid.
SETTINGS = (
    "model/init", "model/distinct_sources", "model/rewire_exact_count", "model/rewire_fraction",
    "model/rewire_schedule", "model/bottleneck_activation", "model/mach/decode", "dataset/dropout",
    "dataset/normalize", "dataset/rewire_every_n_steps", "dataset/rewire_every_epoch", "trainer/max_epochs",
    "trainer/lr", "trainer/adam_eps", "trainer/adam_eps_placement", "trainer/batch_size", "trainer/lr_factor",
    "trainer/lr_patience", "trainer/lr_threshold", "trainer/min_lr", "trainer/early_stop_patience",
    "trainer/early_stop_min_delta", "trainer/restore_best", "trainer/shuffle_buffer", "trainer/limit_train_batches",
    "trainer/train_eval_max_points", "validate_on",
    # the callbacks in use (~callbacks.early_stop trains every epoch) and what chooses the tested epoch; runs from
    # before these were params differ from none in them
    "callbacks", "callbacks/best/monitor", "callbacks/best/mode",
)  # fmt: skip
# Of those, the settings of a head's own (rewiring: sparse heads only): the rest are what every head trains with, at
# which a row's dense reference (the "÷ dense" ratios) must have trained too.
HEAD_SETTINGS = (
    "model/distinct_sources", "model/rewire_exact_count", "model/rewire_fraction", "model/rewire_schedule",
    "model/bottleneck_activation", "model/mach/decode", "dataset/rewire_every_n_steps", "dataset/rewire_every_epoch",
)  # fmt: skip
SHARED_SETTINGS = tuple(key for key in SETTINGS if key not in HEAD_SETTINGS)
NO_SCALE = "none"  # a run tagged with a table but launched without a scale
# The heads the columns above describe; a head of one's own (README, "A new last layer") is told apart by its class
# (`model/_target_`, where logged) and its own settings, its `model/*` params other than those every head has (the
# keys of conf/model_common.yaml), in `setup`.
PAPER_HEADS = ("dense", "uniform", "unstructured", "bottleneck", "mach")
COMMON_MODEL_SETTINGS = tuple(yaml.safe_load((resource_dir("conf") / "model_common.yaml").read_text()))
# This project's losses: name -> function (conf/loss/bce.yaml, squared_hinge.yaml; a test keeps them equal), not
# every file in conf/loss/, where a loss of one's own goes too. A loss of that name with another function (a file of
# one's own), or a loss of one's own, names its function in the `loss` column; one whose record lacks it (runs from
# before `loss/_target_` was a param) is told apart by its name and settings alone, as then.
PROJECT_LOSSES = {"bce": "xmc_repro.losses.bce_loss", "squared_hinge": "xmc_repro.losses.squared_hinge_loss"}


def _value(params: dict, key: str) -> str:
    """A param by its Hydra key (logged as `model/head` or `model.head`), with null spelled as the empty string."""
    from xmc_repro.report.state import param

    return param(params, key) or ""


def configuration(params: dict, tags: dict) -> dict[str, str]:
    """The configuration of a run (or of a composed config flattened like MLflow params).

    Settings that do not apply to the head are blanked, so that e.g. a dense run's leftover
    `model.connectivity` does not split one configuration in two.
    """
    setup = _value(params, "model/head")
    if setup and setup not in PAPER_HEADS:
        setup = " ".join([setup, *_head_class(params), *(f"{key}={value}" for key, value in _own_settings(params))])
    return {
        "table": tags.get("table") or "",
        "scale": tags.get("scale") or NO_SCALE,
        "dataset": _value(params, "dataset/name"),
        "features": _value(params, "dataset/features"),
        "setup": setup,
        "connectivity": _value(params, "model/connectivity") if setup in ("uniform", "unstructured") else "",
        "intermediate": _value(params, "model/intermediate"),
        "bottleneck": _value(params, "model/bottleneck") if setup == "bottleneck" else "",
        "mach_hashes": _value(params, "model/mach/num_hashes") if setup == "mach" else "",
        "mach_buckets": _value(params, "model/mach/num_buckets") if setup == "mach" else "",
        # a loss of one's own at other settings (loss.margin=1,2) is another configuration, as a head's own are
        "loss": " ".join([_value(params, "loss/name"), *_loss_function(params),
                          *(f"{key}={value}" for key, value in _own_settings(params, "loss", ("name",)))]),
        # blank for float32, the default: a bf16-mixed run is another configuration, not another seed of it
        "precision": precision(_value(params, "trainer/precision")),
        "settings": "",  # see `split_by_settings`
    }


def _head_class(params: dict) -> list[str]:
    """`_target_=<class>` where the run logged the class of its head of one's own: two config files of one `head`
    name (in other folders) may build other classes. This project's heads need no such mark: a config naming one of
    them must build its class (validation). A record without the param (runs from before `model/_target_` was one)
    is told apart by the name and settings alone, as then."""
    target = _value(params, "model/_target_")
    return [f"_target_={target}"] if target else []


def _loss_function(params: dict) -> list[str]:
    """`_target_=<function>` where the run logged a loss function that is not this project's loss of its name."""
    target = _value(params, "loss/_target_")
    return [f"_target_={target}"] if target and target != PROJECT_LOSSES.get(_value(params, "loss/name")) else []


# Lightning's short precision names: the same training as the full ones, so the same configuration.
PRECISION_NAMES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}


def precision(value: str) -> str:
    """A run's precision by Lightning's full name; blank for float32, the default."""
    value = PRECISION_NAMES.get(value, value)
    return "" if value == "32-true" else value


def _own_settings(params: dict, of: str = "model", common=COMMON_MODEL_SETTINGS) -> list[tuple[str, str]]:
    """A head's own settings (`model/rank` as ("rank", "16")), or a loss's (`loss/margin`), by name. Not the keys
    every one has (`common`), nor `_target_`/`_partial_` (in records from before they were left out of params)."""
    own = {}
    for key in params:
        group, separator, name = key.replace(".", "/").partition("/")
        if group == of and separator and name.split("/")[0] not in common and not name.startswith("_"):
            own[name.replace("/", "_")] = _value(params, key.replace(".", "/")) or "null"
    return sorted(own.items())


def setting_name(key: str) -> str:
    """A setting's name in the `settings` column: its param key without the group (`model/mach/decode`: mach_decode)."""
    return key.split("/", 1)[-1].replace("/", "_")


def split_by_settings(configs: list[dict], params: list[dict]) -> None:
    """Fill the `settings` of each run's configuration (``configs[i]`` is the run with ``params[i]``) outside the
    `DEFAULT_SETTINGS_TABLES`: the values of the `SETTINGS` in which runs of the same configuration differ. A run
    that does not log a setting (it predates it) counts with the value it trained with where that is known
    (`validation.implied_before`); where it is not, it differs from none in it, and shows `?` where others differ."""
    groups: dict[tuple, list[int]] = {}
    for i, config in enumerate(configs):
        if config["table"] not in DEFAULT_SETTINGS_TABLES:
            groups.setdefault(config_key(config), []).append(i)
    for members in groups.values():
        differ = [key for key in SETTINGS if len({trained_with(params[i], key) for i in members} - {""}) > 1]
        for i in members:
            configs[i]["settings"] = "; ".join(f"{setting_name(key)}={_setting(params[i], key)}" for key in differ)


def trained_with(params: dict, key: str) -> str:
    """A run's value of a setting; for a run that predates it, the value it trained with where that is known (a
    run from before `trainer.adam_eps_placement` differs from later runs with the default, keras), else ''."""
    if key in params or key.replace("/", ".") in params:
        # a logged null (`trainer.shuffle_buffer=null`, "None") is a value: '' would count the run as not knowing it
        return _value(params, key) or "null"
    implied = implied_before(key.replace("/", "."), _value(params, "model/head"))
    return "" if implied is None else str(implied)


def at_defaults(settings: str) -> bool:
    """Whether a `settings` value describes a run with today's default settings: empty, or naming only settings that
    older runs of its configuration predate, each at its default now (`adam_eps_placement=keras`)."""
    pairs = [item.split("=", 1) for item in settings.split("; ") if item]
    return all(DEFAULT_SINCE_THE_SETTING.get(name) == value for name, value in pairs)


def _setting(params: dict, key: str) -> str:
    return trained_with(params, key) or "?"


def config_key(config: dict) -> tuple[str, ...]:
    return tuple(str(config.get(column, "")) for column in CONFIG_COLUMNS)


def paper_dataset(dataset: str, features: str) -> tuple[str, str] | None:
    """(paper dataset, features) that one of our datasets is, or stands in for; None if the paper has none."""
    paper = (dataset.removeprefix(SMOKE_PREFIX), features)
    return paper if paper in PAPER_DATASETS else None


def paper_width(width: str, scale: str) -> str:
    """The paper's intermediate size that our `width` at `scale` corresponds to."""
    if not width or scale != "smoke":
        return width
    for paper in PAPER_WIDTHS:
        if round(paper / SMOKE_WIDTH_DIVISOR) == int(width):
            return str(paper)
    return width


def paper_key(config: dict) -> tuple[str, ...] | None:
    """The paper's name for this configuration's row: (dataset, features, setup, connectivity, intermediate, loss).

    None when the paper has no such dataset. The paper writes a bottleneck of size b as connectivity b and
    intermediate b, and a dense layer's connectivity as the input size.
    """
    paper = paper_dataset(config["dataset"], config["features"])
    if paper is None:
        return None
    dataset, features = paper
    setup, intermediate = config["setup"], paper_width(config["intermediate"], config["scale"])
    connectivity = config["connectivity"]
    if setup == "dense":
        connectivity = FEATURE_DIMS[features]
    elif setup == "bottleneck":
        connectivity = config["bottleneck"]
        intermediate = intermediate or config["bottleneck"]
    return (dataset, features, setup, connectivity, intermediate, config["loss"])


def describe(config: dict) -> str:
    """A short label of the architecture, e.g. `uniform 32 + 32768` or `mach 4x64`."""
    setup = config["setup"]
    label = setup
    if config.get("connectivity"):
        label += f" {config['connectivity']}"
    if setup == "bottleneck" and config.get("bottleneck"):
        label += f" {config['bottleneck']}"
    if setup == "mach":
        label += f" {config['mach_hashes']}x{config['mach_buckets']}"
    if config.get("intermediate"):
        label += f" + {config['intermediate']}"
    return label
