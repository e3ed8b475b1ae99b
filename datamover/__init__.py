"""The data mover: blocks between a paged KV cache and the store, through staging memory.

It imports torch and kvstore only -- never vLLM -- so it runs and is tested on a machine that
has PyTorch (and CUDA) but no vLLM. The connector's worker is thin glue over it.

- ``paged``: the KV cache as per-layer tensors ``[num_blocks, *block_shape]``; gathers and
  scatters many blocks with one op per layer.
- ``mover``: staging pools bounded by ``max_inflight_bytes``, saves staged off the forward path
  (CUDA: gathered and copied device-to-host on side streams) and loads received in place and
  scattered in batches -- whole blocks, or band of layers by band of layers;
- ``layered``: a load that lands band by band while a forward pass waits for each band before
  its layers run.
"""

from datamover.layered import LayeredLoad
from datamover.mover import (
    BandPiece,
    BlockMover,
    LoadChunk,
    SaveChunk,
    SaveItem,
    StagingBusyError,
    layer_bands,
)
from datamover.paged import PagedKV

__all__ = [
    "BandPiece",
    "BlockMover",
    "LayeredLoad",
    "LoadChunk",
    "PagedKV",
    "SaveChunk",
    "SaveItem",
    "StagingBusyError",
    "layer_bands",
]
