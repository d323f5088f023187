"""The compression menu: each codec within its stated error and bytes (collab.averaging.compression), PowerSGD's
seeded start."""

from __future__ import annotations

import pytest
import torch
from hivemind.compression import CompressionInfo

from collab.averaging.compression import decode_part, wire_codec
from collab.config import COMPRESSIONS

# name -> (relative L2 error at most, fp32 bytes / wire bytes at least) for a large Gaussian part; the table in
# collab.averaging.compression states the same
STATED = {"none": (0.0, 1.0), "fp16": (1e-3, 1.99), "scaled-fp16": (1e-3, 1.99), "uniform8bit": (5e-2, 3.9),
          "quantile8bit": (5e-2, 3.9), "size-adaptive": (5e-2, 3.9), "powersgd": (0.0, 0.99),
          "dgc": (1e-3, 1.99)}  # a vector: fp16; a matrix's selection travels exactly (test_dgc), its saving


@pytest.mark.parametrize("name", COMPRESSIONS)
def test_each_codec_round_trips_within_its_stated_bound(name):
    torch.manual_seed(0)
    error_bound, ratio_bound = STATED[name]
    for size in (1000, 200_000):
        x = torch.randn(size) * 3e-3 + 1e-4  # a gradient's scale, not centred
        wire = wire_codec(name).compress(x, CompressionInfo.from_tensor(x))
        # decoded as a receiving averager does: collab's decoders by the part's compression type, then hivemind's
        y = decode_part(wire)
        assert y.shape == x.shape and y.dtype == x.dtype
        error = ((y - x).norm() / x.norm()).item()
        assert error <= error_bound, f"{name}: relative error {error:.2e} > {error_bound:.0e} ({size} values)"
        if size == 200_000:  # an 8-bit part carries a 1 KB codebook; size-adaptive sends small tensors in fp16
            ratio = x.numel() * 4 / len(wire.buffer)
            assert ratio >= ratio_bound, f"{name}: {ratio:.2f}x fewer bytes than fp32, stated {ratio_bound}x"
    if name == "size-adaptive":
        small = torch.randn(1000)
        assert len(wire_codec(name).compress(small, CompressionInfo.from_tensor(small)).buffer) == 2 * 1000



def test_hivemind_codecs_keep_their_slots_and_a_real_blockwise_part_decodes():
    """DGC's sparse parts have a compression type of their own (it once took BLOCKWISE_8BIT's slot in hivemind's
    table, so a real blockwise part would have been read as sparse): hivemind's table is untouched, a part made by
    hivemind's own blockwise codec (bitsandbytes) decodes correctly, and a sparse part keeps its type through
    protobuf's wire format."""
    from hivemind.compression import serialization
    from hivemind.compression.quantization import BlockwiseQuantization
    from hivemind.proto import runtime_pb2

    from collab.averaging.compression import SPARSE_PARTS, SparseParts

    wire_codec("dgc")  # what a run does first: collab's decoders in place
    table = serialization._BASE_COMPRESSION_TYPES
    assert type(table["BLOCKWISE_8BIT"]) is BlockwiseQuantization and SPARSE_PARTS not in runtime_pb2.CompressionType.values()
    torch.manual_seed(0)
    x = torch.randn(50_000) * 3e-3
    blockwise = BlockwiseQuantization().compress(x, CompressionInfo.from_tensor(x))
    assert blockwise.compression == runtime_pb2.BLOCKWISE_8BIT
    error = ((decode_part(blockwise) - x).norm() / x.norm()).item()
    assert error < 2e-2, f"a blockwise 8-bit part decoded {error:.2e} away from what was sent"
    sparse = torch.zeros(1000)
    sparse[::100] = torch.randn(10)
    received = runtime_pb2.Tensor.FromString(SparseParts().compress(sparse).SerializeToString())
    assert received.compression == SPARSE_PARTS and torch.equal(decode_part(received), sparse)
    with pytest.raises(ValueError):  # a type nobody knows
        decode_part(runtime_pb2.Tensor(compression=63, buffer=b"x", size=[1], dtype="float32"))
