"""Deep Gradient Compression (collab.averaging.dgc): error feedback, masking, clipping, warm-up, selection, and its
wire."""

from __future__ import annotations

import pytest
import torch

from hivemind.compression import CompressionInfo

from collab.averaging.compression import SparseParts, decode_part, wire_codec
from collab.averaging.dgc import DGCMemory, DGCSettings, top_mask


def test_warm_up_follows_the_papers_exponential_schedule_then_holds():
    settings = DGCSettings(sparsity=0.999, warmup_epochs=4)
    densities = [settings.density(e) for e in range(7)]
    assert [round(1 - d, 4) for d in densities[:5]] == [0.7488, 0.9369, 0.9842, 0.996, 0.999]
    assert densities[5] == densities[6] == pytest.approx(0.001)
    assert DGCSettings(sparsity=0.99, warmup_epochs=0).density(0) == pytest.approx(0.01)


def test_error_feedback_sends_every_gradient_eventually():
    """With no momentum, what was sent plus what waits in v is exactly the sum of the gradients; a top-k without
    that memory loses most of a small but steady gradient for good."""
    torch.manual_seed(0)
    shape, steps = (64, 64), 300
    drift = torch.randn(shape) * 0.05  # a steady signal under noise: what training needs to get through
    memory = DGCMemory([torch.zeros(shape)], DGCSettings(sparsity=0.99, warmup_epochs=0, momentum=0.0,
                                                         clip_norm=1e9))
    true_sum, sent_sum, forgetful_sum = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
    for _ in range(steps):
        g = drift + torch.randn(shape)
        true_sum += g
        forgetful_sum += torch.where(top_mask(g, 0.01), g, torch.zeros_like(g))
        sent = g.clone()
        memory.compress_([sent], epoch=100, peers=1)
        assert int((sent != 0).sum()) <= 2 * 41  # ~1% of 4096 values per step
        sent_sum += sent
    assert torch.allclose(sent_sum + memory.v[0], true_sum, atol=1e-3)
    gap = ((sent_sum - true_sum).norm() / true_sum.norm()).item()
    forgetful_gap = ((forgetful_sum - true_sum).norm() / true_sum.norm()).item()
    assert gap < 0.25 and forgetful_gap > 0.9, (gap, forgetful_gap)


def test_momentum_is_corrected_and_masked_where_values_were_sent():
    g = torch.tensor([[4.0, 1.0], [0.5, 0.25]])
    memory = DGCMemory([g], DGCSettings(sparsity=0.75, warmup_epochs=0, momentum=0.5, clip_norm=1e9))
    sent = g.clone()
    memory.compress_([sent], epoch=0, peers=1)
    assert sent.tolist() == [[4.0, 0.0], [0.0, 0.0]]  # the top 25% of v = u = g
    assert memory.u[0].tolist() == [[0.0, 1.0], [0.5, 0.25]] and memory.v[0].tolist() == [[0.0, 1.0], [0.5, 0.25]]
    g2 = torch.tensor([[0.0, 1.0], [0.5, 0.25]])
    sent = g2.clone()
    memory.compress_([sent], epoch=1, peers=1)
    # u = 0.5 u + g2 = [[0, 1.5], [0.75, 0.375]]; v = v + u = [[0, 2.5], [1.25, 0.625]]: its top 25% goes out
    assert sent.tolist() == [[0.0, 2.5], [0.0, 0.0]]
    assert memory.u[0].tolist() == [[0.0, 0.0], [0.75, 0.375]] and memory.v[0].tolist() == [[0.0, 0.0], [1.25, 0.625]]


def test_local_clipping_scales_with_the_swarm_and_vectors_go_whole():
    matrix, vector = torch.full((10, 10), 10.0), torch.full((5,), 10.0)  # norm ~100.6
    memory = DGCMemory([matrix, vector], DGCSettings(sparsity=0.0, warmup_epochs=0, momentum=0.0, clip_norm=1.0))
    sent = [matrix.clone(), vector.clone()]
    memory.compress_(sent, epoch=0, peers=4)
    norm = torch.sqrt(sum(s.pow(2).sum() for s in sent))
    assert norm == pytest.approx(2.0, rel=1e-4)  # clip_norm * sqrt(4)
    assert memory.u[1] is None and torch.all(sent[1] != 0)


def test_a_sampled_threshold_selects_about_k_of_the_largest():
    torch.manual_seed(1)
    values = torch.randn(1_000_000)
    mask = top_mask(values, 0.001, torch.Generator().manual_seed(0))
    k = 1000
    assert 0.5 * k <= int(mask.sum()) <= 1.5 * k
    exact = torch.topk(values.abs(), k // 2).indices
    assert bool(mask[exact].all()), "the largest half of the top-k must all be selected"
    small = torch.randn(5000)
    assert int(top_mask(small, 0.01).sum()) == 50  # exact for small tensors


def test_sparse_parts_travel_exactly_in_about_8_bytes_per_value_and_bad_ones_are_refused():
    codec = SparseParts()
    part = torch.zeros(10_000)
    part[torch.randperm(10_000)[:10]] = torch.randn(10)
    wire = codec.compress(part)
    assert torch.equal(codec.extract(wire), part) and len(wire.buffer) == 1 + 8 * 10
    dense = torch.randn(100)
    assert torch.equal(codec.extract(codec.compress(dense)), dense) and len(codec.compress(dense).buffer) == 401
    # per tensor (DGCWire): a matrix's selection exactly, a vector (never sparsified) in fp16
    matrix, vector = torch.zeros(100, 100), torch.randn(1000)
    matrix.view(-1)[torch.randperm(10_000)[:10]] = torch.randn(10)
    dgc = wire_codec("dgc")
    on_wire = dgc.compress(matrix.reshape(-1), CompressionInfo.from_tensor(matrix))
    assert torch.equal(decode_part(on_wire), matrix.reshape(-1)) and len(on_wire.buffer) == 1 + 8 * 10
    on_wire = dgc.compress(vector, CompressionInfo.from_tensor(vector))
    assert len(on_wire.buffer) == 2 * 1000 and torch.allclose(decode_part(on_wire), vector, rtol=1e-3)
    del wire.size[:]
    wire.size.append(100)  # a peer that names positions outside its part
    with pytest.raises(ValueError, match="position"):
        codec.extract(wire)

