"""A training run's folder: what :func:`mini_moe.train.train` writes there, and the one way to read it back.

A run folder holds

* ``config.json``: the :class:`~mini_moe.config.TrainConfig` (:func:`config_to_json`, :func:`read_config`);
* ``checkpoints/STEP/``: Orbax checkpoints of the model and the optimizer (:func:`checkpoints`,
  :func:`save_checkpoint`, :func:`restore_checkpoint`): the newest two, and every multiple of
  ``keep_every``;
* ``history.json``: the training curves, written by ``train``.

``train`` (resume, ``init_from``, ``branch_from``, :func:`mini_moe.train.load_trained`), ``diagnose_run``,
the explorer and the CLI all read a folder through :func:`read_config`, :func:`kept_steps` and
:func:`restore` (this module builds no model: ``train`` does), so a
damaged folder gives the same :class:`~mini_moe.validate.InputError` everywhere, naming the file and
what is wrong with it: unreadable, truncated, an unknown key, arrays of another configuration. A
``config.json`` written before a field was added to the configuration reads with that field's
default (each new field defaults to the old behaviour); if the default does not fit the stored
arrays, the error names the missing key.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from mini_moe.config import TrainConfig
from mini_moe.model import ModelConfig
from mini_moe.validate import InputError

CONFIG, HISTORY, CHECKPOINTS = "config.json", "history.json", "checkpoints"


# ------------------------------------------------------------------ config.json


def config_to_json(cfg: TrainConfig) -> dict:
    """``cfg`` as the JSON object ``config.json`` holds."""
    return dataclasses.asdict(cfg)


def config_from_json(obj: dict) -> TrainConfig:
    """The configuration of a ``config.json`` object (lists back to the tuples the dataclasses hold)."""
    model = dict(obj["model"])
    model["router_kwargs"] = tuple(tuple(kv) for kv in model.get("router_kwargs", ()))
    model["null_experts"] = tuple(model.get("null_experts", ()))
    mesh = None if obj.get("mesh") is None else tuple(obj["mesh"])
    return TrainConfig(**{**obj, "model": ModelConfig(**model), "mesh": mesh})


def as_saved(cfg: TrainConfig) -> dict:
    """``cfg`` as it reads back from config.json (tuples become lists): what a resume compares."""
    return json.loads(json.dumps(config_to_json(cfg)))


def _config_object(run_dir: pathlib.Path) -> dict:
    path = run_dir / CONFIG
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InputError(f"{run_dir} holds no run: it has no {CONFIG} (a folder written by "
                         "'python -m mini_moe train').") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e}).") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): the file is "
                         "truncated or damaged.") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("model"), dict):
        raise InputError(f"{path}: expected an object with a 'model' object (a file written by 'train').")
    return obj


def _keys(obj: dict) -> tuple[list[str], list[str]]:
    """``(unknown, missing)`` keys of a config.json object against today's configuration."""
    wanted = ({f.name for f in dataclasses.fields(TrainConfig)} - {"model"}
              | {f"model.{f.name}" for f in dataclasses.fields(ModelConfig)})
    have = (set(obj) - {"model"}) | {f"model.{k}" for k in obj["model"]}
    return sorted(have - wanted), sorted(wanted - have)


def read_config(run_dir) -> TrainConfig:
    """The :class:`~mini_moe.config.TrainConfig` of the run in ``run_dir``, or an ``InputError``
    naming its ``config.json`` and what is wrong: missing, unreadable, not JSON (truncated), an
    unknown key (written by a newer mini_moe, or edited by hand), a value the configuration
    refuses. A key the file lacks takes its default."""
    run_dir = pathlib.Path(run_dir)
    obj = _config_object(run_dir)
    unknown, _ = _keys(obj)
    if unknown:
        raise InputError(f"{run_dir / CONFIG}: unknown key(s) {', '.join(unknown)}: it was written by another "
                         "version of mini_moe or edited by hand.")
    try:
        return config_from_json(obj)
    except (TypeError, ValueError) as e:
        raise InputError(f"{run_dir / CONFIG}: {e}") from None


def check_saved_config(run_dir, cfg: TrainConfig) -> None:
    """Refuse to reuse ``run_dir`` (resume its run, or take its results) when its ``config.json``
    was written for another configuration than ``cfg``; nothing to check when it has none.
    Compared as read back from JSON, through :func:`read_config`, so a field added to the
    configuration since the run was saved takes its default."""
    run_dir = pathlib.Path(run_dir)
    if not (run_dir / CONFIG).exists():
        return
    saved, wanted = as_saved(read_config(run_dir)), as_saved(cfg)
    if saved != wanted:
        differ = sorted(k for k in saved.keys() | wanted.keys() if saved.get(k) != wanted.get(k) and k != "model")
        differ += sorted(f"model.{k}" for k in saved["model"].keys() | wanted["model"].keys()
                         if saved["model"].get(k) != wanted["model"].get(k))
        raise InputError(f"{run_dir} holds a run with a different configuration (differs in: {', '.join(differ)}); "
                         "use another out_dir, or resume=False (--no-resume) to replace it.")


# ------------------------------------------------------------------ checkpoints


def checkpoints(run_dir, keep_every: int = 0) -> ocp.CheckpointManager:
    """The run's checkpoints (Orbax): the newest two, and with ``keep_every`` > 0 every multiple of it."""
    options = ocp.CheckpointManagerOptions(max_to_keep=2, keep_period=keep_every or None, create=True)
    return ocp.CheckpointManager((pathlib.Path(run_dir) / CHECKPOINTS).absolute(), options=options)


def kept_steps(run_dir) -> list[int]:
    """The steps of the checkpoints in ``run_dir``, oldest first (none: ``[]``)."""
    folder = pathlib.Path(run_dir) / CHECKPOINTS
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def _state(model, optimizer) -> dict:
    return {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}


def save_checkpoint(manager, step: int, model, optimizer) -> None:
    """Save model and optimizer as checkpoint ``step``; raises ``RuntimeError`` if Orbax
    does not save it (it skips a step at or below the newest one in the folder)."""
    if not manager.save(step, args=ocp.args.StandardSave(_state(model, optimizer))):
        raise RuntimeError(
            f"checkpoint step {step} was not saved: {manager.directory} already holds step "
            f"{manager.latest_step()}. Train into an empty folder, or with resume=False to replace the run."
        )
    manager.wait_until_finished()


def restore_checkpoint(manager, model, optimizer, step: int | None = None) -> int:
    """Load checkpoint ``step`` (default: newest) into model and optimizer; returns the step."""
    step = manager.latest_step() if step is None else step
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(model, optimizer))
    restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
    nnx.update(model, restored["model"])
    nnx.update(optimizer, restored["optimizer"])
    return step


def _cause(error: Exception) -> str:
    """The most specific clause of a (long, nested) TensorStore or Orbax error, and the file it names."""
    text = str(error).split("\n")[0].split(" [tensorstore_spec")[0]
    files = re.findall(r'local file "([^"]+)"', text)
    clause = text.rsplit(": ", 1)[-1].strip() or type(error).__name__
    named = files and not files[-1].endswith("/") and files[-1] not in clause
    return f"{clause}, in {files[-1]}" if named else clause


def _stored_shapes(folder: pathlib.Path) -> dict | None:
    """``{array name: shape}`` of checkpoint ``folder`` (``checkpoints/STEP``), every array read
    once with TensorStore's synchronous API, so that a truncated, missing or unreadable file is an
    ``InputError`` naming it (Orbax's asynchronous restore fails with a traceback per pending read).
    The names come from the checkpoint's plain-JSON index. None for a layout other than the
    OCDBT + zarr one Orbax writes here: then Orbax reads it alone."""
    import tensorstore as ts

    default = folder / "default"
    if not default.is_dir():
        raise InputError(f"{folder}: the checkpoint has no default/ folder: an interrupted save or copy.")
    index = default / "_METADATA"
    try:
        names = [".".join(str(k["key"]) for k in entry["key_metadata"])
                 for entry in json.loads(index.read_text())["tree_metadata"].values()]
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{index}: cannot read it ({getattr(e, 'strerror', None) or e}).") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise InputError(f"{index}: not the index of an Orbax checkpoint: it is truncated or damaged.") from None
    if not (default / "manifest.ocdbt").is_file():
        return None
    damaged = "the checkpoint is truncated, damaged or unreadable"
    store = {"driver": "ocdbt", "base": f"file://{default.absolute()}"}
    try:  # TensorStore reports every failure as a ValueError with a status
        keys = ts.KvStore.open(store).result().list().result()
    except Exception as e:
        raise InputError(f"{folder}: cannot list its arrays ({_cause(e)}): {damaged}.") from None
    if not any(key.endswith(b"/.zarray") for key in keys):
        return None  # another array format: Orbax's to read
    shapes = {}
    for name in names:
        try:
            array = ts.open({"driver": "zarr", "kvstore": {**store, "path": f"{name}/"}}, open=True, read=True).result()
            array.read().result()
        except Exception as e:
            raise InputError(f"{folder}: cannot read {name.removesuffix('.value')} ({_cause(e)}): {damaged}.") from None
        shapes[name] = tuple(array.shape)
    return shapes


def tree_key(k) -> str:
    """One step of a JAX tree path as text (a dict key, an attribute or an index)."""
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


def restore(run_dir, step: int, model, optimizer) -> None:
    """Load checkpoint ``step`` of ``run_dir`` into ``model`` and ``optimizer`` (built from its
    config.json), after reading every stored array once: an ``InputError`` names the checkpoint
    when one of its files cannot be read, when it holds other arrays than ``model`` and
    ``optimizer`` need, or when Orbax cannot restore it."""
    run_dir = pathlib.Path(run_dir)
    _check_shapes(run_dir, step, model, optimizer)
    try:
        restore_checkpoint(checkpoints(run_dir), model, optimizer, step)
    except Exception as e:  # Orbax and TensorStore errors come up as several types
        raise InputError(f"{run_dir / CHECKPOINTS / str(step)}: cannot restore it ({_cause(e)}).") from None


def _check_shapes(run_dir: pathlib.Path, step: int, model, optimizer) -> None:
    folder = run_dir / CHECKPOINTS / str(step)
    stored = _stored_shapes(folder)
    if stored is None:
        return
    expected = {".".join(tree_key(k) for k in path): None if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
                else tuple(np.shape(leaf))  # a random key is stored as its raw data
                for path, leaf in jax.tree_util.tree_flatten_with_path(_state(model, optimizer))[0]}
    def other() -> str:  # the message's start, read from config.json only when something differs
        _, missing = _keys(_config_object(run_dir))
        defaulted = f" ({run_dir / CONFIG} lacks {', '.join(missing)}, which took the default)" if missing else ""
        return f"{folder} holds another configuration than {run_dir / CONFIG}{defaulted}"

    for name, shape in expected.items():
        if name not in stored:
            raise InputError(f"{other()}: it has no {name.removesuffix('.value')}.")
        if shape is not None and stored[name] != shape:
            raise InputError(f"{other()}: {name.removesuffix('.value')} is stored as {stored[name]}, the "
                             f"configuration makes it {shape}.")
    if set(stored) - set(expected):
        raise InputError(f"{other()}: it holds {sorted(set(stored) - set(expected))[0].removesuffix('.value')}, "
                         "which the configuration does not make.")
