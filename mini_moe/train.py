"""Training: AdamW with warmup + cosine, auxiliary losses, checkpoints, exact resume.

:func:`train` runs a :class:`~mini_moe.config.TrainConfig` and writes into ``out_dir``:

* ``config.json`` — the configuration;
* ``checkpoints/`` — Orbax checkpoints of the model, optimizer and step (the last two);
* ``history.json`` — training loss, auxiliary loss, test accuracy and router metrics;
  ``seconds`` is training time only (evaluation and checkpointing excluded), the clock
  that ``max_seconds`` limits.

Resuming (``resume=True``, the default) continues from the newest checkpoint and ends
with exactly the parameters of an uninterrupted run: the batch of step s depends only on
(seed, s), and the router-noise RNG state is part of the checkpoint. ``resume=False``
starts a new run, replacing any run already in ``out_dir``. A non-finite loss
stops training with a ``ValueError``; the newest checkpoint on disk is the last good one.

A run may start from given weights instead of ``cfg.seed``'s initialisation
(``init_from``: a model, its state, or a run folder; e.g. an upcycled MoE,
:mod:`mini_moe.upcycle`), at a later step (``start_step``: its batches are then those a run from
step 0 would see from there on), with a fresh optimizer. ``history.json`` records where it
started (``history["start"]``), and a folder that holds checkpoints of a run started otherwise is
refused rather than resumed. ``measure`` / ``measure_at`` call a function on the model at chosen
steps, outside the training clock.

Why one module of some 700 lines: the training loop, its checkpoints, exact resume and the
recorded start of a run (``init_from``, ``branch_from``) keep one invariant together, that a run
never loses a checkpoint and never silently reuses another run's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from mini_moe import augment
from mini_moe import data as data_lib
from mini_moe import evaluate, losses, parallel, runs
from mini_moe import routers as routers_lib
from mini_moe import routing as routing_lib
from mini_moe.config import TrainConfig
from mini_moe.model import VisionMoE
# The run folder's one reader and writer (mini_moe.runs); these names stay importable from here.
from mini_moe.runs import (check_saved_config, config_from_json, config_to_json,  # noqa: F401
                           restore_checkpoint, save_checkpoint)
from mini_moe.validate import InputError

Array = Any


# ------------------------------------------------------------------ construction


#: The tag folded into a seed's key to give the noise stream its base key. Any value the
#: parameter stream's draw counter never reaches would do (it counts the model's initialisers).
NOISE_STREAM = 0x6E6F6973


def model_rngs(seed: int) -> nnx.Rngs:
    """The random streams of a model of ``seed``: ``params`` from ``jax.random.key(seed)`` and
    ``noise`` (the routers' exploration noise) from that key folded with :data:`NOISE_STREAM`.
    Folding keeps every seed's two streams apart from each other and from the other seeds'
    (``noise=seed + 1``, as before, gave seed s the noise base key of seed s + 1's parameters)."""
    return nnx.Rngs(params=seed, noise=jax.random.fold_in(jax.random.key(seed), NOISE_STREAM))


def make_model(cfg: TrainConfig) -> VisionMoE:
    """The model of ``cfg``, initialised from ``cfg.seed`` (with ``grad_accum > 1``, its routers
    leave their own state updates to the training step: :func:`mini_moe.routers.defer_updates`)."""
    model = VisionMoE(cfg.model, rngs=model_rngs(cfg.seed))
    if cfg.grad_accum > 1:
        routers_lib.defer_updates(model)
    return model


#: The names of the parameters weight decay applies to (the weight matrices of linear maps).
DECAYED_PARAMS = ("kernel", "w1", "w2")


def weight_decay_mask(params):
    """``params`` with each leaf replaced by True where weight decay applies.

    The rule is by role, as in big_vision (``.*/kernel$``): only the weight matrices of
    linear maps are decayed: every ``kernel`` (patch embedding, attention, dense MLPs, the
    sparse routers' W, the head) and the experts' ``w1 [E, D, H]`` and ``w2 [E, H, D]``.
    Not decayed: biases (also the experts' ``b1``, ``b2 [E, 1, H]``), LayerNorm scales and
    biases, the position embedding ``pos [1, N, D]`` and Soft MoE's ``phi`` (used only
    after l2 normalisation) and ``scale``. (nanoGPT's rule, ndim >= 2, would decay ``pos``
    and the expert biases.)
    """

    def decayed(path, _):
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        name = keys[-2] if keys[-1] == "value" else keys[-1]  # a Variable's array is its .value
        return name in DECAYED_PARAMS

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(model: VisionMoE, cfg: TrainConfig) -> nnx.Optimizer:
    """AdamW on a linear warmup, then cosine decay (or, with ``cfg.schedule="constant"``, a
    constant rate), with global-norm clipping; weight decay on the weight matrices only
    (:func:`weight_decay_mask`)."""
    tx = _transform(cfg.learning_rate, cfg.warmup_steps, cfg.steps, cfg.weight_decay, cfg.grad_clip, cfg.schedule,
                    cfg.cooldown_steps)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def learning_rate_schedule(learning_rate: float, warmup_steps: int, steps: int, schedule: str = "cosine",
                           cooldown_steps: int = 0):
    """The learning rate at each step (an optax schedule): linear from 0 to ``learning_rate`` over
    ``warmup_steps``, then a cosine decay to 1 % of it at ``steps`` (``"cosine"``) or held
    (``"constant"``: a run evaluated at several steps then gives every one of them as a budget
    with the same rate, issue 51). With ``"constant"`` and ``cooldown_steps`` > 0 the rate falls
    linearly from ``learning_rate`` at ``steps - cooldown_steps`` to 0 at ``steps``
    (warmup-stable-decay): until then it is the constant schedule, step for step."""
    if schedule == "constant":
        parts = [optax.linear_schedule(0.0, learning_rate, warmup_steps), optax.constant_schedule(learning_rate)]
        bounds = [warmup_steps]
        if cooldown_steps:
            parts.append(optax.linear_schedule(learning_rate, 0.0, cooldown_steps))
            bounds.append(steps - cooldown_steps)
        return optax.join_schedules(parts, bounds)
    return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup_steps, steps, end_value=learning_rate * 0.01)


@functools.lru_cache(maxsize=64)
def _transform(learning_rate: float, warmup_steps: int, steps: int, weight_decay: float,
               grad_clip: float, schedule: str = "cosine", cooldown_steps: int = 0) -> optax.GradientTransformation:
    """The optax transformation of :func:`make_optimizer`, one object per set of hyperparameters.

    It is stateless (its state lives in the optimizer), so runs may share it, and they should:
    the optimizer's structure holds this object, and ``nnx.jit`` caches the compiled training
    step by that structure. A new object per run would compile the same step again for every
    run of a study or every resume (measured: 9 s of a 10 s two-layer run on a 2-core EPYC).
    """
    adamw = optax.adamw(learning_rate_schedule(learning_rate, warmup_steps, steps, schedule, cooldown_steps),
                        weight_decay=weight_decay, mask=weight_decay_mask)
    return optax.chain(optax.clip_by_global_norm(grad_clip), adamw)


def load_data(cfg: TrainConfig, *, validation: int = 0):
    """Train and test splits, standardised with the training images' statistics.

    With ``validation`` > 0, returns ``(train, validation, test)``: ``validation`` images held out
    of the training split (:func:`mini_moe.data.validation_split`, the same images for every run),
    and every split standardised with the statistics of the training images that remain, so that
    no choice made on the validation split has seen the test set or itself.
    """
    train = data_lib.load(cfg.dataset, "train", data_dir=cfg.data_dir)
    test = data_lib.load(cfg.dataset, "test", data_dir=cfg.data_dir)
    held = data_lib.validation_split(train, validation) if validation else (train,)
    train_images, mean, std = data_lib.normalize(held[0].images)
    scaled = [dataclasses.replace(held[0], images=train_images)]
    scaled += [dataclasses.replace(d, images=data_lib.normalize(d.images, mean, std)[0]) for d in (*held[1:], test)]
    return tuple(scaled)


LOG_EVERY = 50  # steps between training-log rows (and the host's checks of the losses)

# --------------------------------------------------------------------- steps


def _loss_fn(model: VisionMoE, images, labels, aux_weight, mesh):
    out = model(images, mesh=mesh)
    ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, labels).mean()
    return ce + aux_weight * out.aux_loss, (ce, out)


@nnx.jit(static_argnames=("aux_weight", "mesh"))
def train_step(model, optimizer, images, labels, aux_weight: float, mesh=None):
    """One AdamW step on ``cross-entropy + aux_weight * sum of MoE auxiliary losses``
    (``mesh``: expert parallelism, see :func:`mini_moe.parallel.shard_model`)."""
    grads, (ce, out) = nnx.grad(_loss_fn, has_aux=True)(model, images, labels, aux_weight, mesh)
    optimizer.update(model, grads)
    accuracy = jnp.mean(jnp.argmax(out.logits, -1) == labels)
    return {"loss": ce, "aux_loss": out.aux_loss, "accuracy": accuracy, "router": _mean_metrics(out.metrics)}


def accumulated_grads(model, images, labels, aux_weight: float, micro_batches: int):
    """Gradient accumulation: the gradients of the training loss (``_loss_fn``) on ``images [B, ...]`` computed
    over ``micro_batches`` equal slices of whole routing groups, averaged, with the routers'
    own state (DeepSeek-V3's bias, ReMoE's lambda) updated once from the whole batch at the
    end (:meth:`~mini_moe.model.VisionMoE.apply_deferred_updates`; the routers must be in
    :func:`~mini_moe.routers.defer_updates` mode, as :func:`make_model` sets them for
    ``grad_accum > 1``). Returns ``(grads, ce, aux_loss, logits [B, classes], metrics)``, ``metrics``
    one tuple of per-layer router metrics per micro-batch.

    Equal to one step on the whole batch (up to float round-off): every routing group lies in one
    micro-batch, so routing, capacity, drops and the per-group losses are the same; the batch's
    mean loss is the mean of the micro-batches' means. What differs: random draws (router noise)
    come in another order; ReMoE's L1 penalty weights each expert by its share of one forward
    call's tokens, so here by the micro-batch's share (its gradient differs slightly; the
    controller's lambda does not, it sees the whole batch); and a loss over the whole batch
    (``balance_scope="batch"``) is refused by the configuration, since its expert counts are not
    known before the first backward pass.
    """
    size = images.shape[0] // micro_batches
    parts = lambda a: a.reshape((micro_batches, size) + a.shape[1:])
    graphdef, state = nnx.split(model)

    # One micro-batch per iteration of a scan, not an unrolled loop: XLA then holds the
    # activations of one micro-batch at a time (mini_moe/results/grad_accum_memory.py measures it).
    def one(carry, batch):
        state, grads = carry
        micro = nnx.merge(graphdef, state)
        g, (c, out) = nnx.grad(_loss_fn, has_aux=True)(micro, *batch, aux_weight, None)
        grads = jax.tree.map(jnp.add, grads, g)
        return (nnx.state(micro), grads), (c, out.aux_loss, out.logits, out.metrics)

    zeros = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
    (state, grads), (ce, aux, logits, stacked) = jax.lax.scan(one, (state, zeros), (parts(images), parts(labels)))
    nnx.update(model, state)
    metrics = [jax.tree.map(lambda m: m[i], stacked) for i in range(micro_batches)]
    model.apply_deferred_updates(metrics)
    scale = 1.0 / micro_batches
    grads = jax.tree.map(lambda g: g * scale, grads)
    return grads, jnp.sum(ce) * scale, jnp.sum(aux) * scale, logits.reshape((-1,) + logits.shape[2:]), metrics


@nnx.jit(static_argnames=("aux_weight", "micro_batches"))
def accumulated_train_step(model, optimizer, images, labels, aux_weight: float, micro_batches: int):
    """One AdamW step from :func:`accumulated_grads` (``TrainConfig.grad_accum`` micro-batches)."""
    grads, ce, aux, logits, metrics = accumulated_grads(model, images, labels, aux_weight, micro_batches)
    optimizer.update(model, grads)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    router = {k: jnp.mean(jnp.stack([_mean_metrics(m)[k] for m in metrics])) for k in _mean_metrics(metrics[0])}
    if "max_violation" in router:  # of the whole batch's load, as one step on it would report, not a mean
        loads = [sum(m[i]["pick_load"] for m in metrics) for i in range(len(metrics[0])) if "pick_load" in metrics[0][i]]
        router["max_violation"] = jnp.mean(jnp.stack([routing_lib.max_violation(load) for load in loads]))
    return {"loss": ce, "aux_loss": aux, "accuracy": accuracy, "router": router}


def _prc_loss_fn(model, view1, view2, labels, index, valid, lambdas, mesh):
    batch = view1.shape[0]
    out = model(jnp.concatenate([view1, view2]), mesh=mesh)
    ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, jnp.concatenate([labels, labels])).mean()
    prc = sum(
        losses.pairwise_router_consistency(p[:batch], p[batch:], index, valid,
                                           lambda_diag=lambdas[0], lambda_offdiag=lambdas[1])
        for p in out.probs
    )
    return ce + prc, (ce, prc, out)


@nnx.jit(static_argnames=("lambdas", "mesh"))
def prc_train_step(model, optimizer, view1, view2, labels, index, valid, lambdas: tuple, mesh=None):
    """One AdamW step on the cross-entropy of both views + the PRC loss of every MoE
    layer (paper 004), which replaces the routers' own auxiliary losses."""
    grads, (ce, prc, out) = nnx.grad(_prc_loss_fn, has_aux=True)(model, view1, view2, labels, index, valid, lambdas,
                                                                     mesh)
    optimizer.update(model, grads)
    accuracy = jnp.mean(jnp.argmax(out.logits[: view1.shape[0]], -1) == labels)
    return {"loss": ce, "aux_loss": prc, "accuracy": accuracy, "router": _mean_metrics(out.metrics)}


def _mean_metrics(per_layer) -> dict:
    """Average scalar router metrics over MoE layers."""
    if not per_layer:
        return {}
    keys = [k for k, v in per_layer[0].items() if jnp.ndim(v) == 0]
    return {k: jnp.mean(jnp.stack([m[k] for m in per_layer]).astype(jnp.float32)) for k in keys}


# ------------------------------------------------------------------ start from given weights


def _flat_values(state) -> dict:
    """``{"a.b.c": array}`` of every variable in ``state`` (random keys as their key data)."""
    out = {}
    for path, v in nnx.to_flat_state(state):
        x = v[...] if isinstance(v, nnx.Variable) else v
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out[".".join(map(str, path))] = np.asarray(x)
    return out


def state_fingerprint(state) -> str:
    """A SHA-256 of every variable of ``state`` (path, dtype, shape and bytes): what
    ``history["start"]`` records, so that a resume can tell whether it starts from the same
    weights."""
    digest = hashlib.sha256()
    for name, x in sorted(_flat_values(state).items()):
        digest.update(f"{name}:{x.dtype}:{x.shape}".encode())
        digest.update(np.ascontiguousarray(x).tobytes())
    return digest.hexdigest()


def _init_source(init_from) -> tuple[Any, dict]:
    """``(state, description)`` of ``train``'s ``init_from``: a model, its ``nnx.state``, or a run
    folder (its newest checkpoint; :func:`load_trained` a model for another one)."""
    if isinstance(init_from, VisionMoE):
        return nnx.state(init_from), {"model": json.loads(json.dumps(dataclasses.asdict(init_from.cfg)))}
    if isinstance(init_from, nnx.State):
        return init_from, {"state": "an nnx.State passed to train()"}
    if isinstance(init_from, (str, os.PathLike)):
        folder = pathlib.Path(init_from)
        model, saved = load_trained(folder)
        step = runs.kept_steps(folder)[-1]
        return nnx.state(model), {"run": str(folder.resolve()), "step": step}
    raise InputError(f"init_from must be a VisionMoE, an nnx.State of one, or a run folder, got "
                     f"{type(init_from).__name__}.")


def load_trained(out_dir, step: int | None = None) -> tuple[VisionMoE, TrainConfig]:
    """``(model, cfg)``: the model of a finished (or interrupted) run from its folder, at its newest
    checkpoint or at checkpoint ``step`` (one the run kept: ``TrainConfig.keep_every``), on one
    device, also for a run trained with a mesh; in eval mode. The folder is read by
    :mod:`mini_moe.runs`: a damaged one is an ``InputError`` naming the file."""
    out_dir = pathlib.Path(out_dir)
    cfg = runs.read_config(out_dir)
    try:
        model = make_model(cfg)
    except InputError as e:
        raise InputError(f"{out_dir / runs.CONFIG}: {e}") from None
    steps = runs.kept_steps(out_dir)
    if not steps:
        raise InputError(f"No checkpoint in {out_dir / runs.CHECKPOINTS}; train first (python -m mini_moe train).")
    if step is not None and step not in steps:
        raise InputError(f"step={step} is not among the checkpoints kept in {out_dir / runs.CHECKPOINTS} "
                         f"({steps}); train with keep_every dividing it.")
    runs.restore(out_dir, steps[-1] if step is None else step, model, make_optimizer(model, cfg))
    model.eval()
    return model, cfg


def start_from(model: VisionMoE, state) -> None:
    """Copy ``state`` (every variable of a model: parameters, router state, RNG streams) into
    ``model``, after checking that both hold the same variables with the same shapes and dtypes;
    an :class:`~mini_moe.validate.InputError` names the first that differs."""
    have, given = _flat_values(nnx.state(model)), _flat_values(state)
    for name in sorted(have.keys() | given.keys()):
        if name not in given:
            raise InputError(f"init_from has no variable {name} {have[name].shape}, which the model of the "
                             f"configuration has (a model of another architecture or router?).")
        if name not in have:
            raise InputError(f"init_from has a variable {name} {given[name].shape} that the model of the "
                             f"configuration lacks (a model of another architecture or router?).")
        if (have[name].shape, have[name].dtype) != (given[name].shape, given[name].dtype):
            raise InputError(f"init_from's {name} has shape {given[name].shape} ({given[name].dtype}); the model "
                             f"of the configuration needs {have[name].shape} ({have[name].dtype}).")

    def fresh(x):  # the value as a new array, as a model built by make_model holds it: not committed to
        # a device (a restored or copied one is), so the training step compiled for a run of the same
        # configuration from its seed serves this run too
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(jnp.asarray(np.asarray(jax.random.key_data(x))), impl=jax.random.key_impl(x))
        return jnp.asarray(np.asarray(x))

    nnx.update(model, jax.tree.map(fresh, state))


# ---------------------------------------------------------------------- train


def batch_at(dataset, cfg: TrainConfig, step: int):
    """The training batch of ``step``, a function of (seed, step) only: ``(images,
    labels)``, or with PRC ``(view1, view2, labels, index, valid)``."""
    per_epoch = data_lib.num_batches(len(dataset.labels), cfg.batch_size)
    if per_epoch < 1:
        raise InputError(f"batch_size={cfg.batch_size} is larger than the training set ({len(dataset.labels)}).")
    epoch, index = divmod(step, per_epoch)
    images, labels = next(data_lib.batches(dataset, cfg.batch_size, seed=cfg.seed, epoch=epoch, start=index))
    rng = np.random.default_rng((cfg.seed, step))
    size = images.shape[1]
    if cfg.prc:  # two views, the higher-resolution one first, and their correspondences
        v1, t1 = augment.random_resized_crop(rng, images, out_size=size)
        v2, t2 = augment.random_resized_crop(rng, images, out_size=size)
        v1, t1, v2, t2 = evaluate.order_views(v1, t1, v2, t2, out_size=size)
        index, valid = augment.patch_correspondence(t1, t2, out_size1=size, out_size2=size,
                                                     patch_size=cfg.model.patch_size)
        return (v1, v2, labels, index, valid)
    if cfg.augment:
        images, _ = augment.random_resized_crop(rng, images, out_size=size)
    return images, labels


def _step(model, optimizer, batch, cfg: TrainConfig, mesh=None):
    if mesh is None:
        batch = tuple(jnp.asarray(a) for a in batch)
    else:  # split every array's batch axis over the devices
        batch = tuple(jax.device_put(a, parallel.batch_sharding(mesh)) for a in batch)
    if cfg.prc:
        return prc_train_step(model, optimizer, *batch, lambdas=(cfg.prc_lambda_diag, cfg.prc_lambda_offdiag),
                              mesh=mesh)
    if cfg.grad_accum > 1:
        return accumulated_train_step(model, optimizer, *batch, aux_weight=cfg.aux_loss_weight,
                                      micro_batches=cfg.grad_accum)
    return train_step(model, optimizer, *batch, aux_weight=cfg.aux_loss_weight, mesh=mesh)


def steps_for_budget(cfg: TrainConfig, seconds: float, *, datasets=None, probe_steps: int = 30) -> int:
    """How many steps of ``cfg`` fit in ``seconds`` of training on this machine.

    Times ``probe_steps`` training steps (after ``warmup_steps`` untimed ones: compilation and
    the first, slower steps) on a throw-away model and divides. ``python -m mini_moe train
    --minutes M`` uses it to size the warmup + cosine schedule to the time budget, so the
    learning rate has decayed when the time is up instead of being cut off at its peak.
    """
    warmup_steps = 5
    if not seconds > 0:
        raise InputError(f"seconds must be > 0, got {seconds!r}.")
    train_ds = (datasets if datasets is not None else load_data(cfg))[0]
    model = make_model(cfg)
    optimizer = make_optimizer(model, cfg)
    model.train()
    for step in range(warmup_steps + probe_steps):
        if step == warmup_steps:
            tick = time.perf_counter()
        float(_step(model, optimizer, batch_at(train_ds, cfg, step), cfg)["loss"])
    per_step = (time.perf_counter() - tick) / probe_steps
    return max(1, int(seconds / per_step))


def budget_config(cfg: TrainConfig, seconds: float, *, out_dir=None, datasets=None) -> TrainConfig:
    """``cfg`` with its schedule sized to ``seconds`` of training (:func:`steps_for_budget`)
    and ``max_seconds=seconds``. If ``out_dir`` holds a started run, its recorded steps are
    kept, so resuming does not re-measure and change the schedule."""
    if out_dir is not None and (pathlib.Path(out_dir) / runs.CONFIG).exists():
        steps = runs.read_config(out_dir).steps
    else:
        steps = steps_for_budget(cfg, seconds, datasets=datasets)
    return dataclasses.replace(
        cfg, steps=steps, max_seconds=float(seconds), warmup_steps=min(cfg.warmup_steps, steps // 10),
        eval_every=min(cfg.eval_every, steps), checkpoint_every=min(cfg.checkpoint_every, steps),
    )


def _check_start(out_dir, saved, wanted) -> None:
    """Refuse to resume the checkpoints in ``out_dir`` when their run started otherwise than this
    call asks (``history["start"]``: None for a run from ``cfg.seed``'s initialisation at step 0)."""
    key = lambda record: None if record is None else (record["step"], record["fingerprint"])
    if key(saved) != key(wanted):
        def say(record):
            return ("from cfg.seed's initialisation at step 0" if record is None else
                    f"at step {record['step']} from {record['from']} (weights {record['fingerprint'][:12]})")
        raise InputError(f"{out_dir} holds checkpoints of a run that started {say(saved)}; this call starts "
                         f"{say(wanted)}. Pass the same init_from and start_step (or branch_from) to resume it, or use another "
                         "out_dir, or resume=False to replace it.")


#: The fields in which a branch may differ from the run it is cut from (train's ``branch_from``):
#: its length and cooldown, and how often it evaluates, checkpoints and keeps checkpoints.
BRANCH_MAY_CHANGE = ("steps", "cooldown_steps", "keep_every", "checkpoint_every", "eval_every")


def _branch_source(branch_from, cfg: TrainConfig):
    """``(folder, step, manager)`` of ``train``'s ``branch_from``, after checking that the run in
    ``folder`` kept checkpoint ``step`` and that up to it that run and ``cfg`` are the same run: the
    same configuration but for :data:`BRANCH_MAY_CHANGE`, and the same rate at every step before
    ``step`` (both constant there)."""
    if not (isinstance(branch_from, (tuple, list)) and len(branch_from) == 2):
        raise InputError(f"branch_from must be (run folder, kept step), got {branch_from!r}.")
    folder, step = pathlib.Path(branch_from[0]), branch_from[1]
    if not (folder / runs.CONFIG).exists():
        raise InputError(f"branch_from: {folder} holds no run (no config.json); train the constant-rate run first.")
    source = runs.read_config(folder)
    a, b = runs.as_saved(source), runs.as_saved(cfg)
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k not in BRANCH_MAY_CHANGE)
    if differ:
        raise InputError(f"branch_from: the run in {folder} differs from this configuration in {', '.join(differ)}; "
                         f"a branch may change only {', '.join(BRANCH_MAY_CHANGE)}.")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 < step < cfg.steps:
        raise InputError(f"branch_from's step must be an integer in (0, steps={cfg.steps}), got {step!r}.")
    if cfg.schedule != "constant" or step > min(cfg.steps - cfg.cooldown_steps, source.steps - source.cooldown_steps):
        raise InputError(f"branch_from: step {step} must lie where both runs hold the same constant rate "
                         f"(schedule='constant', step <= steps - cooldown_steps in both), got schedule="
                         f"{cfg.schedule!r}, steps={cfg.steps}, cooldown_steps={cfg.cooldown_steps} here and "
                         f"steps={source.steps}, cooldown_steps={source.cooldown_steps} there.")
    manager = runs.checkpoints(folder, source.keep_every)
    if step not in manager.all_steps():
        raise InputError(f"branch_from: {folder} did not keep step {step} (it holds {sorted(manager.all_steps())}); "
                         "train it with keep_every dividing that step.")
    return folder, step, manager


def plateaued(evals: list[dict], patience: int, min_delta: float) -> bool:
    """The early-stopping rule of :class:`~mini_moe.config.TrainConfig` (``patience`` > 0) on the
    evaluations so far (``[{"step", "test_accuracy"}]``, the accuracy on the run's evaluation
    split): the best accuracy up to the last evaluation is not ``min_delta`` above the best up to
    ``patience`` steps before it. False while no evaluation is that old."""
    if not patience or not evals:
        return False
    step = evals[-1]["step"]
    before = [e["test_accuracy"] for e in evals if e["step"] <= step - patience]
    return bool(before) and not max(e["test_accuracy"] for e in evals) >= max(before) + min_delta


def train(cfg: TrainConfig, out_dir, *, resume: bool = True, progress: bool = True, datasets=None,
          init_from=None, start_step: int = 0, branch_from=None, measure=None, measure_at=()) -> dict:
    """Train ``cfg`` into ``out_dir``; returns the history (also written as JSON).

    Args:
      cfg: the run's configuration.
      out_dir: folder for config, checkpoints and history.
      resume: True: continue from the newest checkpoint in ``out_dir`` if there is one.
        False: start a new run, replacing any run already in ``out_dir`` (once the data
        and model are ready, its checkpoints and history are deleted, its config replaced).
      progress: show a progress bar.
      datasets: optional ``(train, test)`` already loaded and standardised.
      init_from: None (the model of ``cfg.seed``), or the weights a new run starts from: a
        :class:`~mini_moe.model.VisionMoE` (e.g. :func:`mini_moe.upcycle.upcycle`'s), its
        ``nnx.state``, or a run folder (its newest checkpoint). Every variable is copied (also
        the RNG streams and router state); they must match ``cfg.model``'s variables in path,
        shape and dtype, else an ``InputError`` names the first that differs. The optimizer
        starts fresh (warm-up included). ``history["start"]`` records ``step``, ``from`` and a
        ``fingerprint`` of the weights (:func:`state_fingerprint`). A folder with checkpoints is
        resumed only when its recorded start is this one (same weights and ``start_step``; no
        record and no ``init_from`` for a plain run); anything else is an ``InputError``, never a
        silent reuse of the old run.
      start_step: the first step this run trains (with ``init_from`` only): it trains steps
        ``start_step, ..., cfg.steps - 1`` on the batches of those steps (:func:`batch_at`),
        and its checkpoints and logs are numbered by them. The learning-rate schedule counts
        the optimizer's own updates from 0: a ``"cosine"`` schedule would end at
        ``cfg.steps - start_step`` updates unfinished, so use ``schedule="constant"``.
      branch_from: ``(run_folder, step)``: continue that run from its kept checkpoint ``step`` (its
        weights, optimizer state and step count) into ``out_dir`` under ``cfg``, which may differ
        from the run's configuration only in :data:`BRANCH_MAY_CHANGE`, where both hold the same
        constant rate up to ``step``. A cooldown branch: a constant-rate run with ``keep_every``,
        branched at 80 % of a budget B with ``steps=B, cooldown_steps=B // 5``, is that budget
        annealed, step for step the run that had annealed from the start. ``history["start"]``
        records it as ``init_from`` does, so the branch resumes from its own checkpoints.
      measure, measure_at: ``measure(step, model)`` is called when ``step`` training steps are
        done, for each ``step`` in ``measure_at`` (also ``start_step``: before the first
        update of a new run), outside the training clock; ``model`` is the live model in
        training mode, so measure it under :func:`mini_moe.modes.eval_mode` and leave it as
        it is. A resumed run measures again the steps after its checkpoint.
    """
    out_dir = pathlib.Path(out_dir)
    config_path = out_dir / runs.CONFIG
    history_path = out_dir / runs.HISTORY
    if resume:
        check_saved_config(out_dir, cfg)
    if isinstance(start_step, bool) or not isinstance(start_step, int) or not 0 <= start_step < cfg.steps:
        raise InputError(f"start_step must be an integer in [0, steps={cfg.steps}), got {start_step!r}.")
    if branch_from is not None and (init_from is not None or start_step):
        raise InputError("branch_from continues another run from its checkpoint; pass it without init_from "
                         "and start_step.")
    if start_step and init_from is None:
        raise InputError("start_step > 0 needs init_from: the weights that step starts from.")
    branch = None if branch_from is None else _branch_source(branch_from, cfg)
    train_ds, test_ds = datasets if datasets is not None else load_data(cfg)
    model = make_model(cfg)  # data and model first: a failed start leaves out_dir untouched
    wanted_start = None
    if init_from is not None:
        state, source = _init_source(init_from)
        start_from(model, state)
        wanted_start = {"step": start_step, "from": source, "fingerprint": state_fingerprint(state)}
    optimizer = make_optimizer(model, cfg)
    if branch is not None:  # the weights, Adam's moments and its step count, as the run kept them
        folder, start_step, source_manager = branch
        restore_checkpoint(source_manager, model, optimizer, start_step)
        wanted_start = {"step": start_step, "from": {"branch": str(folder.resolve()), "step": start_step},
                        "fingerprint": state_fingerprint(nnx.state(model)) + state_fingerprint(nnx.state(optimizer))}
    if not resume:  # a new run: nothing of a previous one may survive (Orbax keeps newer steps)
        shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
        history_path.unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path.write_text(json.dumps(config_to_json(cfg), indent=2))
    mesh = None
    if cfg.mesh is not None:  # experts sharded over the devices, the batch split over all of them
        mesh = parallel.make_mesh(*cfg.mesh)
        parallel.shard_model(model, mesh, optimizer)
    manager = runs.checkpoints(out_dir, cfg.keep_every)
    history = {"train": [], "eval": [], "seconds": 0.0}
    if wanted_start is not None:
        history["start"] = wanted_start
    start = start_step
    if resume and manager.latest_step() is not None:
        saved = json.loads(history_path.read_text()) if history_path.exists() else {}
        _check_start(out_dir, saved.get("start"), wanted_start)
        start = restore_checkpoint(manager, model, optimizer)
        if saved:
            history = saved
            history["train"] = [r for r in history["train"] if r["step"] <= start]
            history["eval"] = [r for r in history["eval"] if r["step"] <= start]
    model.train()

    def write_history():
        history_path.write_text(json.dumps(history, indent=1))

    if start == start_step and wanted_start is not None:
        write_history()  # the start's record precedes the run's first checkpoint
    if measure is not None and start == start_step and start in measure_at:
        measure(start, model)

    bar = tqdm(total=cfg.steps, initial=start, disable=not progress, desc=f"{cfg.model.router or 'dense'}")
    # The loop does not wait for the device after each step: steps are dispatched asynchronously
    # (JAX queues them), and the host builds the next batch while the device computes. It waits
    # only where it must read results: every LOG_EVERY steps, before an evaluation or a checkpoint,
    # and when the time budget may be spent. There the losses of all steps since the last wait are
    # checked in one transfer, so a non-finite loss stops training before any checkpoint of a bad
    # state is written: the last checkpoint on disk is always a good one.
    pending = []  # (step, stats) dispatched but not yet checked
    tick = time.perf_counter()

    def wait_and_check():
        jax.block_until_ready(pending[-1][1]["loss"])
        history["seconds"] += time.perf_counter() - tick  # training time only (no eval, no I/O)
        losses = np.asarray(jnp.stack([jnp.stack([s["loss"], s["aux_loss"]]) for _, s in pending]))
        bad = np.flatnonzero(~np.isfinite(losses).all(axis=1))
        if bad.size:
            step, (loss, aux) = pending[bad[0]][0], losses[bad[0]]
            last = manager.latest_step()
            write_history()
            bar.close()
            raise InputError(
                f"loss is not finite at step {step} (loss={loss}, aux_loss={aux}); training stopped. The last "
                f"good checkpoint is step {last} in {out_dir / 'checkpoints'}. Lower learning_rate or raise grad "
                "clipping, then resume."
            )
        pending.clear()

    for step in range(start, cfg.steps):
        if cfg.max_seconds is not None and history["seconds"] >= cfg.max_seconds:
            break  # a resumed run whose time budget was already spent
        if plateaued(history["eval"], cfg.patience, cfg.min_delta):
            break  # a resumed run that had already stopped early
        stats = _step(model, optimizer, batch_at(train_ds, cfg, step), cfg, mesh)
        pending.append((step, stats))
        done = step + 1
        log = done % LOG_EVERY == 0 or done == cfg.steps
        evaluate_now = done % cfg.eval_every == 0 or done == cfg.steps
        checkpoint_now = done % cfg.checkpoint_every == 0 or done == cfg.steps
        maybe_out_of_time = (cfg.max_seconds is not None
                             and history["seconds"] + time.perf_counter() - tick >= cfg.max_seconds)
        measure_now = measure is not None and done in measure_at
        stop = False
        if log or evaluate_now or checkpoint_now or maybe_out_of_time or measure_now:
            wait_and_check()
            stop = cfg.max_seconds is not None and history["seconds"] >= cfg.max_seconds
            if log:
                row = {"step": done, "seconds": round(history["seconds"], 2)}
                row.update({k: float(v) for k, v in stats.items() if k != "router"})
                row.update({f"router/{k}": float(v) for k, v in stats["router"].items()})
                history["train"].append(row)
                bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['accuracy']:.3f}")
            if measure_now:
                measure(done, model)
            if evaluate_now or stop:
                acc = evaluate.accuracy(model, test_ds, batch_size=cfg.eval_batch_size)
                history["eval"].append({"step": done, "seconds": round(history["seconds"], 2),
                                        "test_accuracy": acc})
                if progress:
                    bar.write(f"step {done}: test accuracy {acc:.4f}")
                stop = stop or plateaued(history["eval"], cfg.patience, cfg.min_delta)
            if checkpoint_now or stop:
                save_checkpoint(manager, done, model, optimizer)
                write_history()
            tick = time.perf_counter()
        bar.update(1)
        if stop:
            break
    bar.close()
    write_history()
    return history
