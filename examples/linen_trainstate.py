"""A Flax linen CNN with BatchNorm, trained through ``flax.training.train_state.TrainState``.

A ``TrainState`` is a pytree whose ``apply_fn`` and ``tx`` are static fields, so it needs no glue:
``optaxdist.replicate(state, n)`` stacks it, and the usual linen step (``apply_fn`` with
``mutable=["batch_stats"]``, ``state.apply_gradients``) runs per replica under
``optaxdist.simulate`` or ``optaxdist.on_mesh``. The optimizer is an optaxdist transform inside
``tx``. BatchNorm's running statistics are per-replica values that no optimizer sees: this example
averages them over the replicas whenever the parameters are synchronized (every step with
all-reduce, every ``--period`` steps with DiLoCo), so every replica evaluates alike.

    python examples/linen_trainstate.py                     # all-reduce + Adam, simulated
    python examples/linen_trainstate.py --algorithm diloco  # DiLoCo, batch stats averaged on syncs
    python examples/linen_trainstate.py --harness mesh      # one replica per (CPU) device
"""

import argparse
import os
import time
from typing import Any

# Must be set before JAX is imported (on a CPU-only machine this makes the mesh harness possible).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import optaxdist as od  # noqa: E402
from optaxdist.bench.data import load_dataset, make_shards  # noqa: E402


class CNN(nn.Module):
    """Two strided 3×3 convolutions (the first followed by BatchNorm) and a linear classifier.

    The first convolution has no bias: BatchNorm subtracts the mean, so that bias would get a
    gradient that is zero up to rounding, which Adam would scale up into steps of size ``lr``.
    """

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Conv(16, (3, 3), strides=2, use_bias=False)(x)  # BatchNorm has the bias
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        x = nn.relu(nn.Conv(32, (3, 3), strides=2)(x))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


class TrainState(train_state.TrainState):
    batch_stats: Any  # BatchNorm's running mean and variance


def make_tx(algorithm: str, comm: od.Communicator, lr: float, period: int) -> optax.GradientTransformation:
    if algorithm == "allreduce":
        return optax.chain(od.allreduce(comm=comm), optax.adam(lr))
    if algorithm == "diloco":
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
    """Train and return the final stacked ``TrainState``, the losses and replica 0's accuracy."""
    data = load_dataset("mnist")
    x_train = data.x_train.reshape(-1, 28, 28, 1)
    x_test = data.x_test.reshape(-1, 28, 28, 1)
    shards = make_shards(data.y_train, replicas, seed=seed)

    comm = od.AxisComm("replica")
    model = CNN()

    @jax.jit  # one compilation instead of one per eager initializer op
    def create(key):
        variables = model.init(key, jnp.zeros((1, 28, 28, 1)), train=False)
        state = TrainState.create(
            apply_fn=model.apply,
            params=variables["params"],
            batch_stats=variables["batch_stats"],
            tx=make_tx(algorithm, comm, lr, period),
        )
        return od.replicate(state, replicas)  # every leaf stacked: leading axis of `replicas`

    state = create(jax.random.key(seed))

    def average_batch_stats(batch_stats, step):
        """Average the running statistics on the steps where the parameters were synchronized."""
        if algorithm == "allreduce":
            return comm.pmean(batch_stats)
        # The predicate comes from the step counter, the same on every replica (comm.uniform keeps
        # the cond a branch under simulate); both branches return per-replica (varying) values.
        return jax.lax.cond(
            comm.uniform(step) % period == 0,
            lambda s: comm.varying(comm.pmean(s)),
            comm.varying,
            batch_stats,
        )

    def train_step(state, x, y):  # ONE replica's step, in plain linen
        def loss_fn(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats}, x, train=True, mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss, updates["batch_stats"]

        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads)  # the transform communicates inside
        state = state.replace(batch_stats=average_batch_stats(batch_stats, state.step))
        return state, comm.pmean(loss)

    if harness == "simulate":
        step = od.simulate(train_step)
    elif harness == "mesh":
        devices = jax.devices()[:replicas]
        if len(devices) < replicas:
            raise SystemExit(f"--harness mesh needs {replicas} devices, found {len(devices)}")
        auto = (jax.sharding.AxisType.Auto,)  # outputs index like ordinary arrays (state[0])
        mesh = jax.make_mesh((replicas,), ("replica",), devices=devices, axis_types=auto)
        step = od.on_mesh(train_step, mesh)
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
        first = jax.tree.map(lambda leaf: leaf[0], state)  # replica 0's TrainState
        return first.apply_fn({"params": first.params, "batch_stats": first.batch_stats}, x, train=False)

    logits = predict(state, jnp.asarray(x_test))
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == jnp.asarray(data.y_test)))
    stats = od.comm_stats(state.opt_state)  # checks that every replica counted the same
    return dict(state=state, losses=losses, accuracy=accuracy, stats=stats, seconds=seconds)


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
    print(f"sent per replica: {out['stats'].collectives} collectives, {out['stats'].bytes} bytes (optimizer)")


if __name__ == "__main__":
    main()
