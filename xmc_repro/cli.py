"""The command line's own words: `--help`, and unknown settings refused with a suggestion.

Imports nothing heavy (no torch, lightning or mlflow), so that both answer within a second.
"""

from __future__ import annotations

import difflib
import re
import textwrap
from pathlib import Path

from omegaconf import OmegaConf

from xmc_repro.resources import resource_dir

# A file a sweep's jobs list the runs they open in, for the sweep's process (xmc_repro.resume.close_interrupted).
STARTED_RUNS_ENV = "XMC_STARTED_RUNS"

# The groups a user picks from (conf/<group>/); nested ones such as experiment/grid are the presets' internals.
GROUPS = {
    "dataset": "the data: synthetic (generated), the paper's datasets, any XC-format pair (xc)",
    "model": "the last layer (model.connectivity, model.intermediate=<units>|null, ...)",
    "loss": "the training loss",
    "trainer": "optimisation and hardware (trainer.max_epochs, trainer.batch_size, trainer.progress_bar, ...)",
    "logger": "where runs are recorded (logger.tracking_uri, logger.experiment_name)",
    "experiment": "a paper table's whole grid, run with -m (with scale=paper|smoke)",
    "scale": "the size of an experiment= grid: paper (real data, a GPU) or smoke (stand-ins, a CPU, minutes)",
}
SETTINGS = {
    "seed": "the training seed (the synthetic data has its own, dataset.data_seed)",
    "validate_on": "test (the authors' protocol: epochs chosen and stopped on test P@3) | holdout (a part of train)",
    "resume": "an MLflow run id or a checkpoint path: continue that run",
}

WIDTH = 105
HELP = """\
usage: python -m xmc_repro [group=choice ...] [key=value ...]
       python -m xmc_repro -m [key=a,b ...]     (a sweep: one run per combination)

Trains and tests one extreme multi-label classifier over fixed input embeddings -- dropout, an optional
dense ReLU layer, and a last layer that is dense, uniformly sparse (every label has `connectivity` inputs,
trained with prune-and-regrow rewiring; Schultheis & Babbar, ECML-PKDD 2023), unstructured sparse, a
bottleneck or MACH -- prints its test and train P@1/3/5, and records it as one MLflow run.

Groups (default first):
{groups}

Settings:
{settings}

Examples:
  python -m xmc_repro model=dense trainer.max_epochs=3
  python -m xmc_repro dataset=bibtex model.intermediate=1024 loss=bce
  python -m xmc_repro -m model=uniform,dense seed=0,1,2
  python -m xmc_repro -m experiment=table1 scale=smoke
  python -m xmc_repro --cfg job        every setting and its value (add overrides to see their effect)
  mlflow ui --backend-store-uri sqlite:///mlruns.db    then open the runs table the run's summary links to

Hydra's own options (launchers, --multirun, --cfg, ...): python -m xmc_repro --hydra-help
"""


def _defaults() -> dict[str, str]:
    """Each group's default choice, from conf/config.yaml's defaults list."""
    config = OmegaConf.load(resource_dir("conf") / "config.yaml")
    chosen = {}
    for entry in config.get("defaults", []):
        if OmegaConf.is_dict(entry):
            chosen.update({str(k): str(v) for k, v in entry.items()})
    return chosen


def choices(group: str) -> list[str]:
    return sorted(path.stem for path in (resource_dir("conf") / group).glob("*.yaml"))


def help_text() -> str:
    defaults = _defaults()
    lines = []
    for group, what in GROUPS.items():
        options = choices(group)
        default = defaults.get(group)
        if default in options:
            options = [f"{default} (default)"] + [o for o in options if o != default]
        lines.append(f"  {group:<11} {what}")
        lines += textwrap.wrap(", ".join(options), WIDTH, initial_indent=" " * 14, subsequent_indent=" " * 14)
    settings = [f"  {key:<11} {what}" for key, what in SETTINGS.items()]
    return HELP.format(groups="\n".join(lines), settings="\n".join(settings))


def closest(word: str, candidates) -> str | None:
    """The candidate `word` is most likely a typo of, if any is close."""
    close = difflib.get_close_matches(word, [str(c) for c in candidates], n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_setting(error: BaseException, resuming: bool = False) -> str | None:
    """One line for Hydra's "Could not override 'modle'" (an OmegaConf key error underneath); None otherwise.
    `resuming`: the command line has `resume=` (composed with the defaults, the run's own choices come later)."""
    cause = error.__cause__
    full_key = getattr(cause, "full_key", None)
    parent = getattr(cause, "parent_node", None)
    if not str(error).startswith("Could not override") or not full_key or parent is None:
        return None
    prefix = full_key.rpartition(".")[0]
    known = [str(k) for k in parent.keys()] if OmegaConf.is_dict(parent) else []
    if not prefix:  # top level: the config groups count too (`experiment` is not in the config until chosen)
        known = [k for k in known if k != "hydra"] + [g for g in GROUPS if g not in known]
    match = closest(full_key.rsplit(".", 1)[-1], known)
    if match:
        hint = f"did you mean '{prefix + '.' if prefix else ''}{match}'?"
    elif known:
        hint = f"{prefix or 'the top level'} has: {', '.join(known)}"
    elif (owner := _choice_declaring(full_key)) and resuming:  # `resume=<a mach run> model.mach.num_buckets=8`
        hint = f"a resumed run keeps its settings: drop {full_key}=..."
    elif owner:  # `model.mach.num_hashes=4` under model=uniform (`+` adds it unread)
        # In a sweep over the group (`-m model=dense,mach model.mach.num_buckets=8`) the other choice's job fails.
        hint = f"it is a setting of {owner} only: choose it (in a sweep of other choices too, sweep it on its own)"
    elif prefix.startswith("hydra.") and "use +" in str(error):  # an empty mapping (sbatch's additional_parameters)
        hint = f"{prefix} starts empty: add to it with '{str(error).rpartition('use ')[2].strip()}'"
    else:
        hint = "python -m xmc_repro --cfg job lists every setting"
    return f"unknown setting '{full_key}'; {hint}"


_PLAIN_KEY = re.compile(r"[+~]{0,2}[\w.@/-]+=")  # an override's `key=` (`+key=`, `group@pkg=`)
_LEXER = "LexerNoViableAltException: "


def unreadable_override(error: BaseException) -> str | None:
    """One line for an override Hydra's grammar cannot read (`dataset.train_file=data(1).txt`, a non-ASCII letter, a
    `~`): Hydra's own text may not name the override, and points into it with a caret on a line of its own."""
    override, message = getattr(error, "override", None), getattr(error, "message", None)
    if not isinstance(override, str) or not isinstance(message, str):
        return None
    lines = [line for line in message.splitlines() if line.strip() and not line.startswith("See https://")]
    if len(lines) > 1 and lines[0].startswith(_LEXER) and lines[1].strip() == "^":
        at = len(lines[1].rstrip()) - 1 - len(_LEXER)  # the caret's column in the override
        shown = repr(override[at]) if 0 <= at < len(override) else "a character"
        reason = f"{shown} is not allowed there unquoted"
    else:
        reason = "; ".join(line.strip() for line in lines if not line.startswith("Error parsing override"))
        at = None
    key, equals, value = override.partition("=")
    if not equals:
        fix = "write it as key=value"
    elif at is not None and at < len(key):
        fix = "fix the setting's name (python -m xmc_repro --cfg job lists every setting)"
    elif _PLAIN_KEY.match(override) and '"' not in value:
        fix = f"quote the value: '{key}=\"{value}\"'"
    else:
        fix = "quote the value (https://hydra.cc/docs/1.2/advanced/override_grammar/basic)"
    return f"cannot read the override '{override}' ({reason}); {fix}"


def _declared(node, prefix: str = "") -> set[str]:
    """The dotted paths of every key in a config file's tree (its `defaults` list aside)."""
    keys = set()
    for key, value in (node.items() if isinstance(node, dict) else ()):
        if key != "defaults":
            keys.add(prefix + str(key))
            keys |= _declared(value, f"{prefix}{key}.")
    return keys


def _choice_declaring(key: str) -> str | None:
    """The group choice (`model=mach`) whose file declares `key` (`model.mach.num_hashes`), if one does."""
    group, _, rest = key.partition(".")
    folder = resource_dir("conf") / group
    for path in sorted(folder.glob("*.yaml")) if rest and folder.is_dir() else ():
        if rest in _declared(OmegaConf.to_container(OmegaConf.load(path), resolve=False)):
            return f"{group}={path.stem}"
    return None


def declared_settings(group: str | None) -> set[str]:
    """Every setting a file of `group` (conf/<group>/*.yaml; None: conf/config.yaml) declares, relative to the group:
    the union over the group's options, so a key of one option (trainer.num_nodes of trainer=ddp) counts."""
    conf = resource_dir("conf")
    files = [conf / "config.yaml"] if group is None else [*(conf / group).glob("*.yaml")]
    if group == "model":
        files.append(conf / "model_common.yaml")  # `# @package model`
    keys = set()
    for path in files:
        keys |= _declared(OmegaConf.to_container(OmegaConf.load(path), resolve=False))
    return keys


def added_setting(overrides: list[str]) -> str | None:
    """One line for an override that adds a setting no config file declares (`+modle=1`, `+trainer.max_epoch=3`):
    Hydra accepts it and nothing reads it, so the run would quietly ignore the typo. None when all are declared.
    Config groups chosen with `+` and Hydra's own keys (`+hydra.launcher....`) pass."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    conf = resource_dir("conf")
    parsed = OverridesParser.create().parse_overrides(overrides)
    for override in parsed:
        key = override.key_or_group
        if override.type not in (OverrideType.ADD, OverrideType.FORCE_ADD) or override.package is not None:
            continue
        top, _, rest = key.partition(".")
        if top == "hydra" or "/" in key or (not rest and (conf / top).is_dir()):
            continue
        if top == "callbacks" and _new_callback(rest.partition(".")[0], parsed):
            continue  # every key under callbacks is a callback the run builds (train.build_callbacks)
        group = top if rest and (conf / top).is_dir() else None
        known = declared_settings(group)
        if group is None:
            known = {k for k in known if "." not in k and k != "hydra"} | set(GROUPS)
        if (rest if group else key) in known:
            continue
        match = closest(rest if group else key, known)
        hint = f"did you mean '{group + '.' if group else ''}{match}'?" if match else \
            "python -m xmc_repro --cfg job lists every setting"
        if group == "callbacks" and not match:  # a callback of one's own, added without its class
            name = rest.partition(".")[0]
            hint = f"a new callback needs its class too: +callbacks.{name}._target_=package.module.Class"
        return f"unknown setting '{key}': '+' added it, but nothing reads it; {hint}"
    return None


def _new_callback(name: str, parsed) -> bool:
    """Whether the command line adds callback `name` with its class (`+callbacks.<name>._target_=pkg.Class`, or
    `+callbacks.<name>={_target_: pkg.Class, ...}`), under a name no callback file uses (a near miss of one, such as
    `+callbacks.erly_stop`, is a typo). What it builds is checked before the data loads (model.check_targets)."""
    known = declared_settings("callbacks")
    if name in known or closest(name, [k for k in known if "." not in k]):
        return False
    for override in parsed:
        key, value = override.key_or_group, override.value()
        if key == f"callbacks.{name}._target_" or (key == f"callbacks.{name}" and isinstance(value, dict)
                                                   and "_target_" in value):
            return True
    return False


def task_overrides(hydra_config) -> list[str]:
    """The command line's overrides as given: Hydra keeps them in its config, where a `${...}` in one would be
    resolved on reading, and one that does not resolve would raise instead of being reported by `validate`."""
    return OmegaConf.to_container(hydra_config.overrides.task, resolve=False)


def sweep_config():
    """Hydra's config of a job of a multirun; None for a single run (or outside Hydra: tests, library use)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        hc = HydraConfig.get()
    except ValueError:
        return None
    return hc if hc.mode == RunMode.MULTIRUN else None


def swept_overrides(hydra_config) -> list[str]:
    """This job's overrides of the settings its sweep varies (`model.connectivity=100` of `model.connectivity=8,100,4`
    or of a preset's `hydra.sweeper.params`): what tells it from the sweep's other jobs, whose settings Hydra's log
    lists in full as each starts. The sweep's overrides are read from the `multirun.yaml` Hydra's sweeper writes in
    the sweep's folder; without it (another sweeper), all of the job's."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    job = task_overrides(hydra_config)
    try:
        sweep = OmegaConf.load(Path(hydra_config.runtime.cwd) / hydra_config.sweep.dir / "multirun.yaml").hydra
        params = OmegaConf.to_container(sweep.sweeper.get("params") or OmegaConf.create(), resolve=False)
        given = [f"{key}={value}" for key, value in params.items()] + task_overrides(sweep)
        parser = OverridesParser.create()
        # In order, as Hydra's sweeper reads them: a command line's `dataset=bibtex` pins a preset's swept dataset
        swept = {o.get_key_element(): o.is_sweep_override() for o in parser.parse_overrides(given)}
        return [text for text, o in zip(job, parser.parse_overrides(job)) if swept.get(o.get_key_element())]
    except Exception:  # a display: the job's whole command line rather than a failure of its own
        return job


def grid_without_multirun(hydra_config) -> str | None:
    """One line when an `experiment=` grid (its `hydra.sweeper.params`) is run without `-m`: Hydra would train the
    default configuration once, tagged as the table's. None otherwise."""
    from hydra.types import RunMode

    params = OmegaConf.select(hydra_config, "sweeper.params", default=None)
    if hydra_config.mode == RunMode.MULTIRUN or not params:
        return None
    overrides = task_overrides(hydra_config)
    grid = " ".join(o for o in overrides if o.startswith("experiment="))
    return (f"{grid or 'this config'} is a grid of runs ({', '.join(map(str, params))}); "
            f"run it with -m: python -m xmc_repro -m {' '.join(overrides)}")
