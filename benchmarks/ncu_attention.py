"""One paged-attention decode launch per call, under the bench's conditions (random blocks from a large pool), for
Nsight Compute:

    ncu --clock-control none --kernel-name regex:_attention_kernel --launch-skip 2 --launch-count 1 --set full \\
        -o int8 python3 benchmarks/ncu_attention.py int8 64 16384 128 fp16

Arguments: kv_dtype, sequences, cached tokens per sequence, head_dim, query dtype (fp16 / bf16); 32 / 8 heads,
block 16. The kernel runs three times (two to compile and warm up).
"""

import sys

import torch

sys.path.insert(0, "src")
import kvcache.bench.attention as ba  # noqa: E402
from kvcache.ops.attention import paged_attention  # noqa: E402

kv_dtype, batch, seq, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
qdt = torch.bfloat16 if len(sys.argv) > 5 and sys.argv[5] == "bf16" else torch.float16
ba.D = d
dev = torch.device("cuda")
gen = torch.Generator(dev).manual_seed(0)
bs = 16
p = ba.Pool(kv_dtype, bs, max(8192, batch * (-(-seq // bs)) * 11 // 10), dev, gen)
if kv_dtype == "auto":
    p.pool = p.pool.to(qdt)
bt = p.tables(batch, seq, gen)
q = torch.randn(batch, ba.HQ, d, dtype=qdt, device=dev, generator=gen)
cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
kl = torch.full((batch,), seq, dtype=torch.int32, device=dev)
out = torch.empty_like(q)
for _ in range(3):
    paged_attention(q, p.pool, p.params, p.kv_scales, kv_dtype=kv_dtype, layout="NHD", block_tables=bt,
                    cu_q_lens=cu, kv_lens=kl, out=out, max_kv_len=seq)
torch.cuda.synchronize()
print(kv_dtype, batch, seq, d, qdt, "ok", float(out.float().abs().mean()))
