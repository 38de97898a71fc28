"""Greedy generation through a cache compared with DynamicCache: token agreement and logit error.

``python -m tests.hf.quality`` (from the repo root) measures fp8 / int8 / int4 paged caches on SmolLM2 over
the 16 questions x 64 new tokens and prints the table of docs/hf.md (about a minute on one CPU core per kind).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Agreement:
    tokens: int  # generated tokens compared
    same: int  # equal at the same position
    prefix: float  # mean fraction of each row generated before its first difference
    max_logit_err: float  # max |logit - reference| over the steps whose inputs were still identical
    logit_range: float  # max |reference logit| over the same steps (scale of the error)

    @property
    def agreement(self) -> float:
        return self.same / self.tokens


def greedy(model: torch.nn.Module, inputs: dict[str, torch.Tensor], cache: object, n: int, attn: str
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """New tokens ``[B, n]`` and their logits ``[B, n, V]`` (greedy, no early stop)."""
    model.set_attn_implementation(attn)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    T = inputs["input_ids"].shape[1]
    return out.sequences[:, T:], torch.stack(out.logits, dim=1).float()


def compare(model: torch.nn.Module, inputs: dict[str, torch.Tensor], make_cache: Callable[[], object], n: int,
            attn: str = "kvcache_paged", reference: tuple[torch.Tensor, torch.Tensor] | None = None) -> Agreement:
    """Run greedy generation with ``make_cache()`` and with DynamicCache (or ``reference``) and compare."""
    from transformers import DynamicCache

    if reference is None:
        reference = greedy(model, inputs, DynamicCache(config=model.config), n, "sdpa")
    ref_tok, ref_logits = reference
    tok, logits = greedy(model, inputs, make_cache(), n, attn)
    same = tok == ref_tok
    # step t's inputs are identical while every earlier token agreed
    alive = torch.cat([torch.ones_like(same[:, :1]), same[:, :-1].cumprod(dim=1).bool()], dim=1)
    err = (logits - ref_logits).abs().amax(dim=-1)[alive]
    first_diff = torch.where(same.all(dim=1), n, (~same).int().argmax(dim=1))
    return Agreement(
        tokens=same.numel(), same=int(same.sum()), prefix=float(first_diff.float().mean() / n),
        max_logit_err=float(err.max()), logit_range=float(ref_logits.abs().amax(dim=-1)[alive].max()),
    )


def main() -> None:
    import time

    from kvcache.hf import PagedCache

    from .conftest import QUESTIONS, load_smollm2

    torch.set_num_threads(1)
    m = load_smollm2()
    inputs = m.batch(QUESTIONS)
    n = 64
    from transformers import DynamicCache

    ref = greedy(m.model, inputs, DynamicCache(config=m.model.config), n, "sdpa")
    B, T = inputs["input_ids"].shape
    print(f"SmolLM2-135M-Instruct fp32, {B} prompts x {n} new tokens (greedy), prompt <= {T} tokens, "
          f"torch {torch.__version__}")
    print("| kv_dtype | tokens equal | mean prefix before the first difference | max logit error | max logit | s |")
    print("|---|---|---|---|---|---|")
    for kv in ("auto", "fp8", "int8", "int4"):
        t = time.perf_counter()
        a = compare(m.model, inputs, lambda kv=kv: PagedCache(m.model.config, max_batch_size=B,
                                                               max_cache_len=T + n, kv_dtype=kv), n, reference=ref)
        print(f"| {kv} | {a.same}/{a.tokens} ({a.agreement:.1%}) | {a.prefix:.1%} | {a.max_logit_err:.3g} | "
              f"{a.logit_range:.3g} | {time.perf_counter() - t:.0f} |", flush=True)


if __name__ == "__main__":
    main()
