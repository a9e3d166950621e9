"""Dynamic loss scaling around a float16 gradient all-reduce, 4 simulated replicas.

The model keeps float32 parameters; the gradients are summed in float16 on the wire (SINGA's
"half" mode). ``mlbench_loss_scale`` multiplies the loss by a scale, divides the gradients by it,
and when any replica sees a non-finite value (here: a float16 sum that overflows) every replica
skips the step together and halves the scale.

    python examples/loss_scale.py
"""

import jax
import jax.numpy as jnp
import optax

import optaxdist

NUM_REPLICAS = 4
comm = optaxdist.AxisComm("replica")
inner = optax.chain(optaxdist.allreduce(comm=comm, dtype="float16"), optax.sgd(learning_rate=0.1))
tx = optaxdist.mlbench_loss_scale(inner, comm=comm)  # init 1024, ×2 every 128 steps, ×0.5 on overflow


def loss_fn(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


def train_step(w, opt_state, x, y):
    # Differentiate the *scaled* loss; dynamic_loss_scale unscales the gradients.
    grads = jax.grad(lambda w: optaxdist.scale_loss(loss_fn(w, x, y), opt_state))(w)
    updates, opt_state = tx.update(grads, opt_state, w)
    return optax.apply_updates(w, updates), opt_state, comm.pmean(loss_fn(w, x, y))


def main():
    w_true = jnp.array([1.0, -2.0, 0.5])
    x = jax.random.normal(jax.random.PRNGKey(0), (NUM_REPLICAS, 16, 3))
    y = x @ w_true
    # For the first 3 steps replica 2 gets a batch 300× larger: its gradient (~1e5) overflows the
    # float16 all-reduce, so all 4 replicas skip those steps together and the scale backs off.
    x_bad = x.at[2].multiply(300.0)
    y_bad = x_bad @ w_true

    params = optaxdist.replicate(jnp.zeros(3), NUM_REPLICAS)
    opt_state = optaxdist.simulate(tx.init)(params)
    step = optaxdist.simulate(train_step)
    for i in range(40):
        params, opt_state, loss = step(params, opt_state, *((x_bad, y_bad) if i < 3 else (x, y)))
        if i < 5 or i == 39:
            print(
                f"step {i:2d}  loss {float(loss[0]):.3e}  scale {float(opt_state.loss_scale[0]):7.1f}"
                f"  skipped so far {int(opt_state.skipped_steps[0])}"
            )

    optaxdist.assert_replicas_identical(params)
    print("params (replica 0):", params[0])
    print("comm:", optaxdist.comm_stats(opt_state))


if __name__ == "__main__":
    main()
