"""Disaggregated serving with the engine's model: prefill on one rank, decode on another.

The prefill rank runs a prompt through the engine's forward (:class:`~kvcache.engine.model.LlamaForward`, e.g.
``LLM(...).model``) into its paged cache, samples the first token, and sends the prompt's blocks
(:func:`kvcache.distributed.send_blocks`, every layer, scales included) plus the tokens and the request's sampler
state to the decode rank. The decode rank takes new blocks from its own allocator
(:func:`kvcache.distributed.recv_blocks`) and continues decoding from there: its tokens are the ones a
single process would generate (greedy, or seeded: the seeded generator's state travels with the request).

Both ranks' caches must have the same format (kv_dtype, layout, dtype, layers, KV heads, head_dim, block size;
the number of blocks may differ) and be built with the model's ``RopeConfig`` (keys are rotated by the append).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch
import torch.distributed as dist

from ..distributed import recv_blocks, send_blocks
from ..distributed._comm import check_peer, comm_device
from ..ops.paged.format import kv_format
from ..paged import BlockAllocator, PagedKVCache
from .model import LlamaForward
from .paged_runner import PagedRunner
from .sampling import SamplingParams, sample
from .scheduler import ScheduledBatch
from .sequence import Sequence

__all__ = ["prefill_and_send", "recv_and_decode"]


def _check(model: object, cache: object, allocator: object) -> None:
    if type(model) is not LlamaForward:
        raise TypeError(f"model: expected a single-rank kvcache.engine LlamaForward (LLM(...).model), got "
                        f"{type(model).__name__}")
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a kvcache.PagedKVCache, got {type(cache).__name__}")
    if not isinstance(allocator, BlockAllocator):
        raise TypeError(f"allocator: expected a kvcache.BlockAllocator, got {type(allocator).__name__}")
    c = cache.config
    if kv_format(c.kv_dtype).block_keys:
        raise ValueError(f"cache: kv_dtype {c.kv_dtype!r} is not served by disaggregated prefill yet (a partial "
                         "block's keys live in the next block too, which the transfer does not send)")
    want = (model.num_layers, model.num_kv_heads, model.head_dim)
    got = (c.num_layers, c.num_kv_heads, c.head_dim)
    if got != want:
        raise ValueError(f"cache: expected (layers, KV heads, head_dim) {want} (the model's), got {got}")
    if allocator.block_size != c.block_size or allocator.num_blocks > c.num_blocks:
        raise ValueError(f"allocator: expected blocks of {c.block_size} tokens, at most {c.num_blocks} of them (the "
                         f"cache's), got {allocator.num_blocks} of {allocator.block_size}")


def _runner(model: LlamaForward, cache: PagedKVCache) -> PagedRunner:
    c = cache.config
    return PagedRunner(model, cache, max_blocks_per_seq=c.num_blocks, max_model_len=c.num_blocks * c.block_size,
                       scratch_block=c.num_blocks - 1, cuda_graphs=False, max_graph_batch=1)


def _step(runner: PagedRunner, seq: Sequence, n: int) -> int:
    """Feed ``n`` tokens of ``seq`` from ``num_computed`` on; return the sampled next token."""
    logits = runner.run(ScheduledBatch(seqs=[seq], num_tokens=[n], sample=[True], preempted=[]))
    seq.num_computed += n
    return sample(logits, [seq.params], [seq.generator])[0]


def prefill_and_send(
    model: LlamaForward,
    cache: PagedKVCache,
    allocator: BlockAllocator,
    prompt_token_ids: Seq[int],
    sampling_params: SamplingParams,
    *,
    dst: int,
    group: dist.ProcessGroup | None = None,
) -> int:
    """Prefill ``prompt_token_ids`` on this rank, sample the first token, and send the request to rank ``dst``
    (which calls :func:`recv_and_decode`). The prompt's blocks are taken from ``allocator`` and given back once
    sent.

    Parameters
    ----------
    model : LlamaForward
        The engine's single-rank forward (``LLM(...).model``).
    cache : PagedKVCache
        A paged cache of the model's format, built with ``rope=model.rope``.
    allocator : BlockAllocator
        Owner of ``cache``'s blocks (``num_blocks`` at most the cache's).
    prompt_token_ids : sequence of int
        The prompt, token ids in ``[0, vocab)``.
    sampling_params : SamplingParams
        The request's; a seeded request's generator state is sent after its first draw.
    dst : int
        Global rank of the decode rank.
    group : ProcessGroup, optional
        Default: the world.

    Returns
    -------
    int
        The first generated token (the decode rank's first token too).

    Raises
    ------
    ValueError
        Bad arguments (before any message), or the decode rank's cache has another format.
    RuntimeError
        This allocator, or the decode rank's, has no room for the prompt's blocks.

    Example
    -------
    >>> llm = LLM(model, tokenizer=tok)                                                  # doctest: +SKIP
    >>> cache = PagedKVCache(PagedConfig(...), rope=llm.model.rope)                      # doctest: +SKIP
    >>> first = prefill_and_send(llm.model, cache, BlockAllocator(64, 16), ids,
    ...                          SamplingParams(max_tokens=8, temperature=0), dst=1)     # doctest: +SKIP
    """
    _check(model, cache, allocator)
    if not isinstance(sampling_params, SamplingParams):
        raise TypeError(f"sampling_params: expected a SamplingParams, got {type(sampling_params).__name__}")
    ids = [int(t) for t in prompt_token_ids]
    if not ids or any(not 0 <= t < model.vocab_size for t in ids):
        raise ValueError(f"prompt_token_ids: expected a non-empty list of ids in [0, {model.vocab_size}), got "
                         f"{ids[:8]}")
    dst = check_peer("dst", dst, group)
    seq = Sequence(0, ids, sampling_params)
    blocks = allocator.allocate(-(-len(ids) // cache.config.block_size))
    if blocks is None:
        raise RuntimeError(f"allocator: no room for the prompt's {len(ids)} tokens")
    try:
        seq.block_table = blocks
        first = _step(_runner(model, cache), seq, len(ids))
        dev = comm_device(group, cache.device)
        state = seq.generator.get_state() if seq.generator is not None else torch.empty(0, dtype=torch.uint8)
        tokens = torch.tensor(ids + [first], dtype=torch.int64)
        dist.send(torch.tensor([tokens.numel(), state.numel()], dtype=torch.int64, device=dev), dst, group=group)
        dist.send(tokens.to(dev), dst, group=group)
        if state.numel():
            dist.send(state.to(dev), dst, group=group)
        if not send_blocks(cache, blocks, dst, group):
            raise RuntimeError(f"dst: rank {dst}'s allocator has no room for the prompt's {len(blocks)} blocks")
    finally:
        allocator.free(blocks)
    return first


def recv_and_decode(
    model: LlamaForward,
    cache: PagedKVCache,
    allocator: BlockAllocator,
    sampling_params: SamplingParams,
    *,
    src: int,
    group: dist.ProcessGroup | None = None,
    eos_token_ids: Iterable[int] = (),
) -> list[int]:
    """Receive a request prefilled by :func:`prefill_and_send` on rank ``src`` and decode it to the end.

    Decoding stops after ``sampling_params.max_tokens`` tokens, or at a token of ``stop_token_ids`` or of
    ``eos_token_ids`` (unless ``ignore_eos``). The blocks (received, then grown for new tokens) come from
    ``allocator`` and are given back before returning.

    Parameters
    ----------
    model, cache, allocator
        As for :func:`prefill_and_send`, this rank's own.
    sampling_params : SamplingParams
        The request's (the same as the prefill rank's).
    src : int
        Global rank of the prefill rank.
    group : ProcessGroup, optional
        Default: the world.
    eos_token_ids : iterable of int
        The model's end-of-sequence tokens (``LLM.eos_token_ids``).

    Returns
    -------
    list of int
        The generated tokens, the prefill rank's first token included (a single-process ``generate``'s).

    Raises
    ------
    RuntimeError
        This allocator has no room for the request's blocks.

    Example
    -------
    >>> toks = recv_and_decode(llm.model, cache, BlockAllocator(64, 16),
    ...                        SamplingParams(max_tokens=8, temperature=0), src=0)   # doctest: +SKIP
    """
    _check(model, cache, allocator)
    if not isinstance(sampling_params, SamplingParams):
        raise TypeError(f"sampling_params: expected a SamplingParams, got {type(sampling_params).__name__}")
    eos = {int(t) for t in eos_token_ids}
    src = check_peer("src", src, group)
    dev = comm_device(group, cache.device)
    sizes = torch.empty(2, dtype=torch.int64, device=dev)
    dist.recv(sizes, src, group=group)
    n_tok, n_state = (int(x) for x in sizes.tolist())
    tokens = torch.empty(n_tok, dtype=torch.int64, device=dev)
    dist.recv(tokens, src, group=group)
    state = torch.empty(n_state, dtype=torch.uint8, device=dev)
    if n_state:
        dist.recv(state, src, group=group)
    blocks = recv_blocks(cache, allocator, src, group)
    if blocks is None:
        raise RuntimeError(f"allocator: no room for the {n_tok - 1} prompt tokens sent by rank {src}")
    toks = [int(t) for t in tokens.tolist()]
    seq = Sequence(0, toks[:-1], sampling_params)
    seq.token_ids.append(toks[-1])
    seq.num_computed = len(toks) - 1
    seq.block_table = blocks
    if seq.generator is not None and n_state:
        seq.generator.set_state(state.cpu())
    runner = _runner(model, cache)
    bs = cache.config.block_size
    p = sampling_params
    try:
        while True:
            last = seq.token_ids[-1]
            if (not p.ignore_eos and last in eos) or last in p.stop_token_ids or seq.num_generated >= p.max_tokens:
                break
            if len(seq.token_ids) > len(seq.block_table) * bs:
                more = allocator.allocate(1)
                if more is None:
                    raise RuntimeError(f"allocator: no room to decode past {len(seq.token_ids) - 1} tokens")
                seq.block_table.append(more[0])
            seq.token_ids.append(_step(runner, seq, 1))
    finally:
        allocator.free(seq.block_table)
    return seq.generated_ids
