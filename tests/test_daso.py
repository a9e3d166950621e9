"""DASO: Heat's timelines, the merge formula, the epoch state machine, loss scaling, harnesses,
and Heat DataParallel's non-blocking mode against synchronous SGD."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import optaxdist as od
from optaxdist.transforms.daso import CycleRules, DasoState, HeatQuirks, batch_plan, daso, next_cycle
from tests.problems import grad_fn, init_params, loss_fn, np_grad, replica_data

LR = 0.05


# ---------------------------------------------------------------------------------------------
# A literal transcription of Heat's DASO control flow (seeds_spec §1.3.4–1.3.7), host-side, for
# W = N·G ranks in lockstep. Each rank has its own FIFO of pending sends, as in Heat.
# ---------------------------------------------------------------------------------------------


class HeatDaso:
    def __init__(
        self,
        N,
        G,
        steps_per_epoch,
        total_epochs,
        *,
        warmup=4,
        cooldown=4,
        max_gs=8,
        stability=0.05,
        srf=2,
        lsf=4,
        patience=2,
        first_cycle=(4, 1, 1),
        wire=None,
        wire_in_cycling=False,
        redundant_bcast=True,
        actual_delay=False,
    ):
        self.N, self.G, self.W = N, G, N * G
        self.last_batch = steps_per_epoch - 1
        self.total, self.warmup, self.cooldown = total_epochs, warmup, cooldown
        self.max_gs, self.stability, self.srf, self.lsf = max_gs, stability, srf, lsf
        self.patience, self.first_cycle = patience, first_cycle
        self.wire, self.wire_in_cycling = wire, wire_in_cycling
        self.redundant_bcast, self.actual_delay = redundant_bcast, actual_delay
        self.gs = self.ls = self.btw = 0
        if warmup == 0 and total_epochs - cooldown > 0:  # H6 fixed: cycle from the start
            self.gs, self.ls, self.btw = first_cycle
        self.current_batch, self.epoch, self.send_mod, self.send_mod_m1 = 0, 0, 0, None
        self.pending = {r: [] for r in range(self.W)}
        self.local_sync_on = True
        self.best, self.bad = math.inf, 0

    # -- helpers --
    def group(self, k):
        return [n * self.G + k for n in range(self.N)]

    def send_dtype(self):
        if self.gs < 1 or self.wire_in_cycling:
            return self.wire
        return None  # float32 in Heat: float64 here (the JAX side runs in float32)

    @staticmethod
    def cast(x, dt):
        return x if dt is None else x.astype(dt)

    # -- Heat's methods --
    def step(self, params):
        ev = []
        b, L = self.current_batch, self.last_batch
        gmod = b % self.gs if self.gs > 0 else 0
        lmod = b % self.ls if self.ls > 0 else 0
        btw = self.btw if self.btw + b <= L else L - b
        if b == L or gmod == 0:
            self.global_sync(params, btw, ev)
            return ev
        nb = b + 1
        if nb % self.gs == 0:
            self.local_sync_on = True
            self.current_batch += 1
            return ev
        if gmod < btw:
            self.current_batch += 1
            if nb == L:
                self.local_sync_on = True
            return ev
        elif gmod == btw:
            merged = self.receive_and_merge(params, ev)
            self.broadcast(params, self.send_mod_m1, ev, merged)
            if self.ls > 1:
                self.local_sync_on = False
        if self.ls == 1 and nb != L:
            self.current_batch += 1
            self.local_sync_on = True
            return ev
        if lmod == 0:
            self.local_sync_on = False
        elif nb % self.ls == 0:
            self.local_sync_on = True
        if nb == L:
            self.local_sync_on = True
        self.current_batch += 1
        return ev

    def global_sync(self, params, btw, ev):
        k, b = self.send_mod, self.current_batch
        dt = self.send_dtype()
        packed = [self.cast(params[r], dt) for r in self.group(k)]
        total = packed[0]
        for x in packed[1:]:
            total = total + x  # pairwise in the wire dtype, as Heat's MPI sum op
        for r in self.group(k):
            self.pending[r].append((total, btw, b, dt))
        ev.append(f"SEND(g{k},{btw})")
        if self.btw != 0:
            merged = self.receive_and_merge(params, ev)
            self.broadcast(params, self.send_mod_m1, ev, merged)
        if b == self.last_batch or self.btw == 0:
            for r in range(self.W):
                if r % self.G == k:
                    total, _, _, dt = self.pending[r].pop(0)
                    assert not self.pending[r]
                    params[r] = (total / self.cast(np.asarray(self.N), dt)).astype(np.float64)
                else:
                    assert not self.pending[r], "OFF RANKS"
            ev.append(f"AVG(g{k})")
            self.broadcast(params, k, ev, True)
            self.send_mod_m1 = None
            if b == self.last_batch:
                self.send_mod, self.current_batch = 0, 0
                self.epoch += 1
                ev.append("EPOCH_END")
            else:
                self.current_batch += 1
                self.send_mod = (k + 1) % self.G
        else:
            self.current_batch += 1
            self.send_mod_m1 = k
            self.send_mod = (k + 1) % self.G

    def receive_and_merge(self, params, ev):
        if self.send_mod_m1 is None:
            return False
        merged = None
        for r in self.group(self.send_mod_m1):
            if not self.pending[r] or self.pending[r][0][2] == self.current_batch:
                continue  # nothing older pending (with G = 1 the send just made is not merged)
            total, B, sent_at, dt = self.pending[r].pop(0)
            numer = 2 * (self.current_batch - sent_at) if self.actual_delay else (2 * B if B > 0 else 1)
            denom = self.N + numer
            factor = numer / denom
            received = (total / self.cast(np.asarray(denom), dt)).astype(np.float64)
            params[r] = params[r] * factor + received
            merged = B
        if merged is None:
            return False
        ev.append(f"merge(g{self.send_mod_m1},{merged})")
        return True

    def broadcast(self, params, src, ev, merged):
        if src is None or not (merged or self.redundant_bcast):
            return
        for n in range(self.N):
            for j in range(self.G):
                params[n * self.G + j] = params[n * self.G + src].copy()
        ev.append(f"bcast{src}")

    def epoch_loss_logic(self, loss):
        e = self.epoch
        if e < self.warmup:
            self.gs = self.ls = self.btw = 0
            return
        elif e == self.warmup:
            self.gs, self.ls, self.btw = self.first_cycle
        if e >= self.total - self.cooldown:
            self.gs = self.ls = self.btw = 0
            return
        if loss is None:  # optaxdist without value=: the detector is not fed
            return
        better = (
            loss < self.best * (1 - self.stability)
            if self.best >= 0
            else loss < self.best * (1 + self.stability)
        )
        if better:
            self.best, self.bad = loss, 0
        else:
            self.bad += 1
        plateau = self.bad > self.patience
        if plateau:
            self.bad = 0
        if plateau and self.gs > 1:
            self.gs //= self.srf
            self.ls //= self.srf
            self.btw -= 1
            if self.gs > 0:
                self.btw = max(self.btw, 1)
                self.ls = max(self.ls, 1)
        elif plateau and self.gs == 1:
            m = self.max_gs
            self.gs, self.ls, self.btw = m, m // self.lsf, m // self.lsf


def heat_trajectory(ref: HeatDaso, steps, losses=None, lr=LR):
    """Train the least-squares problem: rank r on its own data, plain SGD, Heat's schedule."""
    W = ref.W
    xs, ys = replica_data(W, steps)
    p0 = {k: v.astype(np.float64) for k, v in init_params().items()}
    params = [{k: v.copy() for k, v in p0.items()} for _ in range(W)]
    flat = lambda p: np.concatenate([p["w"].ravel(), p["b"].ravel()])
    unflat = lambda v: {"w": v[:6].reshape(3, 2), "b": v[6:]}
    events, schedules, epoch_losses = [], [], []
    for t in range(steps):
        on = ref.local_sync_on
        grads = [np_grad(params[r], xs[t, r], ys[t, r]) for r in range(W)]
        if on:
            for n in range(ref.N):
                node = range(n * ref.G, (n + 1) * ref.G)
                mean = {k: sum(grads[r][k] for r in node) / ref.G for k in grads[0]}
                for r in node:
                    grads[r] = mean
        if losses is not None:
            epoch_losses.append(losses[:, t])
        vecs = [flat({k: params[r][k] - lr * grads[r][k] for k in grads[r]}) for r in range(W)]
        ev = ref.step(vecs)
        params = [unflat(v) for v in vecs]
        events.append((["on" if on else "off"], ev))
        if "EPOCH_END" in ev:
            ref.epoch_loss_logic(None if losses is None else float(np.mean(epoch_losses)))
            epoch_losses = []
        schedules.append((ref.gs, ref.ls, ref.btw))
    return {k: np.stack([p[k] for p in params]) for k in p0}, events, schedules


# ---------------------------------------------------------------------------------------------
# The JAX side
# ---------------------------------------------------------------------------------------------


def make_train(tx, steps, pass_value=True):
    def train(p, x, y, v):
        s = tx.init(p)

        def body(carry, batch):
            p, s = carry
            xb, yb, vb = batch
            extra = dict(value=vb) if pass_value else {}
            u, s = tx.update(grad_fn(p, xb, yb), s, p, **extra)
            return (optax.apply_updates(p, u), s), (
                s.last_events,
                jnp.stack([s.global_skip, s.local_skip, s.batches_to_wait]),
            )

        (p, s), trace = jax.lax.scan(body, (p, s), (x, y, v), length=steps)
        return p, s, trace

    return train


def inputs(W, steps, losses=None):
    xs, ys = replica_data(W, steps)
    p0 = od.replicate(jax.tree.map(jnp.asarray, init_params()), W)
    if losses is None:
        losses = np.ones((W, steps), np.float32)
    return p0, np.swapaxes(xs, 0, 1), np.swapaxes(ys, 0, 1), np.asarray(losses, np.float32)


def simulate_daso(N, G, steps, losses=None, pass_value=True, data=None, **kw):
    """``steps`` batches of ``data`` (default: ``inputs(N * G, steps, losses)``)."""
    run = _daso_run(N, G, steps, pass_value, tuple(sorted(kw.items())))
    return jax.tree.map(np.asarray, run(*(inputs(N * G, steps, losses) if data is None else data)))


@functools.cache
def _daso_run(N, G, steps, pass_value, settings):
    """One compiled run per set of settings: calls that differ only in their losses share it."""
    h = od.axis_hierarchy(N, G)
    tx = daso(optax.sgd(LR), local_comm=h.local, cross_comm=h.cross, **dict(settings))
    return od.simulate(make_train(tx, steps, pass_value), axis_name=("node", "local"), shape=(N, G))


def describe(ev, b, *, dtype=False):
    """One batch of a DasoEvents trace (replica 0) in the notation of seeds_spec §1.3.8."""
    e = jax.tree.map(lambda a: int(a[0, b]), ev)
    out = []
    if e.sent_group >= 0:
        out.append(f"SEND(g{e.sent_group},{e.sent_wait}{',lowp' if dtype and e.sent_low_precision else ''})")
    if e.merged_group >= 0:
        out.append(f"merge(g{e.merged_group},{e.merged_wait})")
    if e.merge_broadcast_root >= 0:
        out.append(f"bcast{e.merge_broadcast_root}")
    if e.averaged_group >= 0:
        out.append(f"AVG(g{e.averaged_group}) bcast{e.averaged_group}")
    return " ".join(out)


def heat_describe(ev):
    return " ".join(x for x in ev if x != "EPOCH_END")


# The timelines of seeds_spec §1.3.8 (G = 4), written out batch by batch.
TIMELINES = {
    "gs4_ls1_btw1": dict(
        cycle=(4, 1, 1),
        steps_per_epoch=12,
        events={
            0: "SEND(g0,1)",
            1: "merge(g0,1) bcast0",
            4: "SEND(g1,1) bcast0",
            5: "merge(g1,1) bcast1",
            8: "SEND(g2,1) bcast1",
            9: "merge(g2,1) bcast2",
            11: "SEND(g3,0) bcast2 AVG(g3) bcast3",
        },
        redundant={4, 8, 11},  # the broadcasts from send_mod_m1 with nothing to merge (H3)
    ),
    "gs2_ls1_btw1": dict(
        cycle=(2, 1, 1),
        steps_per_epoch=12,
        events={
            0: "SEND(g0,1)",
            2: "SEND(g1,1) merge(g0,1) bcast0",
            4: "SEND(g2,1) merge(g1,1) bcast1",
            6: "SEND(g3,1) merge(g2,1) bcast2",
            8: "SEND(g0,1) merge(g3,1) bcast3",
            10: "SEND(g1,1) merge(g0,1) bcast0",
            11: "SEND(g2,0) merge(g1,1) bcast1 AVG(g2) bcast2",
        },
        redundant=set(),
    ),
    "gs1_ls1_btw1": dict(
        cycle=(1, 1, 1),
        steps_per_epoch=12,
        events={
            b: f"SEND(g{b % 4},{0 if b == 11 else 1})"
            + (f" merge(g{(b - 1) % 4},1) bcast{(b - 1) % 4}" if b else "")
            + (" AVG(g3) bcast3" if b == 11 else "")
            for b in range(12)
        },
        redundant=set(),
    ),
    "gs8_ls2_btw2": dict(
        cycle=(8, 2, 2),
        steps_per_epoch=20,
        events={
            0: "SEND(g0,2)",
            2: "merge(g0,2) bcast0",
            8: "SEND(g1,2) bcast0",
            10: "merge(g1,2) bcast1",
            16: "SEND(g2,2) bcast1",
            19: "SEND(g3,0) merge(g2,2) bcast2 AVG(g3) bcast3",
        },
        redundant={8, 16},
        # local gradient all-reduce in the backward of each batch (the spec's "b11 off ... b15
        # off" written out by Heat's rules)
        local_sync="on on on off on off on off on on on off on off on off on on on on",
    ),
}


# without Heat's redundant broadcast, a timeline that has none is the same: in the full run only
@pytest.mark.parametrize(
    "redundant, name",
    [
        pytest.param(
            redundant,
            name,
            id=f"{'heat_broadcast' if redundant else 'no_redundant'}-{name}",
            marks=() if redundant or TIMELINES[name]["redundant"] else pytest.mark.slow,
        )
        for redundant in (True, False)
        for name in sorted(TIMELINES)
    ],
)
def test_timelines(name, redundant):
    spec = TIMELINES[name]
    spe = spec["steps_per_epoch"]
    want = []
    for b in range(spe):
        text = spec["events"].get(b, "")
        if not redundant and b in spec["redundant"]:  # drop the first broadcast of the batch
            parts = text.split(" ")
            i = next(i for i, w in enumerate(parts) if w.startswith("bcast"))
            text = " ".join(parts[:i] + parts[i + 1 :])
        want.append(text)
    kw = dict(
        steps_per_epoch=spe,
        total_epochs=10,
        warmup_epochs=0,
        cooldown_epochs=0,
        first_cycle=spec["cycle"],
        heat_quirks=HeatQuirks(redundant_broadcast=redundant),
    )
    _, state, (ev, _) = simulate_daso(1, 4, spe, **kw)
    got = [describe(ev, b) for b in range(spe)]
    assert got == want
    # the NumPy transcription of Heat's code gives the same timeline
    ref = HeatDaso(1, 4, spe, 10, warmup=0, cooldown=0, first_cycle=spec["cycle"], redundant_bcast=redundant)
    _, ref_events, _ = heat_trajectory(ref, spe)
    assert [heat_describe(e) for _, e in ref_events] == want
    if "local_sync" in spec:
        flags = ["on" if v else "off" for v in ev.local_grad_sync[0]]
        assert flags == spec["local_sync"].split()
        assert [f[0] for f, _ in ref_events] == spec["local_sync"].split()
    # stored B vs the actual delay: the last merge of gs=8 waited 3 batches with B = 2 (H2)
    if name == "gs8_ls2_btw2":
        assert int(ev.merged_delay[0, 19]) == 3 and int(ev.merged_wait[0, 19]) == 2
    # every event is in the ledger (N = 1: nothing crosses nodes, so no global bytes)
    stats = od.comm_stats(state).by_kind
    bcasts = sum(w.startswith("bcast") for t in want for w in t.split())
    assert stats["local:broadcast[float32]"].collectives == bcasts
    assert stats["cross:all_reduce[bfloat16]"].collectives == 0
    syncs = sum(f == "on" for f in spec.get("local_sync", "on " * spe).split())
    assert stats["local:all_reduce[float32]"].collectives == syncs


def test_blocking_phase_timeline_and_bytes():
    spe = 6
    _, state, (ev, sched) = simulate_daso(
        2, 4, spe, steps_per_epoch=spe, total_epochs=3, warmup_epochs=1, cooldown_epochs=0
    )
    for b in range(spe):
        k = b % 4
        assert describe(ev, b, dtype=True) == f"SEND(g{k},0,lowp) AVG(g{k}) bcast{k}"
    assert ev.local_grad_sync[0].all()
    assert tuple(sched[0, spe - 1]) == (8, 2, 2)  # first cycle from max_global_skips
    p_bytes = sum(v.nbytes for v in init_params().values())
    stats = od.comm_stats(state).by_kind
    assert stats["cross:all_reduce[bfloat16]"] == od.KindTotals(spe, spe * p_bytes // 2)
    assert stats["local:broadcast[float32]"] == od.KindTotals(spe, spe * p_bytes)
    assert stats["local:all_reduce[float32]"] == od.KindTotals(spe, spe * p_bytes)
    for kind in ("local:loss_all_reduce[float32]", "cross:loss_all_reduce[float32]"):
        assert stats[kind] == od.KindTotals(1, 8)
    for kind in ("local:agree[int32]", "cross:agree[int32]"):
        assert stats[kind] == od.KindTotals(1, 4)


def test_a_blocking_average_keeps_the_last_non_blocking_send():
    """Cycle (4, 1, 1): non-blocking sends at batches 0, 4 and 8 (each merged a batch later),
    and the epoch's last batch averages its own send at once. That blocking average leaves the
    pending sum as batch 8's send left it, which nothing reads again (``pending_valid`` is false),
    so that a program of a blocking batch alone can leave that buffer where it is."""
    kw = dict(steps_per_epoch=12, total_epochs=10, warmup_epochs=0, cooldown_epochs=0, first_cycle=(4, 1, 1))
    p0, *batches = inputs(4, 12)
    first_9 = (p0, *(x[:, :9] for x in batches))  # the same run's first 9 batches
    _, after_send, _ = simulate_daso(2, 2, 9, data=first_9, **kw)
    _, after_epoch, (ev, _) = simulate_daso(2, 2, 12, data=(p0, *batches), **kw)
    sent, averaged = ev.sent_group[0], ev.averaged_group[0]
    assert [b for b in range(12) if sent[b] >= 0] == [0, 4, 8, 11]
    assert [b for b in range(12) if averaged[b] >= 0] == [11]
    assert not after_epoch.pending_valid.any()
    for a, b in zip(jax.tree.leaves(after_send.pending_sum), jax.tree.leaves(after_epoch.pending_sum)):
        assert a.any()
        np.testing.assert_array_equal(a, b)


def test_merge_by_hand_two_nodes_two_local():
    """Gradients −(r+1) on replica r, lr 1, cycle (4, 1, 1): node means 1.5 and 3.5 per step."""
    h = od.axis_hierarchy(2, 2)
    tx = daso(
        optax.sgd(1.0),
        local_comm=h.local,
        cross_comm=h.cross,
        steps_per_epoch=8,
        total_epochs=2,
        warmup_epochs=0,
        cooldown_epochs=0,
        first_cycle=(4, 1, 1),
        downcast="float32",
    )

    def run(p, g):
        s = tx.init(p)
        out = []
        for _ in range(3):
            u, s = tx.update(g, s, p)
            p = optax.apply_updates(p, u)
            out.append(p)
        return out

    g = -np.arange(1, 5, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    out = od.simulate(run, axis_name=("node", "local"), shape=(2, 2))(np.zeros((4, 2), np.float32), g)
    # b0: local steps → 1.5 | 3.5, group 0 sends S = 5. b1: local → 3 | 7, merge with D = 1:
    # (2·3 + 5)/4 = 2.75 and (2·7 + 5)/4 = 4.75, broadcast in each node. b2: + 1.5 | + 3.5.
    want = [[1.5, 1.5, 3.5, 3.5], [2.75, 2.75, 4.75, 4.75], [4.25, 4.25, 8.25, 8.25]]
    for p, w in zip(out, want):
        np.testing.assert_allclose(p[:, 0], w, rtol=1e-6)


OPTION_SETS = {
    "heat_code": HeatQuirks(redundant_broadcast=True, stored_merge_weight=True),
    "documented": HeatQuirks(),
}


@pytest.mark.parametrize("options", sorted(OPTION_SETS))
def test_trajectory_matches_heat_transcription(options):
    """2 nodes × 2 local, 3 epochs (blocking, then cycling (4, 2, 2) with drifting local replicas
    and a clamped receive, then cool-down), float32 on the wire."""
    N, G, spe, epochs = 2, 2, 12, 3
    quirks = OPTION_SETS[options]
    params, state, (ev, _) = simulate_daso(
        N,
        G,
        spe * epochs,
        steps_per_epoch=spe,
        total_epochs=epochs,
        warmup_epochs=1,
        cooldown_epochs=1,
        first_cycle=(4, 2, 2),
        downcast="float32",
        heat_quirks=quirks,
    )
    ref = HeatDaso(
        N,
        G,
        spe,
        epochs,
        warmup=1,
        cooldown=1,
        first_cycle=(4, 2, 2),
        redundant_bcast=quirks.redundant_broadcast,
        actual_delay=not quirks.stored_merge_weight,
    )
    want, ref_events, _ = heat_trajectory(ref, spe * epochs)
    for k in want:
        np.testing.assert_allclose(params[k], want[k], atol=2e-5, rtol=0)
    got = [describe(ev, t) for t in range(spe * epochs)]
    assert got == [heat_describe(e) for _, e in ref_events]
    assert any("merge" in e for e in got)
    # a send whose receive slipped to the last batch: stored B = 2, actual delay 3 (H2)
    assert int(ev.merged_wait[0, 2 * spe - 1]) == 2 and int(ev.merged_delay[0, 2 * spe - 1]) == 3
    # the replicas of a node drift apart while local sync is off, and agree after each epoch
    assert not ev.local_grad_sync[0].all()
    for k in params:
        np.testing.assert_allclose(
            params[k], np.broadcast_to(params[k][0], params[k].shape), atol=1e-6, rtol=0
        )


def test_bfloat16_sends_and_heat_float32_cycling():
    N, G, spe, epochs = 2, 2, 8, 2
    base = dict(
        steps_per_epoch=spe, total_epochs=epochs, warmup_epochs=1, cooldown_epochs=0, first_cycle=(2, 1, 1)
    )
    for in_cycling in (True, False):
        params, state, (ev, _) = simulate_daso(
            N,
            G,
            spe * epochs,
            downcast="bfloat16",
            heat_quirks=HeatQuirks(float32_cycling=not in_cycling),
            **base,
        )
        ref = HeatDaso(
            N,
            G,
            spe,
            epochs,
            warmup=1,
            cooldown=0,
            first_cycle=(2, 1, 1),
            wire=ml_dtypes.bfloat16,
            wire_in_cycling=in_cycling,
            redundant_bcast=False,
            actual_delay=True,
        )
        want, _, _ = heat_trajectory(ref, spe * epochs)
        for k in want:
            np.testing.assert_allclose(params[k], want[k], atol=3e-2, rtol=1e-2)
        low = ev.sent_low_precision[0]
        sent = ev.sent_group[0] >= 0
        stats = od.comm_stats(state).by_kind
        p_elems = sum(v.size for v in init_params().values())
        if in_cycling:
            assert low[sent].all()
            assert "cross:all_reduce[float32]" not in stats
        else:  # H1 reproduced: bf16 in the blocking epoch, float32 while cycling
            assert low[:spe][sent[:spe]].all() and not low[spe:][sent[spe:]].any()
            cycling_sends = int(sent[spe:].sum())
            assert stats["cross:all_reduce[float32]"] == od.KindTotals(
                cycling_sends, cycling_sends * p_elems * 4
            )
            assert stats["cross:all_reduce[bfloat16]"].collectives == spe


def epoch_losses(values, W, spe):
    """Per-replica, per-step losses whose epoch means over all replicas are ``values``."""
    spread = np.linspace(-0.5, 0.5, W)[:, None] * np.ones((1, spe))
    return np.concatenate([v + spread for v in values], axis=1)


# the first cycle from max_global_skips is also asserted in test_blocking_phase_timeline_and_bytes and
# test_improving_loss_keeps_the_cycle_and_no_loss_feeds_nothing: its plateaus in the full run
@pytest.mark.parametrize("first_cycle", ["heat", pytest.param("max_global_skips", marks=pytest.mark.slow)])
def test_plateau_cycling_from_the_loss(first_cycle):
    """Constant loss: a plateau every 3 epochs. Heat's (4,1,1) → (2,1,1) → (1,1,1) → reset
    (8,2,2) → (4,1,1); the cool-down is blocking whatever the loss."""
    N, G, spe, epochs, warm, cool = 2, 2, 2, 17, 1, 2
    values = [10.0] * 14 + [9.0, 8.0, 7.0]
    losses = epoch_losses(values, N * G, spe)
    kw = dict(
        steps_per_epoch=spe,
        total_epochs=epochs,
        warmup_epochs=warm,
        cooldown_epochs=cool,
        heat_quirks=HeatQuirks(first_cycle=first_cycle == "heat"),
    )
    _, _, (_, sched) = simulate_daso(N, G, spe * epochs, losses=losses, **kw)
    after_epoch = [tuple(int(v) for v in sched[0, e * spe + spe - 1]) for e in range(epochs)]
    first = (4, 1, 1) if first_cycle == "heat" else (8, 2, 2)
    ref = HeatDaso(N, G, spe, epochs, warmup=warm, cooldown=cool, first_cycle=first)
    _, _, ref_sched = heat_trajectory(ref, spe * epochs, losses=losses)
    assert after_epoch == [ref_sched[e * spe + spe - 1] for e in range(epochs)]
    if first_cycle == "heat":
        want = (
            [(4, 1, 1)] * 3
            + [(2, 1, 1)] * 3
            + [(1, 1, 1)] * 3
            + [(8, 2, 2)] * 3
            + [(4, 1, 1)] * 2
            + [(0, 0, 0)] * 3
        )
    else:
        want = (
            [(8, 2, 2)] * 3
            + [(4, 1, 1)] * 3
            + [(2, 1, 1)] * 3
            + [(1, 1, 1)] * 3
            + [(8, 2, 2)] * 2
            + [(0, 0, 0)] * 3
        )
    assert after_epoch == want


def test_improving_loss_keeps_the_cycle_and_no_loss_feeds_nothing():
    N, G, spe, epochs = 1, 2, 2, 8
    kw = dict(steps_per_epoch=spe, total_epochs=epochs + 1, warmup_epochs=1, cooldown_epochs=0)
    values = [10.0 * 0.9**e for e in range(epochs)]
    _, _, (_, sched) = simulate_daso(N, G, spe * epochs, losses=epoch_losses(values, 2, spe), **kw)
    assert {tuple(s) for s in sched[0, spe:]} == {(8, 2, 2)}
    # the threshold is relative: 1 % per epoch is a plateau after 3 epochs with 0.05
    values = [10.0 * 0.99**e for e in range(epochs)]
    _, _, (_, sched) = simulate_daso(N, G, spe * epochs, losses=epoch_losses(values, 2, spe), **kw)
    assert [tuple(sched[0, e * spe + spe - 1]) for e in range(epochs)] == [(8, 2, 2)] * 3 + [(4, 1, 1)] * 5
    # without value= the detector is not fed: constant losses would have reduced the cycle
    _, state, (_, sched) = simulate_daso(N, G, spe * epochs, pass_value=False, **kw)
    assert {tuple(s) for s in sched[0, spe:]} == {(8, 2, 2)}
    assert int(state.epoch[0]) == epochs


def test_warmup_zero_and_one_device_per_node():
    """H6: warmup_epochs=0 cycles from the first batch. H7: G = 1 works (no local collectives)."""
    N, G, spe, epochs = 2, 1, 10, 2
    kw = dict(
        steps_per_epoch=spe,
        total_epochs=epochs,
        warmup_epochs=0,
        cooldown_epochs=0,
        first_cycle=(4, 1, 2),
        downcast="float32",
    )
    params, state, (ev, sched) = simulate_daso(N, G, spe * epochs, **kw)
    assert tuple(sched[0, 0]) == (4, 1, 2)
    assert describe(ev, 0) == "SEND(g0,2)"
    ref = HeatDaso(
        N,
        G,
        spe,
        epochs,
        warmup=0,
        cooldown=0,
        first_cycle=(4, 1, 2),
        redundant_bcast=False,
        actual_delay=True,
    )
    want, ref_events, _ = heat_trajectory(ref, spe * epochs)
    for k in want:
        np.testing.assert_allclose(params[k], want[k], atol=2e-5, rtol=0)
    stats = od.comm_stats(state).by_kind
    assert stats["local:all_reduce[float32]"].collectives == 0
    assert stats["local:broadcast[float32]"].collectives == 0
    assert stats["cross:all_reduce[float32]"].collectives == sum(
        any(x.startswith("SEND") for x in e) for _, e in ref_events
    )


def test_frozen_parameters_with_multi_transform():
    """H4: freeze with optax.multi_transform; DASO only sees, sends and merges trainable leaves."""
    N, G, spe, steps = 2, 2, 6, 12
    h = od.axis_hierarchy(N, G)
    kw = dict(
        local_comm=h.local,
        cross_comm=h.cross,
        steps_per_epoch=spe,
        total_epochs=4,
        warmup_epochs=1,
        cooldown_epochs=0,
        first_cycle=(2, 1, 1),
    )
    frozen_tx = optax.multi_transform(
        {"train": daso(optax.sgd(LR), **kw), "frozen": optax.set_to_zero()},
        {"frozen0": "frozen", "w": "train", "b": "train"},
    )
    plain_tx = daso(optax.sgd(LR), **kw)
    xs, ys = replica_data(N * G, steps)

    def train(tx, p, x, y):
        def body(carry, batch):
            p, s = carry
            g = grad_fn({"w": p["w"], "b": p["b"]}, *batch)
            g = dict(g, **({"frozen0": jnp.ones_like(p["frozen0"])} if "frozen0" in p else {}))
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        return jax.lax.scan(body, (p, tx.init(p)), (x, y))[0]

    p0 = jax.tree.map(jnp.asarray, init_params())
    frozen = np.full((N * G, 5), 0.1234567, np.float32)
    sim = lambda f: od.simulate(f, axis_name=("node", "local"), shape=(N, G))
    a, state = sim(lambda p, x, y: train(frozen_tx, p, x, y))(
        dict(od.replicate(p0, N * G), frozen0=frozen), np.swapaxes(xs, 0, 1), np.swapaxes(ys, 0, 1)
    )
    b, _ = sim(lambda p, x, y: train(plain_tx, p, x, y))(
        od.replicate(p0, N * G), np.swapaxes(xs, 0, 1), np.swapaxes(ys, 0, 1)
    )
    np.testing.assert_array_equal(a["frozen0"], frozen)  # bit-exact: never sent, never rounded
    for k in ("w", "b"):
        np.testing.assert_array_equal(a[k], b[k])
    sends = od.comm_stats(state).by_kind["cross:all_reduce[bfloat16]"]
    p_elems = sum(v.size for v in init_params().values())  # the frozen leaf is not in the payload
    assert sends.collectives > 0 and sends.bytes == sends.collectives * p_elems * 2


def test_same_numbers_on_vmap_and_mesh():
    N, G, spe, epochs = 2, 2, 7, 3
    kw = dict(
        steps_per_epoch=spe, total_epochs=epochs, warmup_epochs=1, cooldown_epochs=1, first_cycle=(2, 2, 1)
    )
    losses = epoch_losses([3.0, 2.0, 1.0], N * G, spe)
    sim = simulate_daso(N, G, spe * epochs, losses=losses, **kw)
    mh = od.mesh_hierarchy(N, G, devices=jax.devices()[: N * G])
    tx = daso(optax.sgd(LR), local_comm=mh.local, cross_comm=mh.cross, **kw)
    mesh = od.on_mesh(make_train(tx, spe * epochs), mh.mesh)(*inputs(N * G, spe * epochs, losses))
    mesh = jax.tree.map(np.asarray, mesh)
    for k in sim[0]:
        np.testing.assert_allclose(mesh[0][k], sim[0][k], atol=1e-6, rtol=0)
    for a, b in zip(jax.tree.leaves(sim[2]), jax.tree.leaves(mesh[2])):
        np.testing.assert_array_equal(a, b)
    assert od.comm_stats(mesh[1]) == od.comm_stats(sim[1])


def test_same_numbers_under_mpi(harness):
    """Under mpirun -n 4: 2 nodes × 2 (mpi_hierarchy(2)); -n 2: 2 nodes × 1; one process per node:
    Heat's groups exactly (local = my node's devices, cross = MPI group i). Elsewhere a no-op: vmap
    and mesh are compared in test_same_numbers_on_vmap_and_mesh."""
    if harness.name not in ("mpi", "node"):
        return
    W = harness.n
    if harness.name == "node":
        h = harness.hierarchy
        G = h.local_size
    else:
        G = 2 if W % 2 == 0 and W >= 4 else 1
        h = od.mpi_hierarchy(G)
    N = W // G
    spe, epochs = 7, 2
    kw = dict(
        steps_per_epoch=spe, total_epochs=epochs, warmup_epochs=1, cooldown_epochs=0, first_cycle=(2, 2, 1)
    )
    losses = epoch_losses([3.0, 2.0], W, spe)
    tx = daso(optax.sgd(LR), local_comm=h.local, cross_comm=h.cross, **kw)
    got = harness.run(make_train(tx, spe * epochs), *inputs(W, spe * epochs, losses))
    want = simulate_daso(N, G, spe * epochs, losses=losses, **kw)
    for k in want[0]:
        np.testing.assert_allclose(got[0][k], want[0][k], atol=1e-6, rtol=0)
    for a, b in zip(jax.tree.leaves(want[2]), jax.tree.leaves(got[2])):
        np.testing.assert_array_equal(a, b)
    assert od.comm_stats(got[1]) == od.comm_stats(want[1])


@pytest.mark.parametrize("order", ["outside", "inside"])
def test_dynamic_loss_scale_composition(order):
    """``dynamic_loss_scale(daso(...), comm=h.world)``: a non-finite gradient on one replica makes
    every replica skip; the DASO schedule pauses (the state is rolled back, ledgers kept).
    ``daso(dynamic_loss_scale(...))`` is Heat's ``add_scaler``: only the local step is skipped."""
    N, G, spe, steps = 2, 2, 4, 10
    h = od.axis_hierarchy(N, G)
    kw = dict(
        local_comm=h.local,
        cross_comm=h.cross,
        steps_per_epoch=spe,
        total_epochs=5,
        warmup_epochs=1,
        cooldown_epochs=0,
        first_cycle=(2, 2, 1),
    )
    if order == "outside":
        tx = od.dynamic_loss_scale(daso(optax.sgd(LR), **kw), comm=h.world, init_scale=4.0)
    else:
        tx = daso(od.dynamic_loss_scale(optax.sgd(LR), comm=h.world, init_scale=4.0), **kw)
    bad = {3: (1, np.nan), 6: (2, np.inf)}  # step -> (replica, poison)
    poison = np.ones((N * G, steps), np.float32)
    for t, (r, v) in bad.items():
        poison[r, t] = v
    xs, ys = replica_data(N * G, steps)

    def train(p, x, y, z):
        s = tx.init(p)

        def body(carry, batch):
            p, s = carry
            xb, yb, zb = batch
            g = jax.grad(lambda q: od.scale_loss(loss_fn(q, xb, yb), s))(p)
            g = jax.tree.map(lambda v: v * zb, g)
            u, s = tx.update(g, s, p, value=loss_fn(p, xb, yb))
            daso_state = s.inner_state if order == "outside" else s
            return (optax.apply_updates(p, u), s), (p, daso_state.batch_in_epoch)

        (p, s), trace = jax.lax.scan(body, (p, s), (x, y, z))
        return p, s, trace

    p0 = od.replicate(jax.tree.map(jnp.asarray, init_params()), N * G)
    p, s, (before, batch) = od.simulate(train, axis_name=("node", "local"), shape=(N, G))(
        p0, np.swapaxes(xs, 0, 1), np.swapaxes(ys, 0, 1), poison
    )
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(p))
    batch = np.asarray(batch[0])
    if order == "outside":
        for t in bad:
            for k in before:  # every replica skipped: parameters unchanged
                np.testing.assert_array_equal(before[k][:, t + 1], before[k][:, t])
            assert batch[t] == batch[t - 1]  # the schedule paused
        assert int(s.skipped_steps[0]) == len(bad)
        assert isinstance(s.inner_state, DasoState)
    else:
        assert list(batch) == [(t + 1) % spe for t in range(steps)]  # the schedule goes on
        assert int(s.inner_state.skipped_steps[0]) == len(bad)


def test_nonfinite_gradient_makes_its_node_skip_the_local_step():
    """A NaN on one GPU reaches its node through the node-local gradient average; that node skips
    the step (as if its gradients were zero, plain SGD) and nothing non-finite reaches any state."""
    N, G, steps = 2, 2, 8
    h = od.axis_hierarchy(N, G)
    tx = daso(
        optax.sgd(LR),
        local_comm=h.local,
        cross_comm=h.cross,
        steps_per_epoch=4,
        total_epochs=2,
        warmup_epochs=1,
        cooldown_epochs=0,
    )
    xs, ys = replica_data(N * G, steps)

    def train(p, x, y, z):
        def body(carry, batch):
            p, s = carry
            g = jax.tree.map(lambda v: v * batch[2], grad_fn(p, batch[0], batch[1]))
            u, s = tx.update(g, s, p, value=loss_fn(p, batch[0], batch[1]))
            return (optax.apply_updates(p, u), s), None

        return jax.lax.scan(body, (p, tx.init(p)), (x, y, z))[0]

    p0 = od.replicate(jax.tree.map(jnp.asarray, init_params()), N * G)
    run = od.simulate(train, axis_name=("node", "local"), shape=(N, G))  # one program for both runs
    poison = np.ones((N * G, steps), np.float32)
    poison[1, 5] = np.nan  # node 0, local index 1, in the cycling phase
    zeroed = poison.copy()
    zeroed[:G, 5] = 0.0  # node 0's replicas: zero gradients at that step
    xs, ys = np.swapaxes(xs, 0, 1), np.swapaxes(ys, 0, 1)
    (p, s), (ref, _) = run(p0, xs, ys, poison), run(p0, xs, ys, zeroed)
    for tree in (p, s):
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree) if x.dtype.kind == "f")
    for k in ref:
        np.testing.assert_allclose(p[k], ref[k], atol=1e-6)


def test_bad_hyperparameters():
    c = od.AxisComm("replica")
    ok = dict(local_comm=c, cross_comm=c, steps_per_epoch=10, total_epochs=5)
    cases = [
        (dict(steps_per_epoch=0), "steps_per_epoch="),
        (dict(total_epochs=0), "total_epochs="),
        (dict(warmup_epochs=-1), "warmup_epochs="),
        (dict(cooldown_epochs=1.5), "cooldown_epochs="),
        (dict(max_global_skips=0), "max_global_skips="),
        (dict(skip_reduction_factor=1), "skip_reduction_factor="),
        (dict(local_skip_factor=0), "local_skip_factor="),
        (dict(max_global_skips=2), "max_global_skips=2 < local_skip_factor=4"),
        (dict(stability_level=1.0), "stability_level="),
        (dict(plateau_patience=-1), "plateau_patience="),
        (dict(downcast="int8"), "downcast="),
        (dict(first_cycle="fast"), "first_cycle="),
        (dict(first_cycle=(4, 0, 1)), "first_cycle="),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            daso(optax.sgd(0.1), **(ok | bad))
    with pytest.raises(TypeError, match="local_comm"):
        daso(optax.sgd(0.1), **(ok | dict(local_comm="local")))
    with pytest.raises(TypeError, match="heat_quirks"):
        daso(optax.sgd(0.1), **(ok | dict(heat_quirks="heat")))
    with pytest.raises(ValueError, match="needs params"):
        tx = daso(optax.sgd(0.1), **ok)
        jax.vmap(lambda p: tx.update(p, tx.init(p)), axis_name="replica")(jnp.ones((2, 3)))


# ---------------------------------------------------------------------------------------------
# Heat DataParallel, non-blocking mode: each layer's update of step t is applied by a forward
# pre-hook right before step t+1 uses that layer. The numbers are synchronous SGD's.
# ---------------------------------------------------------------------------------------------

HIDDEN = 4


def mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "l1": {
            "w": rng.normal(size=(3, HIDDEN)).astype(np.float32) * 0.5,
            "b": rng.normal(size=(HIDDEN,)).astype(np.float32) * 0.1,
        },
        "l2": {
            "w": rng.normal(size=(HIDDEN, 2)).astype(np.float32) * 0.5,
            "b": rng.normal(size=(2,)).astype(np.float32) * 0.1,
        },
    }


def mlp_loss(p, x, y):
    h = jnp.tanh(x @ p["l1"]["w"] + p["l1"]["b"])
    return 0.5 * jnp.mean(jnp.sum((h @ p["l2"]["w"] + p["l2"]["b"] - y) ** 2, -1))


def np_nonblocking_dp(W, steps, lr, momentum):
    """Heat's non-blocking DataParallel + DataParallelOptimizer, layer by layer, in NumPy."""
    xs, ys = replica_data(W, steps)
    p = {k: {n: v.astype(np.float64) for n, v in d.items()} for k, d in mlp_params().items()}
    buf = {k: {n: None for n in d} for k, d in p.items()}
    received, update_next, losses = {}, False, []

    def apply_pending(layer):  # the forward pre-hook
        grads = received.pop(layer)
        if update_next:
            for n, g in grads.items():  # torch SGD restricted to this layer's parameters
                buf[layer][n] = g if buf[layer][n] is None else momentum * buf[layer][n] + g
                p[layer][n] = p[layer][n] - lr * buf[layer][n]

    for t in range(steps):
        step_losses, local = [], []
        for r in range(W):
            x, y = xs[t, r].astype(np.float64), ys[t, r].astype(np.float64)
            if r == 0 and "l1" in received:  # the hooks run once: all ranks hold the same params
                apply_pending("l1")
            a = x @ p["l1"]["w"] + p["l1"]["b"]
            h = np.tanh(a)
            if r == 0 and "l2" in received:
                apply_pending("l2")
            out = h @ p["l2"]["w"] + p["l2"]["b"]
            d = (out - y) / len(x)
            step_losses.append(0.5 * np.mean(np.sum((out - y) ** 2, -1)))
            dh = d @ p["l2"]["w"].T * (1 - h**2)
            local.append({"l1": {"w": x.T @ dh, "b": dh.sum(0)}, "l2": {"w": h.T @ d, "b": d.sum(0)}})
        losses.append(step_losses)
        update_next = False
        # backward hooks: w = g / W, Iallreduce SUM; the local .grad gets zeros
        for layer in ("l2", "l1"):
            received[layer] = {n: sum(g[layer][n] / W for g in local) for n in p[layer]}
        update_next = True  # optimizer.step()
    for layer in ("l1", "l2"):  # model.eval() finalizes what is still pending
        apply_pending(layer)
    return p, np.asarray(losses)


def test_heat_nonblocking_data_parallel_is_synchronous_sgd(harness):
    n, steps, lr, momentum = harness.n, 8, 0.1, 0.9
    want, want_losses = np_nonblocking_dp(n, steps, lr, momentum)
    tx = optax.chain(
        od.allreduce(comm=harness.comm, divide_before=True, dtype="float32"), optax.sgd(lr, momentum=momentum)
    )
    xs, ys = replica_data(n, steps)

    def train(p, x, y):
        s = tx.init(p)

        def body(carry, batch):
            p, s = carry
            loss, g = jax.value_and_grad(mlp_loss)(p, *batch)
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), loss

        (p, _), losses = jax.lax.scan(body, (p, s), (x, y))
        return p, losses

    p0 = od.replicate(jax.tree.map(jnp.asarray, mlp_params()), n)
    got, losses = harness.run(train, p0, np.swapaxes(xs, 0, 1), np.swapaxes(ys, 0, 1))
    np.testing.assert_allclose(losses.T, want_losses, atol=1e-5, rtol=1e-5)
    for layer in want:
        for name in want[layer]:
            np.testing.assert_allclose(
                got[layer][name],
                np.broadcast_to(want[layer][name], got[layer][name].shape),
                atol=1e-5,
                rtol=1e-5,
            )


def test_batch_plan_of_a_cycling_epoch():
    """Cycle (4, 2, 2) in an epoch of 12 batches, a send always pending: syncs every 4 batches and
    on the last one; merges at syncs and 2 batches after a send, except the send of batch 8, whose
    merge slips to the last batch (the delay is clamped to 1 there, H2)."""
    plans = [
        batch_plan(
            jnp.int32(b),
            (jnp.int32(4), jnp.int32(2), jnp.int32(2)),
            local_sync=jnp.asarray(False),
            pending_valid=jnp.asarray(True),
            have_previous=jnp.asarray(True),
            last_batch=11,
        )
        for b in range(12)
    ]
    where = lambda field: [b for b, p in enumerate(plans) if bool(getattr(p, field))]  # noqa: E731
    assert where("sync") == [0, 4, 8, 11]
    assert where("blocking") == [11]
    assert where("merge") == [0, 2, 4, 6, 8, 11]
    assert where("broadcast_previous") == where("merge")
    assert [int(plans[b].wait) for b in (0, 8, 10, 11)] == [2, 2, 1, 0]
    assert where("local_sync_next") == [3, 7, 10]  # before each sync and the last batch


def test_next_cycle_rules():
    rules = CycleRules(
        warmup_epochs=1,
        cooldown_start=10,
        first_cycle=(4, 1, 1),
        reset_cycle=(8, 2, 2),
        reduction_factor=2,
        patience=2,
    )

    def step(epoch, cycle, bad, improved=False, have_loss=True):
        out, bad, best = next_cycle(
            jnp.int32(epoch),
            tuple(jnp.int32(c) for c in cycle),
            jnp.int32(bad),
            improved=jnp.asarray(improved),
            have_loss=jnp.asarray(have_loss),
            rules=rules,
        )
        return tuple(int(c) for c in out), int(bad), bool(best)

    assert step(0, (0, 0, 0), 0) == ((0, 0, 0), 0, False)  # warm-up: blocking
    assert step(1, (0, 0, 0), 0) == ((4, 1, 1), 1, False)  # cycling starts, one bad epoch
    assert step(3, (4, 1, 1), 2) == ((2, 1, 1), 0, False)  # a plateau halves gs
    assert step(4, (2, 1, 1), 2) == ((1, 1, 1), 0, False)  # ls and btw stay ≥ 1
    assert step(5, (1, 1, 1), 2) == ((8, 2, 2), 0, False)  # from gs = 1: reset
    assert step(6, (8, 2, 2), 2, improved=True) == ((8, 2, 2), 0, True)  # a new best
    assert step(7, (8, 2, 2), 2, have_loss=False) == ((8, 2, 2), 2, False)  # nothing to judge
    assert step(10, (8, 2, 2), 0) == ((0, 0, 0), 0, False)  # cool-down: blocking
