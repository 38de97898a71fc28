"""Named values of the kernels' ``QUANT`` (the pool's format, :class:`kvcache.ops.paged.format.KVFormat` ``.code``) and
``MODE`` (how a batch says where its rows go) constexprs."""

import triton.language as tl

# QUANT: the format of the pool
Q_NONE = tl.constexpr(0)  # "auto": the model dtype
Q_FP8 = tl.constexpr(1)  # float8_e4m3fn with a per-layer scale
Q_INT8 = tl.constexpr(2)  # uint8 codes, (scale, zero) per (token, head)
Q_INT4 = tl.constexpr(3)  # two uint4 codes per byte (planar halves), (scale, zero) per (token, head)
Q_K8V4 = tl.constexpr(4)  # keys as Q_INT8 in two planes of D/2 bytes, values as Q_INT4 in a third
Q_FP8K = tl.constexpr(5)  # float8_e4m3fn: keys with a float32 scale per (token, head), values with a per-layer scale

# MODE: where the rows of a batch go
BY_KV_LENS = tl.constexpr(0)  # ragged: cu_q_lens + kv_lens (tokens cached before the append)
BY_CU_K_LENS = tl.constexpr(1)  # ragged: cu_q_lens + cu_k_lens (cumulative lengths after the append)
BY_SLOTS = tl.constexpr(2)  # slot mapping (+ positions)
