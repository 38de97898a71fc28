"""One decode step (256 sequences x 1 token, ragged, 8 x 128 heads) appended to every layer of a 32-layer
cache inside a CUDA graph, replayed, for Nsight Compute's profile of graph nodes (L2-warm K/V and index
tensors, as in ``kvcache bench paged``; PDL as the defaults choose):

    ncu --graph-profiling node --kernel-name regex:_append --launch-skip 40 --launch-count 1 \\
        --section WarpStateStats python3 benchmarks/ncu_decode_graph.py int8 [rope]
"""

import sys

import torch

from kvcache.bench.paged import D, H, decode_batch, launch_decode_layers
from kvcache.paged import PagedConfig, PagedKVCache
from kvcache.rope import RopeConfig

kv_dtype = sys.argv[1] if len(sys.argv) > 1 else "int8"
dev = torch.device("cuda")
rope = RopeConfig(head_dim=D, base=500000.0).kernel_params(device=dev) if "rope" in sys.argv[2:] else None
b = decode_batch(dev, torch.Generator().manual_seed(1), 16)
cache = PagedKVCache(PagedConfig(num_layers=32, num_kv_heads=H, head_dim=D, block_size=16, num_blocks=b.num_blocks,
                                 kv_dtype=kv_dtype, device=dev))
launch_decode_layers(cache, b, ragged=True, rope=rope)  # compile outside the capture
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
stream = torch.cuda.Stream()
with torch.cuda.stream(stream):
    with torch.cuda.graph(graph, stream=stream):
        launch_decode_layers(cache, b, ragged=True, rope=rope)
for _ in range(3):
    graph.replay()
torch.cuda.synchronize()
