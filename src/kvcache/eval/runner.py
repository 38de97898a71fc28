"""How the eval drives a model: the reference forward (transformers' DynamicCache under the model's own attention)
and a format's forward (:class:`kvcache.hf.PagedCache` under ``"kvcache_paged"``, attention reading the stored
blocks), switching the model's attention implementation between them and restoring it at the end."""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["Runner"]

PAGED = "kvcache_paged"


class Runner:
    """Runs forwards of ``model`` with the reference cache or a stored format's cache.

    Parameters
    ----------
    model : transformers PreTrainedModel
        A causal LM; its ``config._attn_implementation`` is the reference's (``"sdpa"`` when it is already
        ``"kvcache_paged"``) and is restored by :meth:`close`.
    block_size : int
        Tokens per block of the paged caches.
    """

    def __init__(self, model: Any, block_size: int) -> None:
        import kvcache.hf  # registers "kvcache_paged"

        self._hf = kvcache.hf
        self.model = model
        self.block_size = block_size
        self.original = getattr(model.config, "_attn_implementation", None) or "sdpa"
        self.reference_attn = self.original if self.original != PAGED else "sdpa"
        self._current = self.original
        self.device = next(model.parameters()).device
        # transformers 5.24 names the argument ``cache`` (``past_key_values`` is deprecated); older versions do not
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _attn(self, name: str) -> None:
        if self._current != name:
            self.model.set_attn_implementation(name)
            self._current = name

    def cache(self, kv_dtype: str | None, rows: int, tokens: int) -> Any:
        """A fresh cache for ``rows`` sequences of up to ``tokens`` tokens: DynamicCache (``kv_dtype=None``, the
        reference) or a PagedCache storing ``kv_dtype``."""
        if kv_dtype is None:
            from transformers import DynamicCache

            return DynamicCache(config=self.model.config)
        return self._hf.PagedCache(self.model.config, max_batch_size=rows, max_cache_len=tokens, kv_dtype=kv_dtype,
                                   block_size=self.block_size, device=self.device)

    def forward(self, ids: torch.Tensor, cache: Any, paged: bool) -> torch.Tensor:
        """Logits ``[B, T, V]`` (float32) of ``ids`` ``[B, T]`` appended to ``cache``."""
        self._attn(PAGED if paged else self.reference_attn)
        with torch.inference_mode():
            return self.model(input_ids=ids, use_cache=True, **{self.cache_kw: cache}).logits.float()

    def generate(self, ids: torch.Tensor, mask: torch.Tensor, cache: Any, paged: bool, max_new_tokens: int,
                 pad_token_id: int) -> torch.Tensor:
        """Greedy new tokens ``[B, <= max_new_tokens]`` of left-padded prompts ``ids`` / ``mask`` ``[B, T]``."""
        self._attn(PAGED if paged else self.reference_attn)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=max_new_tokens, pad_token_id=pad_token_id, temperature=None,
                                      top_p=None, top_k=None, **{self.cache_kw: cache})
        return out[:, ids.shape[1]:]

    def bytes_per_token(self, cache: Any) -> float:
        """Bytes per token and layer that a used PagedCache allocated (its pools, (scale, zero) included)."""
        paged = cache.paged
        cfg = paged.config
        return paged.nbytes / (cfg.num_layers * cfg.num_blocks * cfg.block_size)

    def close(self) -> None:
        """Give the model back its own attention implementation."""
        self._attn(self.original)
