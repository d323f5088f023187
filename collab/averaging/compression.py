"""The compression menu: how a run's gradients travel (`averaging.compression`, fixed by the run's manifest).

| name          | what travels                                                    | bytes vs fp32 | error (L2)  |
|---------------|-----------------------------------------------------------------|---------------|-------------|
| none          | fp32                                                            | 1x            | 0           |
| fp16          | fp16 (the default)                                              | 2x fewer      | < 1e-3      |
| scaled-fp16   | fp16 after centering and scaling each part (mean, std in fp32)  | 2x fewer      | < 1e-3      |
| uniform8bit   | 8-bit codes on a uniform grid of +-3 std (tails are clipped)    | ~4x fewer     | < 5e-2      |
| quantile8bit  | 8-bit codes on the part's 256 quantiles                         | ~4x fewer     | < 5e-2      |
| size-adaptive | tensors under 65537 elements fp16, larger ones uniform 8-bit    | 2x-4x fewer   | < 5e-2      |
| powersgd      | a rank-r factorisation P Q^T of each matrix, error feedback     | 10x+ fewer    | see below   |
| dgc           | the top 0.1% of each matrix's velocity, exactly; vectors fp16   | 100x+ fewer   | see below   |

(error: relative, of one part of Gaussian-like values; tests/unit/test_compression.py holds each codec to it.)
All but powersgd are hivemind's codecs applied to the parts of an ordinary round. powersgd is hivemind's
PowerSGDGradientAverager (two all-reduces per round: P, then Q; vectors travel whole in the second), with every
peer's starting projections Q drawn from the run's seed (collab.averaging.grad_averager). Its factors travel in fp32:
in fp16, wherever a sender keeps its own rounding (see collab.averaging.one_average), PowerSGD's orthogonalisation
and error feedback amplify the rounding, and without state averaging replicas drift apart within a few steps. dgc is
Deep Gradient Compression (collab.averaging.dgc): its loss is in what each peer selects; the selection travels
losslessly. The vectors DGC leaves dense (biases, LayerNorm: 0.6% of ALBERT-tiny's values) travel in fp16 as in the
default run: in fp32 they would be three quarters of a dgc round's bytes.

Parts are decoded by `decode_part` (collab's fixed 8-bit decoders and DGC's sparse parts, then hivemind's table for
the rest): hivemind's own decoder table is left as it is.
"""

from __future__ import annotations

import numpy as np
import torch
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    SizeAdaptiveCompression,
    Uniform8BitQuantization,
)
from hivemind.compression import serialization
from hivemind.compression.adaptive import AdaptiveCompressionBase
from hivemind.compression.quantization import _BLOCKWISE_QUANTIZATION_BLOCKSIZE, BlockwiseQuantization
from hivemind.proto import runtime_pb2

from collab.hivemind_hooks.patches import decode_averages_with

# a part of a tensor of at least this many elements travels in 8 bits under size-adaptive (as in hivemind's
# ALBERT example): its per-part codebook is then a negligible overhead and the rounding error averages out
SIZE_ADAPTIVE_THRESHOLD = 2**16 + 1
SPARSE_PARTS = 64  # DGC's parts' compression type: a value hivemind's CompressionType does not use


class _Extract8Bit:
    """hivemind 1.1.12's 8-bit extract reads the codebook size with int() of a one-element array, which numpy 2
    refuses (TypeError): every 8-bit part would fail to decode, so an 8-bit run could not average at all."""

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
        codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)


class Uniform8Bit(_Extract8Bit, Uniform8BitQuantization):
    pass


class Quantile8Bit(_Extract8Bit, Quantile8BitQuantization):
    pass


class Blockwise8Bit(BlockwiseQuantization):
    """bitsandbytes' blockwise 8-bit codec, which collab does not offer but decodes when a peer sends it: hivemind
    1.1.12's extract has the same int() of a one-element array as its other 8-bit codecs."""

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        try:
            from bitsandbytes.functional import dequantize_blockwise  # optional: only this codec needs it
        except ImportError:
            raise ValueError("a blockwise 8-bit part needs bitsandbytes to decode (pip install bitsandbytes)") from None
        buffer = serialized_tensor.buffer
        absmax_size, codebook_size = (int(n) for n in np.frombuffer(buffer, count=2, dtype=np.int64))
        absmax = np.frombuffer(buffer, offset=16, count=absmax_size, dtype=self.codebook_dtype)
        codebook = np.frombuffer(buffer, offset=16 + absmax.nbytes, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(buffer, offset=16 + absmax.nbytes + codebook.nbytes, dtype=self.indices_dtype)
        result = dequantize_blockwise(torch.as_tensor(quantized).reshape(tuple(serialized_tensor.size)),
                                      absmax=torch.as_tensor(absmax), code=torch.as_tensor(codebook),
                                      blocksize=_BLOCKWISE_QUANTIZATION_BLOCKSIZE, nested=False)
        return result.to(getattr(torch, serialized_tensor.dtype)).requires_grad_(serialized_tensor.requires_grad)


class SparseParts(CompressionBase):
    """dgc's wire codec: a part's non-zero values, exactly (fp32, with int32 positions), or the part whole in fp32
    when it is too dense for that to save bytes. Lossless, so all of DGC's loss is in its own selection: a lossy
    codec here would lose what the reducer sends back too (the average, or for an older peer the average minus
    its own part: collab.averaging.one_average), which DGC's error feedback never sees. The average of N k-sparse parts, and what is sent back, is at most N*k-sparse.

    Its compression type, SPARSE_PARTS, is collab's own: hivemind's enum has no such value (proto3 carries an
    unknown one on the wire as it is), and collab decodes it (decode_part)."""

    compression_type = SPARSE_PARTS

    def compress(self, tensor: torch.Tensor, info=None, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        flat = tensor.detach().reshape(-1).float()
        positions = flat.nonzero().reshape(-1)
        if positions.numel() * 8 < flat.numel() * 4:
            buffer = b"S" + positions.to(torch.int32).numpy().tobytes() + flat[positions].numpy().tobytes()
        else:
            buffer = b"D" + flat.numpy().tobytes()
        return runtime_pb2.Tensor(compression=self.compression_type, buffer=buffer, size=tensor.shape,
                                  dtype="float32", requires_grad=tensor.requires_grad)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer, shape = serialized_tensor.buffer, tuple(serialized_tensor.size)
        numel = int(np.prod(shape)) if shape else 1
        if buffer[:1] == b"D":
            flat = torch.from_numpy(np.frombuffer(buffer, dtype=np.float32, offset=1).copy())
        else:
            count = (len(buffer) - 1) // 8
            positions = torch.from_numpy(np.frombuffer(buffer, dtype=np.int32, count=count, offset=1).astype(np.int64))
            values = torch.from_numpy(np.frombuffer(buffer, dtype=np.float32, count=count, offset=1 + 4 * count).copy())
            if count and (int(positions.min()) < 0 or int(positions.max()) >= numel):
                raise ValueError(f"a sparse part names position {int(positions.max())} of a part of {numel} values")
            flat = torch.zeros(numel, dtype=torch.float32)
            flat[positions] = values
        if flat.numel() != numel:
            raise ValueError(f"a part holds {flat.numel()} values, its shape {shape} says {numel}")
        return flat.reshape(shape).requires_grad_(serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info) -> float:
        return 1.0  # unknown until the part is seen: hivemind sizes parts as if dense


class DGCWire(AdaptiveCompressionBase):
    """dgc's codec per tensor: a matrix's parts through SparseParts (exact), a vector's in fp16. A vector is not
    sparsified (collab.averaging.dgc.sparsified), so no error feedback rests on it; the reducer sends each part's
    average back with the codec it came in, so a vector's average returns in fp16 and a matrix's exactly."""

    def __init__(self):
        self.sparse, self.dense = SparseParts(), Float16Compression()

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        return self.sparse if len(info.descriptor.size) > 1 else self.dense


# the codecs collab encodes and decodes itself, by compression type (hivemind's table serves the rest)
_OWN_CODECS = {SPARSE_PARTS: SparseParts(), runtime_pb2.UNIFORM_8BIT: Uniform8Bit(),
               runtime_pb2.QUANTILE_8BIT: Quantile8Bit(), runtime_pb2.BLOCKWISE_8BIT: Blockwise8Bit()}


def encode_part(tensor: torch.Tensor, compression_type: int) -> runtime_pb2.Tensor:
    """A part through the codec of `compression_type` (what a reducer sends back: the codec the part came in)."""
    codec = _OWN_CODECS.get(compression_type)
    if codec is None:
        return serialization.serialize_torch_tensor(tensor, compression_type)
    return codec.compress(tensor, CompressionInfo.from_tensor(tensor))


def decode_part(serialized: runtime_pb2.Tensor) -> torch.Tensor:
    """A received part, decoded by its compression type. A type nobody knows is a ValueError, as in hivemind."""
    codec = _OWN_CODECS.get(serialized.compression)
    if codec is None:
        return serialization.deserialize_torch_tensor(serialized)
    return codec.extract(serialized)


def use_collab_decoders() -> None:
    """collab's decode_part decodes the averages reducers send back (collab.hivemind_hooks.patches). Called before
    the averagers' processes start."""
    decode_averages_with(decode_part)


def wire_codec(name: str) -> CompressionBase:
    """The codec for each tensor part of a round under `averaging.compression` = name."""
    use_collab_decoders()
    if name == "size-adaptive":
        return SizeAdaptiveCompression(SIZE_ADAPTIVE_THRESHOLD, less=Float16Compression(),
                                       greater_equal=Uniform8Bit())
    if name == "powersgd":  # its P and Q factors, exactly: the factorisation is where it saves (see above)
        return NoCompression()
    if name == "dgc":
        return DGCWire()
    return {"none": NoCompression, "fp16": Float16Compression, "scaled-fp16": ScaledFloat16Compression,
            "uniform8bit": Uniform8Bit, "quantile8bit": Quantile8Bit}[name]()
