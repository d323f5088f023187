"""Two real averagers (DHT, p2pd, hivemind's averager processes) on 127.0.0.1: what collab's codecs and checks give on
the wire."""

from __future__ import annotations

import time

import pytest
import torch

from collab.averaging.dgc import DGCSettings
from collab.swarm.node import OwnGroupDHT, shut_down_dht


def test_two_peers_average_their_sparse_selections_exactly_through_hivemind(no_leftover_processes):
    """Real DHTs, p2pd and all-reduce: what comes back is the exact weighted mean of what the two peers selected
    (checked value by value, not by hivemind's success flag), at most twice as dense, in far fewer bytes."""
    from collab.averaging.aggregation import Aggregation
    from collab.averaging.compression import wire_codec
    from collab.averaging.grad_averager import CollabDGCAverager
    from collab.averaging.traffic import TrafficLog

    torch.manual_seed(0)
    first = OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs())
    settings = DGCSettings(sparsity=0.99, warmup_epochs=0, momentum=0.9, clip_norm=1e9)
    models = [torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 32)) for _ in range(2)]
    traffic = [TrafficLog(), TrafficLog()]
    averagers = []
    try:
        for dht, model, log in zip((first, second), models, traffic):
            averagers.append(CollabDGCAverager(
                model.parameters(), settings=settings, seed=0, rule=Aggregation(method="mean"), traffic=log.queue,
                dht=dht, prefix="dgc_test_grad_averager", compression=wire_codec("dgc"), target_group_size=2,
                min_matchmaking_time=3.0, start=True))
        for averager, model, samples in zip(averagers, models, (3, 5)):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            averager.accumulate_grads_(batch_size=samples)
            averager.set_round_context(epoch=0, peers=2)
        controls = [averager.step(wait=False, timeout=60) for averager in averagers]
        for control in controls:
            control.result(timeout=90)
        sent = [averager.take_own_gradients() for averager in averagers]
        for averager in averagers:
            with averager.get_tensors() as averaged:
                for got, a, b in zip(averaged, *sent):
                    if got.dim() == 1:  # a vector is not sparsified and travels in fp16, as in a default run
                        assert torch.allclose(got, (3 * a + 5 * b) / 8, rtol=2e-3, atol=2e-3), "not the mean"
                        continue
                    assert torch.allclose(got, (3 * a + 5 * b) / 8, atol=1e-6), "not the exact weighted mean"
                    if got.dim() > 1:
                        assert 0 < int((got != 0).sum()) <= int((a != 0).sum()) + int((b != 0).sum())
                        assert int((a != 0).sum()) <= 0.015 * a.numel()
        for log in traffic:
            this = log.end_round(wait=5.0)
            assert this is not None and this.ratio >= 8, this
    finally:
        for averager in averagers:
            averager.shutdown()
        shut_down_dht(second)
        shut_down_dht(first)


@pytest.mark.parametrize("older_peer", [False, True], ids=["all-current", "one-older-collab"])
def test_every_member_of_an_fp16_group_applies_the_same_average(older_peer, no_leftover_processes):
    """Three real averagers, fp16 on the wire, parts small enough that each reduces some: every member ends with the
    very same average (collab.averaging.one_average), where hivemind's differences left each sender its own
    rounding (~5e-4 of a gradient apart, a drift that never stopped without state averaging). With an older peer
    in the group (differences both ways, as hivemind sends them) the group still averages correctly."""
    from collab.averaging.compression import wire_codec
    from collab.averaging.grad_averager import CollabGradientAverager

    torch.manual_seed(0)
    dhts = [OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
    dhts += [OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                         initial_peers=dhts[0].get_visible_maddrs()) for _ in range(2)]
    models = [torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 32)) for _ in range(3)]
    averagers, samples = [], (3, 5, 7)
    try:
        for dht, model in zip(dhts, models):
            averagers.append(CollabGradientAverager(
                model.parameters(), dht=dht, prefix="fp16_test_grad_averager", compression=wire_codec("fp16"),
                part_size_bytes=4096, target_group_size=3, min_matchmaking_time=3.0, start=False))
        # (a subclass would not do: hivemind names its RPCs after the averager's class)
        averagers[2].exchange_averages = not older_peer
        for averager in averagers:
            averager.run_in_background(await_ready=True)
        for averager, model, n in zip(averagers, models, samples):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            averager.accumulate_grads_(batch_size=n)
        controls = [averager.step(wait=False, timeout=60) for averager in averagers]
        for control in controls:
            assert control.result(timeout=90) is not None
        sent = [averager.take_own_gradients() for averager in averagers]
        results = []
        for averager in averagers:
            with averager.get_tensors() as averaged:
                results.append([t.clone() for t in averaged])
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in reversed(dhts):
            shut_down_dht(dht)
    for got in results:
        for tensor, *own in zip(got, *sent):
            mean = sum(n * g for n, g in zip(samples, own)) / sum(samples)
            assert torch.allclose(tensor, mean, atol=2e-3), "not the group's weighted mean"
    if not older_peer:
        spread = max(float((a - b).abs().max()) for first, other in zip(results, results[1:]) for a, b in zip(first, other))
        assert spread <= 1e-6, f"the members applied different averages: {spread:.2e} apart"


def test_powersgd_peers_start_with_identical_projections():
    """hivemind draws PowerSGD's starting Q unseeded: two peers of one run began in different subspaces."""
    from collab.averaging.grad_averager import CollabPowerSGDAverager

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 32))
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
        return net

    def projections(net: torch.nn.Module, prefix: str) -> list[torch.Tensor]:
        averager = CollabPowerSGDAverager(net.parameters(), 4, seed=7, dht=dht, prefix=prefix, start=False)
        return [q.clone() for q in averager._qs]

    dht = OwnGroupDHT(start=True)
    try:
        first = projections(model(1), "peer1")  # each peer's process has its own random stream here
        net = model(2)
        torch.manual_seed(5)
        second = projections(net, "peer2")
        after = torch.rand(3)
        assert [q.shape[1] for q in first] == [4, 4]
        assert all(torch.equal(a, b) for a, b in zip(first, second)), "peers of one run start from different Q"
        torch.manual_seed(5)
        assert torch.equal(after, torch.rand(3)), "the seeded draw moved the process's own random stream"
    finally:
        shut_down_dht(dht)


def test_a_failed_round_keeps_the_gradients_this_peer_sent(no_leftover_processes):
    """hivemind zeroes the accumulators when the round starts; the copy taken then is what a failed round
    steps on (before, its fallback loaded zeros: a step of momentum and weight decay alone)."""
    from collab.averaging.grad_averager import CollabGradientAverager

    model = torch.nn.Linear(8, 2)
    dht = OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = CollabGradientAverager(model.parameters(), dht=dht, prefix=f"guard-{time.time_ns()}", start=True,
                                      min_matchmaking_time=0.5, request_timeout=0.25)
    try:
        model(torch.randn(3, 8)).pow(2).sum().backward()
        sent = [p.grad.clone() for p in model.parameters()]
        averager.accumulate_grads_(batch_size=3)
        control = averager.step(wait=False, timeout=2.0)  # nobody to average with: the round fails
        try:
            control.result(timeout=10)
        except Exception:
            pass
        assert all(float(acc.abs().sum()) == 0 for acc in averager._grad_accumulators())  # hivemind zeroed them
        own = averager.take_own_gradients()
        assert own is not None and all(torch.allclose(o, s) for o, s in zip(own, sent))
        assert averager.take_own_gradients() is None  # used once
    finally:
        averager.shutdown()
        shut_down_dht(dht)


@pytest.mark.parametrize("reuse", [True, False], ids=["in-grad", "own-accumulators"])
def test_a_window_of_summed_micro_batches_counts_as_that_many(reuse, no_leftover_processes):
    """The trainer hands over n micro-batches' gradients summed in .grad with n x micro-batch samples
    (collab.train.window): what goes into the round is their mean, as if each had been handed over alone."""
    from collab.averaging.grad_averager import CollabGradientAverager

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(3)]
    dht = OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = CollabGradientAverager(model.parameters(), dht=dht, prefix=f"window-{time.time_ns()}", start=True,
                                      micro_batch_size=4, reuse_grad_buffers=reuse)
    try:
        for p, a, b in zip(model.parameters(), grads[0], grads[1]):
            p.grad = a + b  # a window of two
        averager.accumulate_grads_(batch_size=8)
        for p, c in zip(model.parameters(), grads[2]):
            p.grad = p.grad + c if reuse else c.clone()  # in .grad, the sum goes on; else a window of one
        averager.accumulate_grads_(batch_size=4)
        assert (averager.local_samples_accumulated, averager.local_times_accumulated) == (12, 3)
        averager.load_accumulators_into_averager_()
        with averager.get_tensors() as sent:
            for got, *parts in zip(sent, *grads):
                torch.testing.assert_close(got, sum(parts) / 3)
    finally:
        averager.shutdown()
        shut_down_dht(dht)


def test_donors_of_one_epoch_are_ordered_by_their_uplink_and_never_above_a_newer_epoch(no_leftover_processes):
    """hivemind downloads state from the highest priority its averagers declare in the DHT: a 2 Mbit/s uplink
    (160 s for a 40 MB state) must come after a faster one at the same epoch (one that announced nothing counts
    as 100 Mbit/s), and before nobody an epoch ahead. Checked on what real averagers declare, where hivemind's
    download reads it."""
    from hivemind.p2p import PeerID

    from collab.averaging.replica import RecordingStateAverager

    prefix = f"donors-{time.time_ns()}"
    first = OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dhts, averagers = [first], []
    try:
        for upload in (2.0, 1000.0, None, 2.0):
            if averagers:  # the first averager shares the first DHT node; each other one gets its own
                dhts.append(OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                            initial_peers=first.get_visible_maddrs()))
            dht = dhts[-1]
            model = torch.nn.Linear(4, 2)
            averagers.append(RecordingStateAverager(
                dht=dht, prefix=prefix, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                params=model.parameters(), bandwidth=upload, start=True))
        for averager, epoch in zip(averagers, (5, 5, 5, 6)):
            averager.state_sharing_priority = epoch

        def declared():
            entries, _ = first.get(f"{prefix}.all_averagers", latest=True) or ({}, None)
            # keyed as hivemind's download reads them: PeerID(subkey)
            values = {PeerID(key): float(entry.value) for key, entry in entries.items()}
            return values if len(values) == 4 and min(values.values()) >= 5 else None
        deadline = time.monotonic() + 30
        while (found := declared()) is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert found is not None, "the averagers did not declare their state in the DHT within 30 s"
        by_peer = [found[a.peer_id] for a in averagers]
        slow, fast, unknown, slow_ahead = by_peer
        assert 5 <= slow < unknown < fast < 6 <= slow_ahead < 7, by_peer
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            shut_down_dht(dht)
