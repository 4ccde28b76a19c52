"""The classifier: Dropout -> [Linear(intermediate) + ReLU] -> last layer, trained as a LightningModule."""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
import torch
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import OmegaConf
from torch import nn

from lightning.pytorch.utilities import rank_zero_warn

from xmc_repro.errors import ConfigError
from xmc_repro.losses import TrainingLossLog
from xmc_repro.metrics import XMCMetrics
from xmc_repro.resources import resource_dir
from xmc_repro.step_graph import CaptureError, StepGraph, loss_from_positions, unsupported_reason
from xmc_repro.optim import adam
from xmc_repro.validation import BOTTLENECK_ACTIVATIONS, EPS_PLACEMENTS, INITS, choice, positive_int


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or Inf; the run stops at this step."""


class Bottleneck(nn.Sequential):
    """The authors' bottleneck: Dense(size, relu) -> Dense(labels); `linear` drops the ReLU and the first bias."""

    def __init__(self, in_features: int, num_labels: int, bottleneck: int, bottleneck_activation: str = "relu"):
        size = positive_int(bottleneck, "model.bottleneck")
        choice(bottleneck_activation, "model.bottleneck_activation", BOTTLENECK_ACTIVATIONS)  # built without Hydra too
        if bottleneck_activation == "relu":
            super().__init__(nn.Linear(in_features, size), nn.ReLU(), nn.Linear(size, num_labels))
        else:
            super().__init__(nn.Linear(in_features, size, bias=False), nn.Linear(size, num_labels))


def conf_choice(group: str, name: str) -> dict:
    """conf/<group>/<name>.yaml as a dict (its defaults list dropped), for objects built without Hydra."""
    path = resource_dir("conf") / group / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"{group}={name!r} is unknown; choose one of {', '.join(names)}")
    spec = OmegaConf.load(path)
    spec.pop("defaults", None)
    return spec


def instantiate_with(spec, *args, **kwargs):
    """`spec["_target_"]` called with `args`, `kwargs` and those settings of `spec` its signature names.

    A model config holds the settings of the whole model (`intermediate`, rewiring, the run's name) beside
    the head's own: each object takes what it names. A ConfigError or ValueError raised while building stays one
    line (Hydra would wrap it in an InstantiationException).
    """
    spec = OmegaConf.create(spec) if not OmegaConf.is_config(spec) else spec
    target = get_object(spec._target_)
    names = inspect.signature(target).parameters
    chosen = {key: spec[key] for key in spec if key in names and key not in kwargs}
    chosen.update({key: spec[key] for key in ("_target_", "_partial_") if key in spec})
    try:
        return instantiate(chosen, *args, _convert_="all", **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        if isinstance(cause, ValueError):
            raise ConfigError(f"{spec._target_}: {cause}") from None
        raise


def _file_of(group: str, name: str | None = None) -> str:
    """The config file a setting of `group` comes from, for messages: conf/<group>/<this run's choice>.yaml (a
    callback's: conf/callbacks/<its name>.yaml)."""
    if name is None:
        try:
            from hydra.core.hydra_config import HydraConfig

            name = HydraConfig.get().runtime.choices.get(group)
        except ValueError:  # outside a Hydra app
            pass
    if name and not (resource_dir("conf") / group / f"{name}.yaml").is_file():  # a file of one's own
        where = f"{group}/{name}.yaml in your --config-dir folder"
    else:
        where = f"conf/{group}/{name}.yaml" if name else f"its file in conf/{group}/"
    if group == "callbacks":  # a callback may also come from the command line (+callbacks.<name>._target_=...)
        return f"{where} (or the +callbacks.{name} override)"
    return where


def _target(spec, setting: str, where: str):
    """The object `spec._target_` names; ConfigError (one line) when there is none or it cannot be imported."""
    from hydra._internal.utils import _locate  # get_object's own lookup, without its log line on stderr

    target = spec.get("_target_") if OmegaConf.is_dict(spec) else None
    if not isinstance(target, str) or not target:
        raise ConfigError(f"{setting} has no _target_; add `_target_: package.module.Name` (what it builds) to {where}")
    try:
        return _locate(target)
    except Exception as error:
        cause = error.__cause__ or error
        lines = str(error).splitlines()
        hint = lines[-1] if len(lines) > 2 else ""  # Hydra's "Are you sure that 'X' is importable from ...?"
        raise ConfigError(f"{setting}._target_={target} cannot be imported ({type(cause).__name__}: "
                          f"{' '.join(str(cause).split())}{'; ' + hint if hint else ''}); fix it in {where}, or run "
                          "from the folder that holds its package") from None


def _ignored_settings(spec, target, setting: str, where: str, reserved=(), called_with=0) -> None:
    """instantiate_with passes only the settings the target's signature names: any other key of a head's, a loss's
    or a callback's file would be ignored, while MLflow records it as a param (and the report's setup shows it).
    `reserved`: keys read elsewhere; `called_with`: how many leading arguments the pipeline passes itself."""
    try:
        names = inspect.signature(target).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): instantiate_with passes nothing either
        return
    extra = [key for key in spec if key not in names and key not in reserved and not str(key).startswith("_")]
    if extra:
        takes = [name for name, p in list(names.items())[called_with:]
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise ConfigError(f"{setting}.{extra[0]} is not a setting of {spec._target_} (it takes "
                          f"{', '.join(takes) or 'none'}), so it would be ignored; fix or remove it in {where}")


LOSS_ARGUMENTS = ("scores", "label_ptr", "label_idx")  # what the training step calls a loss with


def check_targets(cfg) -> None:
    """The classes and functions a run builds (model, loss, callbacks: their `_target_`), checked before its data
    loads and its MLflow run opens: a name that cannot be imported, a loss that is not a function of (scores,
    label_ptr, label_idx), or a setting its function does not take (ignored, yet recorded) each failed the run after
    its data had loaded, with a traceback. One line (ConfigError) naming the setting and the file to fix."""
    from xmc_repro.cli import declared_settings

    where = _file_of("model")
    # every model's settings (conf/model_common.yaml) and those of this project's heads, which a sweep across heads
    # may set for all (`-m model=uniform,dense model.connectivity=4`), are read elsewhere or left unused on purpose
    shared = {key for key in declared_settings("model") if "." not in key}
    # A resumed run is its stored config, which no file fixes: a key that code from before this check started it
    # with, and ignored, is ignored again as it goes on (refused, the run could never be continued).
    keys = not cfg.get("resume")
    model = _target(cfg.model, "model", where)
    if keys:
        _ignored_settings(cfg.model, model, "model", where, shared, called_with=2)
    where = _file_of("loss")
    loss = _target(cfg.loss, "loss", where)
    if cfg.loss.get("_partial_") is not True:
        raise ConfigError(f"loss._partial_ is not true: the loss is the function itself, called every step with "
                          f"({', '.join(LOSS_ARGUMENTS)}); add `_partial_: true` to {where}")
    if keys:
        _ignored_settings(cfg.loss, loss, "loss", where, reserved=("name",), called_with=len(LOSS_ARGUMENTS))
    try:
        settings = {key: None for key in cfg.loss if key in inspect.signature(loss).parameters}
        inspect.signature(loss).bind(*LOSS_ARGUMENTS, **settings)
    except TypeError as error:
        raise ConfigError(f"loss._target_={cfg.loss._target_} cannot be called as loss({', '.join(LOSS_ARGUMENTS)}) "
                          f"({error}); fix the function or {where}") from None
    except ValueError:  # no signature to read
        pass
    for name, spec in (cfg.get("callbacks") or {}).items():
        where = _file_of("callbacks", name)
        if not OmegaConf.is_dict(spec):
            raise ConfigError(f"callbacks.{name}={spec!r} is not a callback's config; give it its class "
                              f"(`_target_: package.module.Class`) and settings in {where}")
        target = _target(spec, f"callbacks.{name}", where)
        if keys:
            _ignored_settings(spec, target, f"callbacks.{name}", where)


def head_spec(head: str, **settings) -> dict:
    """The settings of head `head`: conf/model/<head>.yaml under `settings` (a whole model config has `_target_`)."""
    if "_target_" in settings:
        return {"head": head, **settings}
    return {**OmegaConf.to_container(conf_choice("model", head)), **settings}


def build_loss(loss) -> callable:
    """`loss(scores, label_ptr, label_idx)` from a loss config, or the name of one in conf/loss/."""
    return instantiate_with(conf_choice("loss", loss) if isinstance(loss, str) else loss)


@torch.no_grad()
def init_dense_like_keras_(module: nn.Module) -> None:
    """Keras' Dense defaults, as in the authors' models: glorot_uniform kernels, zero biases.

    torch's nn.Linear default (U(+-1/sqrt(fan_in)) for weights and bias) is the `fan_in` setting.
    """
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            nn.init.xavier_uniform_(layer.weight)
            if layer.bias is not None:
                layer.bias.zero_()


class XMCClassifier(pl.LightningModule):
    """Extreme multi-label classifier over fixed input embeddings.

    `forward` returns label scores (batch, labels). The loss is built on the device from the CSR label lists of
    the batch; validation streams P@k through `XMCMetrics` and logs `val/p_at_3` for LR halving and early stop.
    """

    def __init__(
        self,
        num_features: int,
        num_labels: int,
        head: str = "uniform",
        intermediate: int | None = None,
        init: str = "authors",
        dropout: float = 0.1,
        loss: str | dict = "squared_hinge",
        lr: float = 1e-3,
        adam_eps: float = 1e-7,
        adam_eps_placement: str = "keras",
        lr_factor: float = 0.5,
        lr_patience: int = 2,
        lr_threshold: float = 1e-3,
        min_lr: float = 1e-4,
        cuda_graph: bool = True,
        inv_propensity=None,
        **head_settings,
    ):
        """`head` names conf/model/<head>.yaml; `head_settings` override its settings (`connectivity=64`), or
        with `_target_` are the whole model config. `loss` names conf/loss/<loss>.yaml or is a loss config.
        `cuda_graph`: on a CUDA device, replay the training step's forward, loss and backward as one CUDA graph
        where the model allows it (`xmc_repro.step_graph`); elsewhere it changes nothing."""
        super().__init__()
        choice(init, "model.init", INITS)  # every layer reads it, the dense ones only when it is "authors"
        choice(adam_eps_placement, "trainer.adam_eps_placement", EPS_PLACEMENTS)
        self.save_hyperparameters(ignore=["inv_propensity"])
        layers: list[nn.Module] = [nn.Dropout(dropout)]
        width = num_features
        if intermediate is not None:
            width = positive_int(intermediate, "model.intermediate")
            layers += [nn.Linear(num_features, width), nn.ReLU()]
        self.encoder = nn.Sequential(*layers)
        self.head = instantiate_with(head_spec(head, init=init, **head_settings), width, num_labels)
        if init == "authors":
            init_dense_like_keras_(self)
        self.loss_fn = build_loss(loss)
        self.val_metrics = XMCMetrics(num_labels, ks=(1, 3, 5), inv_propensity=inv_propensity)
        # Read at once on a CPU; on a GPU every 50 steps and at an epoch's last batch (no per-step sync), so a
        # run may stop up to 49 steps after a non-finite loss -- the message names the step where it appeared.
        self._losses = TrainingLossLog(every=50)
        self._step_graph = None  # StepGraph, made at the first training step where one is possible
        self._graph_off: str | None = None if cuda_graph else "trainer.cuda_graph=false"
        self._grads_in_graph = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Label scores. A head whose outputs are not label scores (MACH's meta-scores) decodes them: `decode`."""
        out = self.head(self.encoder(x))
        decode = getattr(self.head, "decode", None)
        return decode(out) if decode is not None else out

    def training_step(self, batch, batch_idx):
        x, label_ptr, label_idx, *share = batch  # a DDP rank's share: the first row of its part of x (XMCDataModule)
        rows = len(label_ptr) - 1
        graph = self._graph()
        loss = None
        if graph is not None and label_idx.numel() > 0:
            try:
                loss = graph.step(x, label_ptr, label_idx)
                self._grads_in_graph = True  # `backward` attaches them (Lightning clears .grad in between)
            except CaptureError as error:  # train on, eagerly: slower, same result
                self._step_graph, self._graph_off = None, str(error)
                rank_zero_warn(f"the training step runs eagerly: its CUDA graph capture failed ({error})")
        if loss is None:
            scores = self.head(self._encode_share(x, share[0], rows) if share else self.encoder(x))
            targets = getattr(self.head, "meta_labels", None)
            if targets is not None:  # a head trained on other targets than the labels (MACH: hashed labels)
                label_ptr, label_idx = targets(label_ptr, label_idx)
            # An empty share (a global batch smaller than the number of ranks) still runs backward, as DDP needs.
            loss = self.loss_fn(scores, label_ptr, label_idx) if rows else scores.sum() * 0.0
        last = self._trainer is not None and self.trainer.is_last_batch
        bad = self._losses.add(loss, self.global_step, rows, flush=last)
        if not self._losses.unread:  # just read (every rank reads at the same steps): all stop, or none
            self._stop_on_every_rank(bad, *self._over_ranks((float(bad is not None),)))
        self._log_step_loss(loss, rows)
        if share:  # DDP averages the ranks' gradients: weighted by its share's size, every point counts once
            return loss * (rows * self.trainer.world_size / x.shape[0])
        return loss

    def _encode_share(self, x: torch.Tensor, start: int, rows: int) -> torch.Tensor:
        """The encoder's output for rows [start, start + rows) of the global batch's inputs `x`: dropout draws the
        global batch's mask, the mask one process draws, so a DDP run trains as one process does."""
        return self.encoder[1:](self.encoder[0](x)[start : start + rows])

    def _stop_if_non_finite(self, bad: tuple[float, int] | None) -> None:
        if bad is not None:
            raise NonFiniteLossError(
                f"the training loss is {bad[0]} at step {bad[1]} (epoch {self.current_epoch + 1}); "
                "lower trainer.lr or check the input features for extreme values"
            )

    def _stop_on_every_rank(self, bad: tuple[float, int] | None, ranks_bad: float) -> None:
        """Stop if this rank read a non-finite loss (`bad`) or, under DDP, any rank did (`ranks_bad`: how many, from
        a collective): one rank stopping alone would leave the others waiting in their next collective."""
        self._stop_if_non_finite(bad)
        if ranks_bad:
            raise NonFiniteLossError(f"the training loss is not finite on another DDP rank (by step "
                                     f"{self.global_step}, epoch {self.current_epoch + 1}; its line says where); lower "
                                     "trainer.lr or check the input features for extreme values")

    def _log_step_loss(self, loss: torch.Tensor, batch_size: int) -> None:
        """`train/loss_step`, at the steps Lightning writes to the loggers only.

        `self.log` costs as much host time as a whole GPU step (about 1 ms per call on a 2-core CPU), so it is
        called only when its value is written. It is no progress-bar metric: Lightning turns those into Python
        numbers after every batch, a device sync per step (the bar reads the loss itself every few dozen steps,
        xmc_repro.console).
        """
        connector = getattr(self._trainer, "_logger_connector", None)  # Lightning's own test for "log this step"
        if connector is None or getattr(connector, "should_update_logs", True):
            self.log("train/loss_step", loss.detach(), on_step=True, on_epoch=False, batch_size=batch_size)

    def epoch_loss(self) -> float | None:
        """The epoch's mean training loss so far, weighted by batch size (reads the device once). Under DDP it is
        the mean over every rank's points, as one process computes it: a collective, so every rank calls it."""
        total, points = self._epoch_totals()
        return total / points if points else None

    def _epoch_totals(self) -> tuple[float, float]:
        """The epoch's loss sum and points so far, over all DDP ranks (a collective). A non-finite loss that any rank
        reads stops every rank here: one rank raising alone would leave the others waiting in the collective."""
        bad = self._losses.flush()
        total, points, ranks_bad = self._over_ranks((*self._losses.totals(), float(bad is not None)))
        self._stop_on_every_rank(bad, ranks_bad)
        return total, points

    def _over_ranks(self, values: tuple[float, ...]) -> tuple[float, ...]:
        """`values` summed over the DDP ranks (a collective); unchanged in one process."""
        trainer = self._trainer
        if trainer is None or trainer.world_size == 1:
            return values
        summed = trainer.strategy.reduce(torch.tensor(values, dtype=torch.float64, device=self.device),
                                         reduce_op="sum")
        return tuple(summed.tolist())

    def on_train_epoch_start(self):
        self._stop_if_non_finite(self._losses.new_epoch())

    def on_save_checkpoint(self, checkpoint):
        # Every rank saves (Lightning's save_checkpoint runs on all of them): the file holds all ranks' sums. A bad
        # loss raises here, so the previous checkpoint stays the last good one.
        total, points = self._epoch_totals()
        checkpoint["epoch_loss"] = {"sum": total, "points": points, "all_ranks": True}

    def on_load_checkpoint(self, checkpoint):
        state = checkpoint.get("epoch_loss")  # absent before it: the resumed epoch's mean counts its rest only
        if state is not None:
            # Each rank takes its part of all ranks' sums, so their sum is the file's (of any number of ranks).
            # Checkpoints from before "all_ranks" hold rank 0's sums: every rank takes them whole.
            ranks = self._trainer.world_size if state.get("all_ranks") and self._trainer is not None else 1
            self._losses.load_totals(state["sum"] / ranks, state["points"] / ranks)

    def on_train_epoch_end(self):
        mean = self.epoch_loss()
        if mean is not None:
            self.log("train/loss_epoch", mean, on_step=False, on_epoch=True)

    def _graph(self):
        """The step graph when this run can use one (decided at the first training step), else None."""
        if self._step_graph is None and self._graph_off is None:
            trainer = self._trainer
            self._graph_off = unsupported_reason(
                self, trainer.precision if trainer is not None else "32-true",
                trainer.world_size if trainer is not None else 1)
            if self._graph_off is None:
                self._step_graph = StepGraph(self, loss_from_positions(self.loss_fn), self.hparams.num_labels)
        return self._step_graph

    def release_step_graph(self):
        """Free the step graph's memory (the step's gradients and activations): before validation, rewiring and the
        end of training, which need neither, so their peak memory is the eager step's. The next training step
        captures again (a few milliseconds: at 670k labels, 15 rewirings and one validation an epoch)."""
        if self._step_graph is not None:
            self._step_graph.release()

    def on_validation_start(self):
        self.release_step_graph()

    def on_train_end(self):
        self.release_step_graph()

    def backward(self, loss, *args, **kwargs):
        if self._grads_in_graph:  # the graph ran backward already
            self._grads_in_graph = False
            self._step_graph.attach_grads()
            return
        super().backward(loss, *args, **kwargs)

    def validation_step(self, batch, batch_idx):
        x, label_ptr, label_idx = batch
        self.val_metrics.update(self(x), label_ptr, label_idx)

    def on_validation_epoch_start(self):
        self.val_metrics.reset()

    def on_validation_epoch_end(self):
        result = self.val_metrics.compute()
        # Metrics are percentages; sync averages them over DDP ranks (equal shards).
        for k in (1, 3, 5):
            self.log(f"val/p_at_{k}", float(result[f"p_at_{k}"]), prog_bar=k == 3, sync_dist=True)

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        # Free the gradients now instead of at the next backward: the next forward, validation and
        # rewiring then run without them (190 MB at Amazon-670K with a 32k intermediate layer).
        self.zero_grad(set_to_none=True)

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = adam(self.parameters(), lr=hp.lr, eps=hp.adam_eps, placement=hp.adam_eps_placement,
                         device=self.device)
        # The authors' thresholds are in P@3 as a fraction; our metrics are in percent. Keras's ReduceLROnPlateau
        # (theirs) halves once `patience` epochs in a row fail to improve, torch's only after patience + 1.
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer,
            mode="max",
            factor=hp.lr_factor,
            patience=max(hp.lr_patience - 1, 0),
            threshold=hp.lr_threshold * 100,
            threshold_mode="abs",
            min_lr=hp.min_lr,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val/p_at_3"}}

    def sparse_layers(self):
        """Layers that rewire (uniform and unstructured heads)."""
        return [m for m in self.modules() if hasattr(m, "rewire")]

    @torch.no_grad()
    def evaluate(self, loader, inv_propensity=None, precision=None) -> dict[str, float]:
        """P@k, nDCG@k, PSP@k (percent) over `loader`, streamed batch by batch. `precision`: the trainer's
        precision plugin, so that the scores are computed as in validation (autocast for `-mixed`, inputs in the
        parameters' dtype for `-true`); without it, in plain float32."""
        was_training = self.training
        self.eval()
        metrics = XMCMetrics(self.hparams.num_labels, ks=(1, 3, 5), inv_propensity=inv_propensity)
        for x, label_ptr, label_idx in loader:
            x, label_ptr, label_idx = (t.to(self.device) for t in (x, label_ptr, label_idx))
            if precision is None:
                scores = self(x)
            else:
                with precision.forward_context():
                    scores = self(precision.convert_input(x))
            metrics.update(scores, label_ptr, label_idx)
        self.train(was_training)
        return {k: float(v) for k, v in metrics.compute().items()}

