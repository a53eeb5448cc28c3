"""The hit rule's boundaries, alone and through a warehouse lookup.

usable = floor_to_block(min(matched, L - reserve)); reserve = window + backtrack
(134 for DeepSeek-V4-style hybrid models), at least 1 for full attention.
"""

from __future__ import annotations

import asyncio

import pytest

from common.config import ConfigError, HitRule
from kvstore.types import RequestCtx
from kvstore.warehouse import Warehouse
from tests.kvstore.storeproc import blocks, keys, wh_config

SWA = HitRule(block_tokens=64, window=128, backtrack=6)
FULL = HitRule(block_tokens=64)


@pytest.mark.parametrize(("matched", "prompt", "usable"), [
    # L - 134 lands exactly on a block boundary: 1158 - 134 = 1024.
    (1088, 1158, 1024),
    # One token fewer: 1023 rounds down to the previous block.
    (1088, 1157, 960),
    # One token more: still capped by L - 134 = 1025 -> 1024.
    (2048, 1159, 1024),
    # The match is shorter than the rule allows: the match decides.
    (512, 4096, 512),
    (576, 4096, 576),
    # Prompts shorter than the reserve (+ a block) get nothing.
    (64, 134, 0),
    (128, 197, 0),
    (128, 198, 64),
    (0, 10_000, 0),
])
def test_swa_rule_l_minus_134(matched: int, prompt: int, usable: int) -> None:
    assert SWA.reserve == 134
    assert SWA.usable_tokens(matched, prompt) == usable


@pytest.mark.parametrize(("matched", "prompt", "usable"), [
    (128, 128, 64),      # fully cached prompt: the last token is computed, so its block is too
    (128, 129, 128),     # one token past two full blocks: both restore
    (64, 65, 64),
    (64, 64, 0),
    (1, 1, 0),
    (640, 10_000, 640),  # match shorter than L - 1
])
def test_full_attention_reserves_one_token(matched: int, prompt: int, usable: int) -> None:
    assert FULL.reserve == 1
    assert FULL.usable_tokens(matched, prompt) == usable


def test_rule_is_configurable_and_validated() -> None:
    assert HitRule(block_tokens=16, window=4, backtrack=2).usable_tokens(64, 64) == 48
    with pytest.raises(ConfigError, match="replay_keep_tokens"):
        HitRule(window=128, backtrack=20)            # reserve 148 > replay_keep_tokens 140


def test_lookup_applies_the_rule_to_the_matched_chain(redis_url: str) -> None:
    async def body() -> None:
        cfg = wh_config(redis_url, hit_rule=SWA)
        wh = await Warehouse(cfg).start()
        try:
            ks = keys(20)
            ctx = RequestCtx(tenant="t")
            await wh.put(ks[:17], blocks(17), layout="L2xH2xT64xD1:float32",
                         token_counts=[64] * 17, ctx=ctx)
            # 17 blocks stored (1088 tokens); prompt of 1158 tokens: L - 134 = 1024.
            r = await wh.lookup(ks[:18], prompt_tokens=1158 + 64, ctx=ctx)
            assert (r.matched_blocks, r.usable_tokens) == (17, 1088)
            r = await wh.lookup(ks[:18], prompt_tokens=1158, ctx=ctx)
            assert (r.matched_blocks, r.usable_tokens) == (17, 1024)
            r = await wh.lookup(ks[:18], prompt_tokens=1157, ctx=ctx)
            assert r.usable_tokens == 960
            assert r.block_tiers == ["G2"] * 17
            # Matched shorter than the rule: a gap after block 8.
            await wh.delete(ks[8:9], ctx=ctx)
            r = await wh.lookup(ks[:18], prompt_tokens=1158, ctx=ctx)
            assert (r.matched_blocks, r.usable_tokens) == (8, 512)
        finally:
            await wh.close()
    asyncio.run(body())
