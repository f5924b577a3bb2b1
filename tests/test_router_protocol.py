"""The routers package (issue 52 §5, code review D2): ``mini_moe/routers.py`` split into
``mini_moe/routers/``, which still names every object the single module named; and the one
protocol (:class:`mini_moe.routers.StatefulAffinity`) through which models move a router's own
state, followed by an affinity written outside the package."""

import importlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mini_moe import config as config_lib
from mini_moe import routers, train

# ``[n for n in dir(routers) if not n.startswith("_")]`` of the single module mini_moe/routers.py
# before the split (commit 6196f10): its own objects and the names it imported.
OLD_NAMES = [
    "ALLOCATIONS", "ALLOCATION_CLASSES", "Affinities", "Affinity", "Any", "Array", "Budget", "Callable", "ExpertBias",
    "ExpertChoice", "FrozenWeight", "HashProjection", "InputError", "L1Weight", "NamedTuple", "NoisySoftmax",
    "QuadraticPlan", "ROUTERS", "ReluGates", "Router", "RouterOutput", "RouterSpec", "SOFT_MOE_ABLATIONS",
    "SigmoidGates", "SinkhornPlan", "SlotLogits", "SoftRouting", "Softmax", "SparsityConstrainedPlan", "TokenChoice",
    "after_forward", "annotations", "check_int", "dataclasses", "defer_updates", "flax", "freeze", "group_limited",
    "hash_router", "jax", "jnp", "l2_normalize", "losses", "make_router", "math", "nnx", "np", "per_image", "register",
    "remoe", "routing", "sigmoid_loss_free", "sinkhorn_expert_choice", "sinkhorn_token_choice", "soft_moe",
    "softmax_expert_choice", "softmax_token_choice", "sparsity_constrained_expert_choice", "spec", "svmoe",
    "transport", "update_l1_weights",
]

SUBMODULES = sorted(m.name for m in pkgutil.iter_modules(routers.__path__))


def test_the_package_names_every_object_the_single_module_named():
    assert routers.__path__, "mini_moe.routers is a package"
    assert not [n for n in OLD_NAMES if not hasattr(routers, n)]
    namespace = {}
    exec(f"from mini_moe.routers import {', '.join(OLD_NAMES)}", namespace)  # the other way to import them
    assert all(namespace[n] is getattr(routers, n) for n in OLD_NAMES)


@pytest.mark.parametrize("submodule", SUBMODULES)
def test_every_object_of_a_submodule_is_re_exported_and_in_the_api_reference(submodule):
    module = importlib.import_module(f"mini_moe.routers.{submodule}")
    own = {name: obj for name, obj in vars(module).items()
           if not name.startswith("_") and getattr(obj, "__module__", None) == module.__name__}
    assert own, f"mini_moe.routers.{submodule} defines nothing"
    for name, obj in own.items():
        assert getattr(routers, name, None) is obj, f"routers.{name} is not mini_moe.routers.{submodule}.{name}"
        assert name in routers.__all__, f"{name} is missing from routers.__all__ (book/api.md documents __all__)"
    assert all(hasattr(routers, name) for name in routers.__all__)


def test_the_docstring_lists_every_router_of_the_library_and_every_affinity():
    ours = [name for name, spec in routers.ROUTERS.items() if spec.build.__module__.startswith("mini_moe.routers")]
    assert len(ours) >= 11 and not [name for name in ours if f"``{name}``" not in routers.__doc__]
    affinities = [name for name in routers.__all__ if isinstance(getattr(routers, name), type)
                  and issubclass(getattr(routers, name), routers.nnx.Module) and name not in ("Router", "Affinity")]
    assert "HashProjection" in affinities and "SlotLogits" in affinities
    assert not [name for name in affinities if f":class:`{name}`" not in routers.__doc__]


# ---------------------------------------------------------------- the protocol for routers' own state

NAME = "counting_test_router"
TINY = dict(steps=3, batch_size=32, eval_every=3, checkpoint_every=3, eval_batch_size=64, model_dim=16,
            model_depth=4, model_heads=2, model_mlp_dim=16, model_num_experts=4, model_group_images=4)


class Count(nnx.Variable):
    """A counter of the test's affinity: not an ``nnx.Param``, so no gradient or optimizer moves it."""


def _count(dtype=jnp.int32):
    return Count(jnp.zeros((), dtype))


class CountingSoftmax(routers.Softmax):
    """softmax(XW) with state of its own that records what moved it: a stateful affinity written
    outside the package, following :class:`mini_moe.routers.StatefulAffinity` and nothing else."""

    def __init__(self, dim, num_experts, *, deterministic=False, rngs):
        super().__init__(dim, num_experts, rngs=rngs)
        self.deterministic, self.defer = deterministic, False
        self.in_call = _count()  # training calls that moved the state themselves
        self.deferred, self.parts = _count(), _count()  # deferred_update calls; micro-batches the last one saw
        self.tokens, self.picks = _count(jnp.float32), _count(jnp.float32)  # ... and their tokens and picks
        self.model_calls, self.model_layers = _count(), _count()  # model_update calls; layers the last one saw
        self.model_tokens = _count(jnp.float32)  # tokens of this layer the last model_update saw

    def __call__(self, x, budget):
        out = super().__call__(x, budget)
        if not self.deterministic and not self.defer:
            self.in_call[...] = self.in_call[...] + 1
        tokens = jnp.asarray(np.prod(np.shape(x)[:-1]), jnp.float32)
        return out.replace(metrics={**out.metrics, "tokens": tokens})

    def deferred_update(self, metrics):
        self.deferred[...] = self.deferred[...] + 1
        self.parts[...] = jnp.asarray(len(metrics), jnp.int32)
        self.tokens[...] = sum(m["tokens"] for m in metrics)
        self.picks[...] = jnp.sum(sum(m["pick_load"] for m in metrics))  # Token Choice's picks per expert

    @classmethod
    def model_update(cls, layers):
        for affinity, metrics in layers:
            if not affinity.deterministic:
                affinity.model_calls[...] = affinity.model_calls[...] + 1
                affinity.model_layers[...] = jnp.asarray(len(layers), jnp.int32)
                affinity.model_tokens[...] = sum(m["tokens"] for m in metrics)


def counting_router(dim, num_experts, *, k=1, capacity_factor=None, deterministic=False, rngs):
    return routers.Router(CountingSoftmax(dim, num_experts, deterministic=deterministic, rngs=rngs),
                          routers.TokenChoice(k, capacity_factor))


@pytest.fixture
def counting():
    routers.register(NAME, allocation="token")(counting_router)
    yield NAME
    del routers.ROUTERS[NAME]


def _cfg(router, grad_accum, **kw):
    return config_lib.get_config("quick", dataset="digits", router=router, grad_accum=grad_accum, **TINY, **kw)


def _batch(cfg, seed):
    rng, m = np.random.default_rng(seed), cfg.model
    images = rng.normal(size=(cfg.batch_size, m.image_size, m.image_size, m.channels)).astype(np.float32)
    return jnp.asarray(images), jnp.asarray(rng.integers(0, m.num_classes, cfg.batch_size))


def _affinities(model):
    return [block.mlp.router.affinity for block in model.blocks if block.use_moe]


def _train(cfg, steps):
    model = train.make_model(cfg)
    optimizer = train.make_optimizer(model, cfg)
    for step in range(steps):
        images, labels = _batch(cfg, step)
        if cfg.grad_accum > 1:
            train.accumulated_train_step(model, optimizer, images, labels, aux_weight=cfg.aux_loss_weight,
                                         micro_batches=cfg.grad_accum)
        else:
            train.train_step(model, optimizer, images, labels, aux_weight=cfg.aux_loss_weight)
    return model


def _read(affinity):
    names = ("in_call", "deferred", "parts", "tokens", "picks", "model_calls", "model_layers", "model_tokens")
    return {name: float(getattr(affinity, name)[...]) for name in names}


def test_the_librarys_stateful_affinities_follow_the_protocol_and_the_others_do_not():
    rngs = nnx.Rngs(0)
    stateful = [routers.SigmoidGates(8, 4, rngs=rngs), routers.ReluGates(8, 4, rngs=rngs)]
    stateless = [routers.Softmax(8, 4, rngs=rngs), routers.NoisySoftmax(8, 4, rngs=rngs),
                 routers.SinkhornPlan(8, 4, rngs=rngs), routers.QuadraticPlan(8, 4, rngs=rngs),
                 routers.SparsityConstrainedPlan(8, 4, rngs=rngs), routers.SlotLogits(8, 4, rngs=rngs),
                 routers.HashProjection(8, 4, rngs=rngs)]
    assert all(isinstance(a, routers.StatefulAffinity) for a in stateful)
    assert not any(isinstance(a, routers.StatefulAffinity) for a in stateless)
    assert isinstance(CountingSoftmax(8, 4, rngs=rngs), routers.StatefulAffinity)


def test_an_outside_stateful_affinity_moves_once_per_accumulated_step_from_the_whole_batch(counting):
    cfg = _cfg(counting, grad_accum=2)
    model = _train(cfg, steps=3)
    layers = _affinities(model)
    whole = cfg.batch_size * cfg.model.num_patches  # tokens of one step's whole batch, per MoE layer
    assert len(layers) == 2 and all(a.defer for a in layers)
    for affinity in layers:
        assert _read(affinity) == dict(in_call=0, deferred=3, parts=2, tokens=whole, picks=whole,  # k = 1
                                       model_calls=3, model_layers=2, model_tokens=whole)
    # the same router without accumulation: its calls move it, and the model's step after each forward pass
    plain = _train(_cfg(counting, grad_accum=1), steps=3)
    for affinity in _affinities(plain):
        assert not affinity.defer
        assert _read(affinity) == dict(in_call=3, deferred=0, parts=0, tokens=0, picks=0,
                                       model_calls=3, model_layers=2, model_tokens=whole)
    # evaluation moves nothing
    plain.eval()
    before = [_read(a) for a in _affinities(plain)]
    plain(_batch(cfg, 9)[0])
    assert [_read(a) for a in _affinities(plain)] == before


def test_stateless_affinities_are_left_alone():
    cfg = _cfg("softmax_token_choice", grad_accum=2, model_router_kwargs={"noise_std": 0.0})
    model = train.make_model(cfg)
    assert not any(hasattr(a, "defer") for a in _affinities(model))  # defer_updates did not touch them
    images, labels = _batch(cfg, 0)
    *_, metrics = nnx.jit(train.accumulated_grads, static_argnums=(3, 4))(model, images, labels,
                                                                         cfg.aux_loss_weight, 2)
    leaves = lambda: [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
                                 else x) for x in jax.tree.leaves(nnx.state(model))]
    before = leaves()
    model.apply_deferred_updates(metrics)
    routers.after_forward([(a, m) for a, m in zip(_affinities(model), metrics[0])])
    assert all(np.array_equal(a, b) for a, b in zip(leaves(), before))
