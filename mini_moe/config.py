"""Named training configurations: ``quick`` (CPU, minutes) and ``full`` (GPU/TPU).

One switch picks the scale (DESIGN §5): :func:`default_scale` returns ``"quick"`` on a
CPU and ``"full"`` on an accelerator; the environment variable ``MINI_MOE_SCALE``
overrides it. The full configuration computes in bfloat16 on a GPU or TPU
(:func:`default_dtype`). Every field can be overridden by keyword (``get_config(..., steps=50)``,
``model_dim=...`` style keys prefixed with ``model_`` go to :class:`~mini_moe.model.ModelConfig`).
"""

from __future__ import annotations

import dataclasses
import os

import jax

from mini_moe import data as data_lib
from mini_moe import routers as routers_lib
from mini_moe import routing as routing_lib
from mini_moe.model import ModelConfig
from mini_moe.validate import InputError, check_int

SCALES = ("quick", "full")

# Per dataset: image geometry, the patch size used at each scale, model-size changes and
# training changes ("train": TrainConfig fields). Fashion-MNIST's quick model uses 7x7 patches
# (16 tokens) at width 128: on a 2-core CPU it learns more per minute than 4x4 patches at width
# 64, whose 49-token attention dominates.
# patch_vote (and every "patch_vote_v<V>") is the router study's testbed (issue 25): its own model
# at both scales, so that the other datasets' configurations keep their speed. 7x7 patches make
# each vocabulary patch one token; width 64 with MLPs (and experts) of 64 makes the dense MLP
# small against the task's table of V patches (after 2,000 steps it holds less of it than the
# experts do; trained longer it catches up, see chapter 8's pilot); 2,000 steps.
_PATCH_VOTE_MODEL = dict(dim=64, depth=4, heads=4, mlp_dim=64, num_experts=8)
_DATASET_SHAPES = {
    "digits": dict(image_size=8, channels=1, num_classes=10, patch={"quick": 2, "full": 2}),
    "fashion_mnist": dict(image_size=28, channels=1, num_classes=10, patch={"quick": 7, "full": 4},
                          model={"quick": dict(dim=128, mlp_dim=256)}),
    "cifar10": dict(image_size=32, channels=3, num_classes=10, patch={"quick": 4, "full": 4}),
    "cifar100": dict(image_size=32, channels=3, num_classes=100, patch={"quick": 4, "full": 4}),
    "patch_vote": dict(image_size=28, channels=1, num_classes=10, patch={"quick": 7, "full": 7},
                       model={"quick": _PATCH_VOTE_MODEL, "full": _PATCH_VOTE_MODEL},
                       train={"quick": dict(steps=2000), "full": dict(steps=2000)}),
    # subtask_vote (issue 34): the routing task, with patch_vote's model so the two tasks compare.
    "subtask_vote": dict(image_size=28, channels=1, num_classes=10, patch={"quick": 7, "full": 7},
                         model={"quick": _PATCH_VOTE_MODEL, "full": _PATCH_VOTE_MODEL},
                         train={"quick": dict(steps=2000), "full": dict(steps=2000)}),
}


def dataset_shape(dataset: str) -> dict:
    """The geometry and configuration changes of ``dataset`` (``"patch_vote_v<V>"`` shares
    ``"patch_vote"``'s, ``"subtask_vote_d<d>_h<h>"`` ``"subtask_vote"``'s); a clear error for an
    unknown name."""
    key = dataset
    if data_lib.patch_vote_options(dataset) is not None:
        key = "patch_vote"
    elif data_lib.subtask_vote_options(dataset) is not None:
        key = "subtask_vote"
    if key not in _DATASET_SHAPES:
        raise InputError(f"Unknown dataset {dataset!r}; expected one of: {', '.join(_DATASET_SHAPES)} "
                         "(or patch_vote_v<V>, subtask_vote_d<d>_h<h>_s<s>).")
    return dict(_DATASET_SHAPES[key])

_MODEL_SCALE = {
    "quick": dict(dim=64, depth=4, heads=4, mlp_dim=128, num_experts=8),
    "full": dict(dim=192, depth=8, heads=6, mlp_dim=384, num_experts=16),
}

SCHEDULES = ("cosine", "constant")  # TrainConfig.schedule

_TRAIN_SCALE = {
    "quick": dict(batch_size=128, steps=1500, learning_rate=2e-3, warmup_steps=100, eval_every=500),
    "full": dict(batch_size=256, steps=20000, learning_rate=1e-3, warmup_steps=1000, eval_every=2000),
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; saved as ``config.json`` next to its results."""

    model: ModelConfig
    dataset: str = "digits"
    data_dir: str | None = None
    batch_size: int = 128
    steps: int = 1000
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    # "cosine": linear warmup, then cosine decay to 1 % at `steps`; "constant": linear warmup,
    # then the learning rate held (every step count is then a budget of the same run).
    schedule: str = "cosine"
    # With schedule "constant": the last `cooldown_steps` steps take the rate linearly down to 0
    # (warmup-stable-decay). A run cut from a constant one at a kept checkpoint then anneals it
    # (train.train(branch_from=...)): every budget of one constant run, annealed, for 20 % more steps.
    cooldown_steps: int = 0
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    aux_loss_weight: float = 0.01  # weight of the routers' auxiliary losses
    augment: bool = False  # random resized crop + flip
    prc: bool = False  # Pairwise Router Consistency (paper 004) in place of aux losses
    prc_lambda_diag: float = 5e-3  # paper 004, Table 1
    prc_lambda_offdiag: float = 5e-2
    eval_every: int = 500
    eval_batch_size: int = 512
    checkpoint_every: int = 500
    # 0: only the newest two checkpoints are kept; k > 0: also every checkpoint at a multiple of k
    # steps, so that one run can be measured at several budgets (train.load_trained(step=...)).
    keep_every: int = 0
    max_seconds: float | None = None  # stop (and checkpoint) after this much training time
    # Early stopping (train.plateaued): 0 = off, else stop at the first evaluation whose best
    # accuracy on the evaluation split is not min_delta above the best of `patience` steps earlier.
    patience: int = 0
    min_delta: float = 0.0
    mesh: tuple | None = None  # (data, expert) devices: expert parallelism (mini_moe.parallel)
    grad_accum: int = 1  # micro-batches per optimizer step (train.accumulated_grads)
    seed: int = 0

    def __post_init__(self):
        for name in ("batch_size", "steps", "eval_every", "eval_batch_size", "checkpoint_every"):
            check_int(name, getattr(self, name))
        if not self.learning_rate > 0:
            raise InputError(f"learning_rate must be > 0, got {self.learning_rate!r}.")
        check_int("patience", self.patience, 0)
        check_int("keep_every", self.keep_every, 0)
        if self.keep_every % self.checkpoint_every:
            raise InputError(f"keep_every must be a multiple of checkpoint_every={self.checkpoint_every} "
                             f"(a kept step must be a checkpointed one), got {self.keep_every}.")
        if self.patience % self.eval_every:
            raise InputError(f"patience must be a multiple of eval_every={self.eval_every}, got {self.patience}.")
        if not 0 <= self.min_delta < 1:
            raise InputError(f"min_delta must be in [0, 1) (accuracy as a fraction), got {self.min_delta!r}.")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise InputError(f"max_seconds must be > 0 (or None: no time limit), got {self.max_seconds!r}.")
        if self.schedule not in SCHEDULES:
            raise InputError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}.")
        if self.warmup_steps < 0 or self.warmup_steps >= self.steps:
            raise InputError(f"warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps!r}.")
        check_int("cooldown_steps", self.cooldown_steps, 0)
        if self.cooldown_steps and self.schedule != "constant":
            raise InputError(f"cooldown_steps={self.cooldown_steps} needs schedule='constant' (a cosine schedule "
                             f"decays already), got schedule={self.schedule!r}.")
        if self.cooldown_steps > self.steps - self.warmup_steps:
            raise InputError(f"cooldown_steps must be at most steps - warmup_steps = {self.steps - self.warmup_steps}, "
                             f"got {self.cooldown_steps}.")
        if self.mesh is not None:
            if len(self.mesh) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in self.mesh):
                raise InputError(f"mesh must be (data, expert) with integers >= 1, got {self.mesh!r}.")
            devices = self.mesh[0] * self.mesh[1]
            per_group = 1 if routers_lib.per_image(self.model.router) else self.model.group_images
            if self.batch_size % (per_group * devices):
                raise InputError(
                    f"batch_size={self.batch_size} must be a multiple of {per_group * devices} "
                    f"(images per routing group {per_group} x {devices} devices) for mesh={self.mesh}."
                )
            if self.model.moe_path != "auto":
                raise InputError(f"model moe_path={self.model.moe_path!r} applies on one device; with mesh={self.mesh} "
                                 "the expert-parallel layer picks its own path. Leave moe_path='auto'.")
            if self.model.router is not None and self.model.routed_experts % self.mesh[1]:
                raise InputError(f"num_experts * fine_grained={self.model.routed_experts} must be a multiple of the mesh's "
                                 f"expert axis {self.mesh[1]}.")
        check_int("grad_accum", self.grad_accum)
        if self.grad_accum > 1:
            per_group = 1 if routers_lib.per_image(self.model.router) else self.model.group_images
            if self.batch_size % (self.grad_accum * per_group):
                raise InputError(f"batch_size={self.batch_size} must be a multiple of grad_accum={self.grad_accum} x "
                                 f"{per_group} images per routing group, so every micro-batch holds whole groups.")
            if self.prc or self.mesh is not None:
                raise InputError("grad_accum > 1 is not supported with prc=True or a mesh; use grad_accum=1.")
            if dict(self.model.router_kwargs).get("balance_scope", "group") != "group":
                raise InputError("grad_accum > 1 with balance_scope='batch': the global-batch loss needs every "
                                 "micro-batch's expert counts before the first backward pass, which accumulation "
                                 "does not have. Use balance_scope='group' or grad_accum=1.")
        if self.prc and (self.model.router is None or routers_lib.per_image(self.model.router)):
            raise InputError(f"prc=True needs a sparse router (paper 004 uses token choice), got {self.model.router!r}.")


def default_scale() -> str:
    """``MINI_MOE_SCALE`` if set, else ``"quick"`` on CPU and ``"full"`` on GPU/TPU."""
    scale = os.environ.get("MINI_MOE_SCALE") or ("quick" if jax.default_backend() == "cpu" else "full")
    if scale not in SCALES:
        raise InputError(f"MINI_MOE_SCALE must be one of {SCALES}, got {scale!r}.")
    return scale


def default_dtype(scale: str) -> str:
    """The compute dtype a configuration gets unless ``model_dtype`` overrides it: ``"bfloat16"``
    for the full configuration on a GPU or TPU (parameters, routers and losses stay float32;
    see :class:`~mini_moe.model.VisionMoE`), ``"float32"`` otherwise (the quick configuration,
    and any configuration on a CPU, where XLA has no matrix unit for bfloat16)."""
    return "bfloat16" if scale == "full" and jax.default_backend() != "cpu" else "float32"


def _check_type(key: str, value, default) -> None:
    """An override's value has the type of the field's default (an int is also a float; a
    field whose default is None or a tuple takes anything its own checks accept)."""
    if default is None or isinstance(default, (tuple, list, dict)) or callable(default):
        return
    expected = bool if isinstance(default, bool) else int if isinstance(default, int) else type(default)
    ok = isinstance(value, expected) and (expected is bool or not isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise InputError(f"{key} must be of type {expected.__name__} (like its default {default!r}), "
                         f"got {value!r} of type {type(value).__name__}.")


def get_config(scale: str | None = None, *, dataset: str = "digits", router: str | None = "soft_moe",
               **overrides) -> TrainConfig:
    """Build a :class:`TrainConfig`.

    Args:
      scale: ``"quick"``, ``"full"`` or None (:func:`default_scale`).
      dataset: one of ``mini_moe.data.DATASETS`` (or ``"patch_vote_v<V>"``). ``"patch_vote"``
        has a model and a schedule of its own (width 64, MLPs of 64, 2,000 steps) at both scales.
      router: a router name (``mini_moe.ROUTERS``) or None for the dense ViT. A router defined
        for a dataset family (``RouterSpec.data``: ``raw_oracle``) gets the option ``dataset``
        unless ``model_router_kwargs`` names one.
      **overrides: TrainConfig fields, or ModelConfig fields prefixed with ``model_``
        (e.g. ``model_num_experts=4``, ``model_router_kwargs={"k": 2}``).
    """
    scale = default_scale() if scale is None else scale
    if scale not in SCALES:
        raise InputError(f"scale must be one of {SCALES}, got {scale!r}.")
    shape = dataset_shape(dataset)
    model_fields = dict(
        image_size=shape["image_size"], channels=shape["channels"], num_classes=shape["num_classes"],
        patch_size=shape["patch"][scale], router=router,
        placement="every2" if router is None else routers_lib.spec(router).placement,
        dtype=default_dtype(scale),
        **{**_MODEL_SCALE[scale], **shape.get("model", {}).get(scale, {})},
    )
    train_fields = dict(_TRAIN_SCALE[scale], **shape.get("train", {}).get(scale, {}), dataset=dataset)
    valid_train = {f.name for f in dataclasses.fields(TrainConfig)} - {"model"}
    valid_model = {f.name for f in dataclasses.fields(ModelConfig)}
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    defaults |= {"model_" + f.name: f.default for f in dataclasses.fields(ModelConfig)}
    defaults |= {k: v for k, v in train_fields.items()} | {"model_" + k: v for k, v in model_fields.items()}
    for key, value in overrides.items():
        _check_type(key, value, defaults.get(key))
        if key.startswith("model_") and key[6:] in valid_model:
            if key == "model_router_kwargs" and isinstance(value, dict):
                value = tuple(sorted(value.items()))
            model_fields[key[6:]] = value
        elif key in valid_train:
            train_fields[key] = value
        else:
            raise InputError(
                f"Unknown config field {key!r}; TrainConfig fields: {sorted(valid_train)}; "
                f"model fields (prefix 'model_'): {sorted(valid_model)}."
            )
    if "warmup_steps" not in overrides:  # keep warmup short for short runs
        train_fields["warmup_steps"] = min(train_fields["warmup_steps"], train_fields["steps"] // 10)
    if "eval_every" not in overrides:
        train_fields["eval_every"] = min(train_fields["eval_every"], train_fields["steps"])
    if "checkpoint_every" not in overrides:
        train_fields["checkpoint_every"] = train_fields.get("eval_every", 500)
    kwargs = dict(model_fields.get("router_kwargs", ()))
    if router is not None and routers_lib.spec(router).allocation == "soft" and "slots_per_expert" not in kwargs:
        # Paper 000: S = round(c * T / E) slots per expert with c = 1, T tokens per image.
        patches = (model_fields["image_size"] // model_fields["patch_size"]) ** 2
        kwargs["slots_per_expert"] = routing_lib.capacity(patches, model_fields["num_experts"], 1.0)
        model_fields["router_kwargs"] = tuple(sorted(kwargs.items()))
    if router is not None and routers_lib.spec(router).data is not None and "dataset" not in kwargs:
        # a router defined for one dataset family (raw_oracle reads subtask_vote's signatures): this dataset
        model_fields["router_kwargs"] = tuple(sorted((kwargs | {"dataset": dataset}).items()))
    return TrainConfig(model=ModelConfig(**model_fields), **train_fields)
