"""The classifier: Dropout -> [Linear(intermediate) + ReLU] -> last layer, trained as a LightningModule."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn

from xmc_repro.errors import ConfigError
from xmc_repro.losses import NonFiniteLossWatch, build_loss
from xmc_repro.metrics import XMCMetrics
from xmc_repro.validation import positive_int as _positive

HEADS = ("dense", "uniform", "unstructured", "bottleneck", "mach")


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or Inf; the run stops at this step."""


def build_head(head: str, in_features: int, num_labels: int, model_cfg) -> nn.Module:
    """The last layer named by `model.head`."""
    if head == "dense":
        return nn.Linear(in_features, num_labels)
    if head == "bottleneck":
        size = _positive(model_cfg.get("bottleneck"), "model.bottleneck")
        # The authors' bottleneck: Dense(size, relu) -> Dense(labels); `linear` drops the ReLU and the bias.
        if model_cfg.get("bottleneck_activation", "relu") == "relu":
            return nn.Sequential(nn.Linear(in_features, size), nn.ReLU(), nn.Linear(size, num_labels))
        return nn.Sequential(nn.Linear(in_features, size, bias=False), nn.Linear(size, num_labels))
    init = model_cfg.get("init", "authors")
    if head == "uniform":
        from xmc_repro.sparse import UniformSparseLinear

        connectivity = _positive(model_cfg.get("connectivity"), "model.connectivity")
        return UniformSparseLinear(in_features, num_labels, connectivity, init=init,
                                   distinct_sources=bool(model_cfg.get("distinct_sources", False)))
    if head == "unstructured":
        from xmc_repro.sparse import UnstructuredSparseLinear

        connectivity = _positive(model_cfg.get("connectivity"), "model.connectivity")
        return UnstructuredSparseLinear(in_features, num_labels, connectivity, init=init)
    if head == "mach":
        from xmc_repro.mach import MachHead

        mach = model_cfg.get("mach") or {}
        return MachHead(in_features, num_labels, int(mach["num_hashes"]), int(mach["num_buckets"]),
                        decode=mach.get("decode", "probability"))
    raise ConfigError(f"model.head={head!r} is unknown; choose one of {', '.join(HEADS)} (e.g. model=uniform)")


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
        connectivity: int | None = 32,
        intermediate: int | None = None,
        bottleneck: int | None = None,
        mach: dict | None = None,
        init: str = "authors",
        distinct_sources: bool = False,
        bottleneck_activation: str = "relu",
        dropout: float = 0.1,
        loss: str = "squared_hinge",
        lr: float = 1e-3,
        adam_eps: float = 1e-7,
        lr_factor: float = 0.5,
        lr_patience: int = 2,
        lr_threshold: float = 1e-3,
        min_lr: float = 1e-4,
        inv_propensity=None,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["inv_propensity"])
        layers: list[nn.Module] = [nn.Dropout(dropout)]
        width = num_features
        if intermediate is not None:
            width = _positive(intermediate, "model.intermediate")
            layers += [nn.Linear(num_features, width), nn.ReLU()]
        self.encoder = nn.Sequential(*layers)
        model_cfg = {"connectivity": connectivity, "bottleneck": bottleneck, "mach": mach, "init": init,
                     "distinct_sources": distinct_sources, "bottleneck_activation": bottleneck_activation}
        self.head = build_head(head, width, num_labels, model_cfg)
        if init == "authors":
            init_dense_like_keras_(self)
        self.loss_fn = build_loss(loss)
        self.val_metrics = XMCMetrics(num_labels, ks=(1, 3, 5), inv_propensity=inv_propensity)

    @property
    def is_mach(self) -> bool:
        return self.hparams.head == "mach"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Label scores; for MACH the decoded label scores."""
        out = self.head(self.encoder(x))
        return self.head.decode(out) if self.is_mach else out

    def training_step(self, batch, batch_idx):
        x, label_ptr, label_idx = batch
        scores = self.head(self.encoder(x))
        if self.is_mach:  # MACH trains its meta-classifiers on hashed labels
            label_ptr, label_idx = self.head.meta_labels(label_ptr, label_idx)
        loss = self.loss_fn(scores, label_ptr, label_idx)
        # Checked at once on a CPU; on a GPU read every 50 steps and at an epoch's last batch (no per-step
        # sync), so the run may stop up to 49 steps after the bad one -- the message names the bad step.
        if getattr(self, "_loss_watch", None) is None:
            self._loss_watch = NonFiniteLossWatch(every=50)
        last = self._trainer is not None and self.trainer.is_last_batch
        bad = self._loss_watch.update(loss, self.global_step, flush=last)
        if bad is not None:
            raise NonFiniteLossError(
                f"the training loss is {bad[0]} at step {bad[1]} (epoch {self.current_epoch}); "
                "lower trainer.lr or check the input features for extreme values"
            )
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=x.shape[0])
        return loss

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
        # Fused Adam on CUDA updates each parameter in one kernel, without the parameter-sized temporaries
        # of the multi-tensor path: at 670k labels those are a sizeable part of the peak memory.
        optimizer = torch.optim.Adam(self.parameters(), lr=hp.lr, eps=hp.adam_eps,
                                     fused=self.device.type == "cuda" or None)
        # The authors' thresholds are in P@3 as a fraction; our metrics are in percent.
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer,
            mode="max",
            factor=hp.lr_factor,
            patience=hp.lr_patience,
            threshold=hp.lr_threshold * 100,
            threshold_mode="abs",
            min_lr=hp.min_lr,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val/p_at_3"}}

    def sparse_layers(self):
        """Layers that rewire (uniform and unstructured heads)."""
        return [m for m in self.modules() if hasattr(m, "rewire")]

    @torch.no_grad()
    def evaluate(self, loader, inv_propensity=None, max_points: int | None = None) -> dict[str, float]:
        """P@k, nDCG@k, PSP@k (percent) over `loader`, streamed batch by batch."""
        was_training = self.training
        self.eval()
        metrics = XMCMetrics(self.hparams.num_labels, ks=(1, 3, 5), inv_propensity=inv_propensity)
        seen = 0
        for x, label_ptr, label_idx in loader:
            if max_points is not None and seen >= max_points:
                break
            x, label_ptr, label_idx = (t.to(self.device) for t in (x, label_ptr, label_idx))
            metrics.update(self(x), label_ptr, label_idx)
            seen += x.shape[0]
        self.train(was_training)
        return {k: float(v) for k, v in metrics.compute().items()}


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def describe(model: XMCClassifier) -> str:
    hp = model.hparams
    parts = [f"{hp.head} head"]
    if hp.connectivity and hp.head in ("uniform", "unstructured"):
        parts.append(f"{hp.connectivity} per label")
    if hp.intermediate:
        parts.append(f"intermediate {hp.intermediate}")
    return f"{', '.join(parts)}; {param_count(model) / 1e6:.2f}M parameters"
