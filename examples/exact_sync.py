"""Replicas after a synchronization: `optax.apply_updates` vs `optaxdist.apply_updates`.

4 simulated replicas, a 64×32 weight, momentum SGD, a different gradient on each replica, 6 steps
with period 2 (the last step is a sync). Prints, per transform and parameter dtype, how many of the
2,048 elements differ between replicas and the largest spread, with each way of applying the update
(docs/bit-identical.md).

    python examples/exact_sync.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optaxdist as od

comm = od.AxisComm("replica")
inner = optax.sgd(0.1, momentum=0.9)
TRANSFORMS = {
    "local_sgd(period=2)": lambda: od.local_sgd(inner, comm=comm, period=2),
    "diloco(period=2)": lambda: od.diloco(inner, comm=comm, period=2),
    "slowmo(period=2)": lambda: od.slowmo(inner, comm=comm, period=2, learning_rate=0.1),
}


def spread(make, dtype, apply):
    tx = make()

    def train(params, key):
        state = tx.init(params)
        for t in range(6):
            grads = jax.random.normal(jax.random.fold_in(key, t), params.shape).astype(dtype)
            updates, state = tx.update(grads, state, params)
            params = apply(params, updates, state)
        return params

    params = od.replicate((0.1 * jax.random.normal(jax.random.key(0), (64, 32))).astype(dtype), 4)
    out = np.asarray(od.simulate(train)(params, jax.random.split(jax.random.key(1), 4)), np.float32)
    return f"{int((out != out[:1]).any(0).sum())} / {float((out.max(0) - out.min(0)).max()):.1e}"


ways = {
    "optax.apply_updates": lambda p, u, s: optax.apply_updates(p, u),
    "optaxdist.apply_updates": od.apply_updates,
}
print("| transform | dtype | " + " | ".join(ways) + " |")
print("|---|---|---|---|")
for name, make in TRANSFORMS.items():
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        cells = [spread(make, dtype, apply) for apply in ways.values()]
        print(f"| `{name}` | {jnp.dtype(dtype).name} | " + " | ".join(cells) + " |")
        assert cells[1] == "0 / 0.0e+00", (name, dtype, cells)
