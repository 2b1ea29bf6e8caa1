"""JAX state in this process (docs/jax.md): jax.Array leaves, PRNG keys, abstract targets, Flax
linen and NNX parameters, optax states, what a load without ``into`` gives, mismatches,
damage, refusals, CheckpointManager. Run by test_jax_state.py in a pytest of its own (a process
that ran JAX warns at every fork). Every case works on whatever devices that process has; the
multi-device ones (8 forced host devices) are in _sharded.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
linen = pytest.importorskip("flax.linen")
from flax.core import FrozenDict  # noqa: E402
from flax.training import train_state  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import savepoint as sp  # noqa: E402
from _support import one_rank_world  # noqa: E402
from savepoint.state.jax_arrays import JaxSource  # noqa: E402

pytestmark = pytest.mark.jax


def _data(x: Any) -> Any:
    """A leaf as numpy (a PRNG key as its key data), for bit comparisons."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def same(a: Any, b: Any) -> None:
    """``a`` and ``b`` are the same pytree (structure and node types) with bit-identical leaves
    of the same dtypes."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array))
        if isinstance(x, jax.Array):
            assert getattr(x, "weak_type", False) == getattr(y, "weak_type", False), (x, y)
        if isinstance(x, (jax.Array, np.ndarray)):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert _data(x).tobytes() == _data(y).tobytes()
        else:
            assert x == y


def stored(path: Path) -> dict[str, Any]:
    """The checkpoint's tensors by key (its TensorInfo)."""
    return {t.key: t for t in sp.inspect(path).tensors}


def zeros_like(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jnp.zeros_like(x) if isinstance(x, jax.Array) else x, tree
    )


# ---------------------------------------------------------------------------------------------
# arrays
# ---------------------------------------------------------------------------------------------


def _arrays() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 7)).astype(np.float32)
    return {
        "f32": jnp.asarray(x),
        "bf16": jnp.asarray(x, jnp.bfloat16),
        "f16": jnp.asarray(x, jnp.float16),
        "i8": jnp.asarray(rng.integers(-128, 127, (3, 4)), jnp.int8),
        "u32": jnp.asarray(rng.integers(0, 2**32, (6,)), jnp.uint32),
        "bool": jnp.asarray(x > 0),
        "c64": jnp.asarray(x[:2] + 1j * x[2:4], jnp.complex64),
        "scalar": jnp.float32(3.25),
        "empty": jnp.zeros((0, 3)),
        "f8": jnp.asarray(x, jnp.float8_e4m3fn),
        "weak": jnp.asarray(0.5),  # weakly typed, as a Python number made array
    }


def test_arrays_round_trip_bit_exact_with_into_and_as_numpy_without(ckpt: Path) -> None:
    state = _arrays()
    sp.save(ckpt, state)
    plain = sp.load(ckpt)
    for k, v in state.items():
        assert isinstance(plain[k], np.ndarray), k
        assert plain[k].dtype == v.dtype and plain[k].tobytes() == np.asarray(v).tobytes(), k
    into = zeros_like(state)
    out = sp.load(ckpt, into=into)
    assert out is into  # a dict root: its entries replaced
    same(out, state)
    for k in state:
        assert out[k].sharding == state[k].sharding
    # the weak type is kept, so it promotes as before: weak float32 * bfloat16 is bfloat16
    assert out["weak"].weak_type and not out["f32"].weak_type
    assert (out["weak"] * out["bf16"]).dtype == jnp.bfloat16
    assert stored(ckpt)["bf16"].dtype == "BF16"


def test_a_jax_array_at_the_root_and_tied_arrays(ckpt: Path) -> None:
    w = jnp.arange(24.0).reshape(4, 6)
    sp.save(ckpt, w)
    out = sp.load(ckpt, into=jnp.zeros((4, 6)))
    same(out, w)
    tied = ckpt.parent / "tied"
    sp.save(tied, {"embed": w, "head": w, "other": w + 0})
    tensors = stored(tied)
    assert tensors["head"].tied_to == tensors["embed"].ref  # the same jax.Array, stored once
    assert len({t.ref for t in tensors.values()}) == 2
    back = sp.load(tied)
    assert back["embed"] is back["head"]


def test_prng_keys_round_trip_as_their_key_data(ckpt: Path) -> None:
    state = {
        "key": jax.random.key(7),
        "keys": jax.random.split(jax.random.key(1), 3),
        "raw": jax.random.PRNGKey(2),  # an old-style uint32 key is a plain array
    }
    sp.save(ckpt, state)
    plain = sp.load(ckpt)
    assert plain["key"].dtype == np.uint32 and plain["key"].shape == (2,)
    assert plain["keys"].shape == (3, 2)
    into = {"key": jax.random.key(0), "keys": jax.random.split(jax.random.key(0), 3), "raw": 0}
    into["raw"] = jax.random.PRNGKey(0)
    out = sp.load(ckpt, into=into)
    same(out, state)
    assert jax.random.key_impl(out["key"]) == jax.random.key_impl(state["key"])
    # the restored key draws the same numbers
    assert np.array_equal(
        jax.random.normal(out["key"], (4,)), jax.random.normal(state["key"], (4,))
    )


def test_abstract_targets_shape_dtype_structs(ckpt: Path) -> None:
    state = {"w": jnp.arange(6.0).reshape(2, 3), "k": jax.random.key(3), "step": 4}
    sp.save(ckpt, state)
    device = jax.devices()[0]
    abstract = jax.eval_shape(lambda: state)
    abstract["w"] = jax.ShapeDtypeStruct(
        (2, 3), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device)
    )
    abstract["step"] = 0
    out = sp.load(ckpt, into=abstract)
    same(out, state)
    assert out["w"].sharding == jax.sharding.SingleDeviceSharding(device)


def test_numpy_and_python_leaves_of_a_jax_pytree(ckpt: Path) -> None:
    state = {"w": jnp.ones(3), "n": np.arange(4), "lr": 0.5, "name": "run", "none": None}
    sp.save(ckpt, state)
    n = np.zeros(4, dtype=np.int64)
    into = {"w": jnp.zeros(3), "n": n, "lr": 0.0, "name": "", "none": None}
    out = sp.load(ckpt, into=into)
    assert out["n"] is n and n.tolist() == [0, 1, 2, 3]  # a numpy leaf is filled in place
    assert out["lr"] == 0.5 and out["name"] == "run"
    same(out, state)


# ---------------------------------------------------------------------------------------------
# Flax and optax
# ---------------------------------------------------------------------------------------------


class _MLP(linen.Module):
    @linen.compact
    def __call__(self, x: Any) -> Any:
        x = linen.relu(linen.Dense(8)(x))
        return linen.Dense(2)(x)


_TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
_MODEL = _MLP()


def _linen_state(seed: int) -> Any:
    """A linen TrainState (``step`` a Python int, static ``apply_fn`` and ``tx``) and its model;
    every state shares one model and one optimizer object, as a script's would."""
    model = _MODEL
    params = model.init(jax.random.key(seed), jnp.ones((1, 3)))["params"]
    tx = _TX
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    return state, model


@jax.jit
def _train(state: Any, x: Any) -> Any:
    def loss(p: Any) -> Any:
        return jnp.mean(state.apply_fn({"params": p}, x) ** 2)

    return state.apply_gradients(grads=jax.grad(loss)(state.params))


def _step(state: Any, model: Any, seed: int) -> Any:
    return _train(state, jax.random.normal(jax.random.key(seed), (4, 3)))


def test_linen_train_state_with_optax_round_trips_to_the_same_types(ckpt: Path) -> None:
    state, model = _linen_state(0)
    for i in range(3):
        state = _step(state, model, i)
    sp.save(ckpt, {"train": state, "frozen": FrozenDict(state.params)})
    fresh, _ = _linen_state(1)
    into = {"train": fresh, "frozen": FrozenDict(fresh.params)}
    out = sp.load(ckpt, into=into)
    # A leaf's type follows the target's: TrainState.create's step is a Python int, so the
    # saved step (an int32 array once a jitted step ran) comes back as that int.
    assert type(out["train"].step) is int and out["train"].step == 3
    same(out["train"].replace(step=state.step), state)
    assert isinstance(out["frozen"], FrozenDict)
    same(out["frozen"], FrozenDict(state.params))
    # static fields come from the target; training goes on identically
    assert out["train"].apply_fn == fresh.apply_fn and out["train"].tx is fresh.tx
    same(_step(out["train"], model, 9), _step(state, model, 9))
    # optax's NamedTuples and EmptyState come back as themselves
    kinds = {
        type(s).__name__
        for s in jax.tree_util.tree_leaves(
            out["train"].opt_state, is_leaf=lambda x: isinstance(x, tuple) and hasattr(x, "_fields")
        )
    }
    assert {"EmptyState", "ScaleByAdamState"} <= kinds


def test_without_into_pytree_nodes_become_dicts_and_named_tuples_tuples(ckpt: Path) -> None:
    state, _ = _linen_state(0)
    sp.save(ckpt, state)
    plain = sp.load(ckpt)
    assert set(plain) == {"step", "params", "opt_state"}  # TrainState's pytree fields only
    assert plain["step"] == 0 and plain["params"]["Dense_0"]["kernel"].shape == (3, 8)
    clip, adamw = plain["opt_state"]
    assert type(clip) is tuple and clip == ()  # EmptyState: an empty tuple
    adam = adamw[0]
    assert type(adam) is tuple and len(adam) == 3  # ScaleByAdamState(count, mu, nu)
    assert adam[1]["Dense_1"]["bias"].shape == (2,)


class _Net(nnx.Module):
    def __init__(self, rngs: Any) -> None:
        self.fc = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        return self.out(self.drop(self.bn(nnx.relu(self.fc(x)))))


def test_nnx_state_and_optax_adam_round_trip_and_update_a_model(ckpt: Path) -> None:
    model = _Net(nnx.Rngs(0, dropout=1))
    tx = optax.adam(1e-2)
    opt_state = tx.init(nnx.state(model, nnx.Param))
    x = jnp.ones((8, 3))

    @nnx.jit
    def train(model: Any, opt_state: Any) -> Any:
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        params = nnx.state(model, nnx.Param)
        updates, opt_state = tx.update(grads, opt_state, params)
        nnx.update(model, optax.apply_updates(params, updates))
        return opt_state

    for _ in range(2):  # change params, batch stats, the dropout RNG and the optimizer
        opt_state = train(model, opt_state)
    _, saved = nnx.split(model)
    sp.save(ckpt, {"model": saved, "opt": opt_state})
    assert "model/fc/kernel/value" in stored(ckpt)

    other = _Net(nnx.Rngs(5, dropout=6))
    graph, state = nnx.split(other)
    into = {"model": state, "opt": tx.init(nnx.state(other, nnx.Param))}
    out = sp.load(ckpt, into=into)
    assert isinstance(out["model"], nnx.State)
    same(out, {"model": saved, "opt": opt_state})
    restored = nnx.merge(graph, out["model"])
    restored.train()
    model.train()
    # the same parameters, batch statistics and dropout stream: the same outputs
    assert np.array_equal(restored(x), model(x))


def test_nnx_abstract_model_restores_without_allocating_it_first(ckpt: Path) -> None:
    model = _Net(nnx.Rngs(3))
    sp.save(ckpt, nnx.state(model))
    abstract = nnx.eval_shape(lambda: _Net(nnx.Rngs(0)))
    graph, shapes = nnx.split(abstract)
    loaded = sp.load(ckpt, into=shapes)
    assert loaded is shapes  # an nnx.State root: its entries replaced
    restored = nnx.merge(graph, loaded)
    same(nnx.state(restored), nnx.state(model))


def test_optax_states_of_several_kinds(ckpt: Path) -> None:
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    txs = [
        optax.sgd(0.1, momentum=0.9),
        optax.chain(optax.clip(1.0), optax.scale_by_adam(), optax.scale(-1e-3)),
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
        optax.masked(optax.adam(1e-3), {"w": True, "b": False}),
    ]
    for i, tx in enumerate(txs):
        s = tx.init(params)
        s = tx.update(params, s, params)[1]
        path = ckpt.parent / f"opt{i}"
        sp.save(path, s)
        out = sp.load(path, into=zeros_like(tx.init(params)))
        same(out, s)


# ---------------------------------------------------------------------------------------------
# what goes wrong
# ---------------------------------------------------------------------------------------------


def test_mismatches_are_reported_before_anything_is_read(ckpt: Path) -> None:
    sp.save(ckpt, {"w": jnp.ones((2, 3)), "b": jnp.ones(3)})
    n = np.full(3, 7.0)
    with pytest.raises(sp.errors.StateMismatchError) as err:
        sp.load(ckpt, into={"w": jnp.zeros((3, 2)), "b": n, "c": jnp.zeros(1)})
    text = str(err.value)
    assert "w: shape [2, 3] in the checkpoint, [3, 2] in the target" in text
    assert "c: not in the checkpoint" in text
    assert n.tolist() == [7.0] * 3  # nothing modified
    with pytest.raises(sp.errors.StateMismatchError, match="dtype F32 in the checkpoint, BF16"):
        sp.load(ckpt, into={"w": jnp.zeros((2, 3), jnp.bfloat16)})


def test_an_optimizer_chain_of_another_length_is_a_mismatch(ckpt: Path) -> None:
    params = {"w": jnp.ones(3)}
    chain = optax.chain(optax.clip(1.0), optax.adam(1e-3))
    sp.save(ckpt, {"opt": chain.init(params), "n": np.ones(2)})
    n = np.zeros(2)
    into = {"opt": optax.adam(1e-3).init(params), "n": n}
    with pytest.raises(sp.errors.StateMismatchError, match="items in the checkpoint"):
        sp.load(ckpt, into=into)
    assert n.tolist() == [0.0, 0.0]  # the numpy leaf is only written once everything fits


def test_a_damaged_checkpoint_raises_and_changes_nothing(
    ckpt: Path, flip_byte: Callable[..., None]
) -> None:
    sp.save(ckpt, {"w": jnp.arange(64.0), "n": np.arange(3.0)})
    flip_byte(ckpt, "w", 5)
    n = np.zeros(3)
    with pytest.raises(sp.errors.CorruptCheckpointError, match="w"):
        sp.load(ckpt, into={"w": jnp.zeros(64), "n": n}, verify="first")
    assert n.tolist() == [0.0] * 3
    with pytest.raises(sp.errors.CorruptCheckpointError):
        sp.load(ckpt, into={"w": jnp.zeros(64)})
    with pytest.raises(sp.errors.CorruptCheckpointError):
        sp.verify(ckpt)


def test_refusals(ckpt: Path) -> None:
    def inside(x: Any) -> Any:
        sp.save(ckpt, {"x": x})
        return x

    with pytest.raises(sp.errors.UnsupportedStateError, match="traced jax value"):
        jax.jit(inside)(jnp.ones(2))
    gone = jnp.ones(3)
    gone.delete()
    with pytest.raises(sp.errors.UnsupportedStateError, match="deleted"):
        sp.save(ckpt, {"x": gone})
    assert not ckpt.exists()
    sp.save(ckpt, {"x": jnp.ones(2)})
    with one_rank_world() as dist:
        with pytest.raises(sp.errors.UnsupportedStateError, match="process_group"):
            sp.load(ckpt, into={"x": jnp.ones(2)}, process_group=dist.group.WORLD)


# ---------------------------------------------------------------------------------------------
# CheckpointManager
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpoint_manager_saves_and_restores_a_jax_state(
    tmp_path: Path, async_save: bool
) -> None:
    state, model = _linen_state(0)
    holder = {"train": state, "key": jax.random.key(4)}
    with sp.CheckpointManager(tmp_path / "run", keep_last=2, async_save=async_save) as mgr:
        for step in range(1, 4):
            holder["train"] = _step(holder["train"], model, step)
            mgr.save(step, holder, metrics={"loss": float(step)})
        mgr.wait()
        expected = dict(holder)
    fresh, _ = _linen_state(1)
    into = {"train": fresh, "key": jax.random.key(0)}
    with sp.CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.restore(into) == 3
    # the dict's entries were replaced by the restored state (step: an int, as in the target)
    assert into["train"].step == 3
    into["train"] = into["train"].replace(step=expected["train"].step)
    same(into, expected)


# ---------------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------------

_DTYPES = ["float32", "bfloat16", "float16", "int32", "uint8", "bool", "int8"]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    dtype=st.sampled_from(_DTYPES),
    seed=st.integers(0, 2**16),
)
def test_property_round_trip(tmp_path: Path, shape: list[int], dtype: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(jnp.dtype(dtype)).itemsize)
    host = (
        raw.astype(np.uint8).view(jnp.dtype(dtype)).reshape(shape)
        if dtype != "bool"
        else (raw.astype(np.uint8).reshape(shape) % 2 == 1)
    )
    arr = jnp.asarray(host)
    path = tmp_path / f"p{seed}-{dtype}-{'x'.join(map(str, shape))}"
    sp.save(path, {"a": arr, "t": (arr, seed)})
    out = sp.load(path, into={"a": jnp.zeros_like(arr), "t": (jnp.zeros_like(arr), 0)})
    assert np.asarray(out["a"]).tobytes() == host.tobytes()
    assert out["t"][0] is not out["a"] and out["t"][1] == seed
    assert sp.load(path)["a"].tobytes() == host.tobytes()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_property_source_bytes_at_any_offset(data: st.DataObject) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)))
    dtype = data.draw(st.sampled_from(["float32", "bfloat16", "int8", "complex64"]))
    arr = jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape).astype(dtype)
    image = np.asarray(arr).tobytes()
    source = JaxSource(arr, "a")
    start = data.draw(st.integers(0, len(image)))
    stop = data.draw(st.integers(start, len(image)))
    dst = np.empty(stop - start, dtype=np.uint8)
    source.copy_to(dst, start)
    assert dst.tobytes() == image[start:stop]
    source.release()


# ---------------------------------------------------------------------------------------------
# an ordinary checkpoint; the edges of what is supported
# ---------------------------------------------------------------------------------------------


def test_a_jax_checkpoint_is_an_ordinary_one(tmp_path: Path) -> None:
    state = {"w": jnp.arange(4096.0).reshape(64, 64), "k": jax.random.key(2), "n": 3}
    first = tmp_path / "incremental"
    sp.save(first, state, blobs=tmp_path / "blobs")  # the tensors go to the blob store
    assert sp.inspect(first).format_version == 4
    sp.verify(first)
    copied = tmp_path / "copied"
    sp.copy(first, copied)
    out = sp.load(copied, into={"w": jnp.zeros((64, 64)), "k": jax.random.key(0), "n": 0})
    same(out, state)
    listed = sp.load(copied, keys=["w"])
    assert listed["w"].tobytes() == np.asarray(state["w"]).tobytes()


def test_a_list_root_is_replaced_in_place(ckpt: Path) -> None:
    sp.save(ckpt, [jnp.ones(2), jnp.full(3, 2.0)])
    into = [jnp.zeros(2), jnp.zeros(3)]
    assert sp.load(ckpt, into=into) is into
    assert into[1].tolist() == [2.0, 2.0, 2.0]


class _Holder:
    """A Stateful whose state_dict holds a jax.Array."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.loaded: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def test_jax_arrays_inside_a_stateful_come_back_as_numpy(ckpt: Path) -> None:
    sp.save(ckpt, {"obj": _Holder(jnp.arange(3.0))})
    holder = _Holder(jnp.zeros(3))
    sp.load(ckpt, into={"obj": holder})
    assert isinstance(holder.loaded["w"], np.ndarray)
    assert holder.loaded["w"].tolist() == [0.0, 1.0, 2.0]


def test_dict_keys_of_mixed_types(ckpt: Path) -> None:
    """savepoint stores {0: ..., "a": ...}; JAX cannot flatten it (it sorts dict keys): with
    jax imported, a numpy load into such a dict still works, and a jax one is refused."""
    sp.save(ckpt, {0: np.ones(2), "a": jnp.ones(3)})
    into = {0: np.zeros(2), "a": np.zeros(3, np.float32)}
    sp.load(ckpt, into=into)
    assert into[0].tolist() == [1.0, 1.0] and into["a"].tolist() == [1.0] * 3
    with pytest.raises(sp.errors.UnsupportedStateError, match="dict keys must be of one type"):
        sp.load(ckpt, into={0: np.zeros(2), "a": jnp.zeros(3)})


def test_an_array_spread_over_processes_is_refused() -> None:
    class Spread:  # what a jax.Array of jax.distributed looks like to this process
        dtype = jnp.float32
        shape = (4,)
        is_fully_addressable = False

        def is_deleted(self) -> bool:
            return False

    with pytest.raises(sp.errors.UnsupportedStateError, match="several processes"):
        JaxSource(Spread(), "w")


def test_the_examples_of_docs_jax_md_run(tmp_path: Path) -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "jax.md"
    blocks = re.findall(r"^```python[^\n]*\n(.*?)^```", doc.read_text("utf-8"), re.M | re.S)
    assert len(blocks) == 2
    script = tmp_path / "blocks.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert sp.CheckpointManager(tmp_path / "run", read_only=True).latest_step() == 20
