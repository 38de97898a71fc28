"""``kvcache plan`` counts a sliding-window layer at its window, as the engine holds it, not at the context."""

from __future__ import annotations

import json

import torch
from transformers import Gemma3TextConfig

from kvcache.cli import main
from kvcache.hf.plan import describe_windows, plan
from kvcache.paged import cache_block_bytes

GIB = 2**30
SEQ = 8192


def _gemma3(**over) -> Gemma3TextConfig:
    # Gemma 3's pattern: 5 sliding layers (window 1024) per global one
    kw = dict(num_hidden_layers=12, hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
              sliding_window=1024, max_position_embeddings=SEQ)
    return Gemma3TextConfig(**{**kw, **over})


def test_window_layers_count_at_their_window():
    cfg = _gemma3()
    assert cfg.layer_types.count("sliding_attention") == 10
    layer_block = cache_block_bytes(1, 4, 256, 16, torch.bfloat16)  # 16 tokens of one layer
    _, _, rows = plan(cfg, 8 * GIB, SEQ, dtype=torch.bfloat16)
    paged = rows[0]
    # a sequence: 512 blocks in each of the 2 global layers, ceil(1024 / 16) + 1 = 65 in each of the 10 sliding ones
    per_seq = (2 * 512 + 10 * 65) * layer_block
    assert (paged.cache, paged.sequences, paged.tokens) == ("paged", 8 * GIB // per_seq, 8 * GIB // per_seq * SEQ)
    assert paged.bytes_per_token == per_seq / SEQ
    # the same model with every layer global holds 12 x 512 blocks a sequence: 3.7x fewer sequences
    _, _, full = plan(_gemma3(layer_types=["full_attention"] * 12), 8 * GIB, SEQ, dtype=torch.bfloat16)
    assert full[0].sequences == 8 * GIB // (12 * 512 * layer_block) == 21 and paged.sequences == 78
    # the linear cache: sliding layers' slots hold twice the window
    linear = next(r for r in rows if r.cache == "linear" and r.kv_dtype == "bfloat16")
    token = 2 * 4 * 256 * 2  # K and V of one token in one layer
    assert linear.sequences == 8 * GIB // (token * (2 * SEQ + 10 * 2048))


def test_plan_prints_the_window_layers(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_gemma3().to_dict()))
    assert main(["plan", "--model", str(path), "--memory", "8GiB", "--seq-len", str(SEQ)]) == 0
    out = capsys.readouterr().out
    line = ("layers: 10 with sliding window 1024 (paged: 65 blocks of 16 a sequence, linear: 2048 tokens), "
            "2 full attention")
    assert line in out and describe_windows(_gemma3(), SEQ) == line
    assert describe_windows(_gemma3(layer_types=["full_attention"] * 12), SEQ) == ""
