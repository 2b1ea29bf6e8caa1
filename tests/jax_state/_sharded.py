"""Multi-device JAX scenarios, run by test_jax_sharded.py in a fresh interpreter with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the device count is fixed when jax is
first imported, so a test process that imported jax already cannot have them).

Usage: ``python _sharded.py SCENARIO DIRECTORY``; exits 0 and prints ``ok SCENARIO`` when every
check passed (any failed check is an AssertionError: a traceback and exit status 1)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import savepoint as sp
from savepoint.state.jax_arrays import JaxSource

DEVICES = np.array(jax.devices())
assert DEVICES.size == 8, f"expected 8 forced host devices, found {DEVICES.size}"
MESH8 = Mesh(DEVICES.reshape(8), ("x",))
MESH24 = Mesh(DEVICES.reshape(2, 4), ("a", "b"))
MESH4 = Mesh(DEVICES[4:].reshape(4), ("x",))  # other devices than the first four


def bits(x: Any) -> bytes:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).tobytes()


def check_same(out: Any, expected: Any, targets: Any) -> None:
    """Bit-identical leaves, each placed with its target's sharding."""
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(expected)
    for o, e, t in zip(*(jax.tree_util.tree_leaves(x) for x in (out, expected, targets))):
        if isinstance(e, jax.Array):
            assert o.dtype == e.dtype and o.shape == e.shape, (o, e)
            assert bits(o) == bits(e)
            assert o.sharding.is_equivalent_to(t.sharding, o.ndim), (o.sharding, t.sharding)
        else:
            assert o == e


def put(x: Any, mesh: Mesh, spec: P) -> Any:
    return jax.device_put(x, NamedSharding(mesh, spec))


def reshard(root: Path) -> None:
    """8 devices -> a (2, 4) mesh -> 4 other devices -> one device, bit-exact at each step;
    each distinct shard read once."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 24)).astype(np.float32)
    state = {
        "rows": put(x, MESH8, P("x", None)),
        "cols": put(x, MESH8, P(None, "x")),
        "grid": put(x, MESH24, P("a", "b")),
        "half": put(x, MESH24, P(None, "b")),  # replicated over "a": 4 distinct shards of 8
        "repl": put(x, MESH8, P()),
        "bf16": put(jnp.asarray(x, jnp.bfloat16), MESH24, P("b", "a")),
        "i8": put(jnp.asarray(rng.integers(-9, 9, (8, 2, 4)), jnp.int8), MESH24, P("a", None, "b")),
        "key": put(jax.random.split(jax.random.key(0), 8), MESH8, P("x")),
        "scalar": put(jnp.float32(2.5), MESH8, P()),
    }
    distinct = {k: len(JaxSource(v, k)._distinct()) for k, v in state.items()}
    assert distinct == {
        "rows": 8,
        "cols": 8,
        "grid": 8,
        "half": 4,
        "repl": 1,
        "bf16": 8,
        "i8": 8,
        "key": 8,
        "scalar": 1,
    }, distinct
    first = root / "from8"
    sp.save(first, state, max_file_bytes=700)  # several data files
    plain = sp.load(first)
    for k, v in state.items():
        assert isinstance(plain[k], np.ndarray) and plain[k].tobytes() == bits(v), k

    specs24 = {
        "rows": P("b", "a"),
        "cols": P("a", None),
        "grid": P(None, None),
        "half": P("a"),
        "repl": P("b", "a"),
        "bf16": P(None, "b"),
        "i8": P(None, "a", "b"),
        "key": P("b"),
        "scalar": P(),
    }
    onto24 = {k: put(jnp.zeros_like(v), MESH24, specs24[k]) for k, v in state.items()}
    out24 = sp.load(first, into=onto24)
    check_same(out24, state, onto24)

    second = root / "from24"
    sp.save(second, out24)
    onto4 = {
        k: put(jnp.zeros_like(v), MESH4, P(*(("x",) if v.ndim else ()))) for k, v in state.items()
    }
    out4 = sp.load(second, into=onto4)
    check_same(out4, state, onto4)

    one = jax.sharding.SingleDeviceSharding(DEVICES[3])
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one) for k, v in state.items()}
    out1 = sp.load(second, into=abstract)
    check_same(out1, state, abstract)


def flax_state(root: Path) -> None:
    """Sharded Flax (linen TrainState with optax adamw, NNX state) saved on 8 devices and
    restored onto a (2, 4) mesh from abstract targets; a CheckpointManager with async saves."""
    import flax.linen as nn
    import flax.nnx as nnx
    import optax
    from flax.training import train_state

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            return nn.Dense(8)(nn.relu(nn.Dense(16)(x)))

    model = MLP()
    tx = optax.adamw(1e-2)
    params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 8)))["params"]

    def shard8(x: Any) -> Any:
        return put(x, MESH8, P(None, "x") if x.ndim == 2 else P())

    state = train_state.TrainState.create(
        apply_fn=model.apply, params=jax.tree_util.tree_map(shard8, params), tx=tx
    )
    batch = put(jax.random.normal(jax.random.key(1), (16, 8)), MESH8, P("x", None))

    @jax.jit
    def step(s: Any) -> Any:
        grads = jax.grad(lambda p: jnp.mean(s.apply_fn({"params": p}, batch) ** 2))(s.params)
        return s.apply_gradients(grads=grads)

    for _ in range(2):
        state = step(state)
    assert state.opt_state[0].mu["Dense_0"]["kernel"].sharding.spec == P(None, "x")

    class Net(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.fc = nnx.Linear(8, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

    nstate = jax.tree_util.tree_map(shard8, nnx.state(Net(nnx.Rngs(3))))
    saved = {"linen": state, "nnx": nstate}
    sp.save(root / "flax", saved)

    def abstract(x: Any) -> Any:
        spec = P("a", "b") if x.ndim == 2 else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(MESH24, spec))

    target = jax.tree_util.tree_map(abstract, {"linen": state, "nnx": nstate})
    out = sp.load(root / "flax", into=target)
    check_same(out, saved, target)
    assert isinstance(out["nnx"], nnx.State)
    assert out["linen"].opt_state[0].mu["Dense_1"]["kernel"].sharding.spec == P("a", "b")
    # restored onto the shardings it was saved with, training goes on exactly as from the
    # saved state (on another mesh XLA may sum in another order: equal values, not bits)
    same_place = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    back = sp.load(root / "flax", into={"linen": same_place}, keys="linen")["linen"]
    assert bits(step(back).params["Dense_1"]["kernel"]) == bits(
        step(state).params["Dense_1"]["kernel"]
    )

    holder = {"train": state}
    with sp.CheckpointManager(root / "run", async_save=True, keep_last=2) as mgr:
        for n in range(1, 4):
            holder["train"] = step(holder["train"])
            mgr.save(n, holder)
        mgr.wait()
    into = {"train": jax.tree_util.tree_map(abstract, state)}
    with sp.CheckpointManager(root / "run") as mgr:
        assert mgr.restore(into) == 3
    check_same(into, holder, {"train": jax.tree_util.tree_map(abstract, state)})


def prop(root: Path) -> None:
    """Hypothesis: any array on any mesh and spec, saved, loads onto any other bit-exactly; a
    sharded array's source gives the bytes of any range of its C-order image."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    meshes = [MESH8, MESH24, MESH4, Mesh(DEVICES.reshape(2, 2, 2), ("p", "q", "r"))]

    @st.composite
    def placed(draw: Any) -> tuple[np.ndarray[Any, Any], NamedSharding]:
        mesh = draw(st.sampled_from(meshes))
        ndim = draw(st.integers(0, 3))
        names = list(mesh.axis_names)
        spec: list[Any] = []
        shape = []
        for _ in range(ndim):
            name = draw(st.sampled_from([None, *names]))
            if name is not None:
                names.remove(name)
            size = mesh.shape[name] if name is not None else 1
            shape.append(size * draw(st.integers(1, 3)))
            spec.append(name)
        dtype = draw(st.sampled_from(["float32", "bfloat16", "int16", "uint8", "bool"]))
        raw = np.frombuffer(
            draw(st.binary(min_size=int(np.prod(shape)) * 4, max_size=int(np.prod(shape)) * 4)),
            dtype=np.uint8,
        )
        host = (
            (raw[: int(np.prod(shape))] % 2 == 1).reshape(shape)
            if dtype == "bool"
            else (
                raw[: int(np.prod(shape)) * jnp.dtype(dtype).itemsize]
                .view(jnp.dtype(dtype))
                .reshape(shape)
            )
        )
        return host, NamedSharding(mesh, P(*spec))

    counter = iter(range(10**6))

    @settings(max_examples=30, deadline=None, database=None)
    @given(a=placed(), b=placed(), data=st.data())
    def round_trip(a: Any, b: Any, data: Any) -> None:
        host, sharding = a
        arr = jax.device_put(host, sharding)
        image = host.tobytes()
        source = JaxSource(arr, "a")
        start = data.draw(st.integers(0, len(image)))
        stop = data.draw(st.integers(start, len(image)))
        dst = np.empty(stop - start, dtype=np.uint8)
        source.copy_to(dst, start)
        assert dst.tobytes() == image[start:stop]
        path = root / f"p{next(counter)}"
        sp.save(path, {"a": arr})
        _, other = b
        if (
            other.mesh.shape
            and len(other.spec) <= host.ndim
            and all(
                n is None or host.shape[i] % other.mesh.shape[n] == 0
                for i, n in enumerate(other.spec)
            )
        ):
            target = jax.device_put(jnp.zeros(host.shape, host.dtype), other)
        else:
            target = jnp.zeros(host.shape, host.dtype)
        out = sp.load(path, into={"a": target})["a"]
        assert np.asarray(out).tobytes() == image and out.sharding == target.sharding

    round_trip()


SCENARIOS = {"reshard": reshard, "flax": flax_state, "property": prop}

if __name__ == "__main__":
    name, directory = sys.argv[1], Path(sys.argv[2])
    SCENARIOS[name](directory)
    print(f"ok {name}")
