"""The routers package (issue 52 §5, code review D2): ``mini_moe/routers.py`` split into
``mini_moe/routers/``, which still names every object the single module named."""

import importlib
import pkgutil

import pytest

from mini_moe import routers

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
