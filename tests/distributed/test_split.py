"""How heads are split over ranks (no process started): every query head's shared head is on
the rank that holds the query head, split or replicated; splits that cannot work are refused."""

from __future__ import annotations

import pytest

from deltaserve.distributed.shard import local_config, split_heads
from deltaserve.model.config import ModelConfig
from deltaserve.model.testing import make_tiny_checkpoint


@pytest.mark.parametrize("n_q,n_kv,size", [(4, 2, 2), (4, 2, 4), (8, 2, 4), (16, 4, 2),
                                           (8, 1, 8), (32, 16, 8), (4, 4, 4), (12, 3, 6)])
def test_each_rank_holds_the_shared_heads_of_its_query_heads(n_q, n_kv, size):
    group = n_q // n_kv
    covered = []
    for rank in range(size):
        s = split_heads(n_q, n_kv, size, rank, "test")
        assert s.q_heads == n_q // size and s.kv_heads == max(1, n_kv // size)
        for j in range(s.q_start, s.q_start + s.q_heads):
            # the rank's local grouping maps query head j to its own shared head
            local_kv = (j - s.q_start) // (s.q_heads // s.kv_heads)
            assert s.kv_start + local_kv == j // group
        covered.extend(range(s.q_start, s.q_start + s.q_heads))
    assert covered == list(range(n_q))  # every query head on exactly one rank


@pytest.mark.parametrize("n_q,n_kv,size,message", [
    (4, 2, 3, "does not divide the 4"), (12, 6, 4, "does not divide the 6 shared"),
    (12, 4, 6, "cannot be replicated evenly")])
def test_splits_that_cannot_work_are_refused(n_q, n_kv, size, message):
    with pytest.raises(ValueError, match=message):
        split_heads(n_q, n_kv, size, 0, "test")


def test_the_local_config_has_the_rank_s_heads_and_the_whole_vocabulary(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3_5_moe_text")
    full = ModelConfig.from_pretrained(path)
    local = local_config(full, 2, 1)
    assert (local.num_attention_heads, local.num_key_value_heads) == (2, 1)
    assert (local.linear_num_value_heads, local.linear_num_key_heads) == (2, 1)
    assert local.moe_intermediate_size == full.moe_intermediate_size // 2
    assert local.conv_dim == 2 * 1 * full.linear_key_head_dim + 2 * full.linear_value_head_dim
    assert (local.vocab_size, local.hidden_size) == (full.vocab_size, full.hidden_size)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        local_config(ModelConfig.from_dict({**full.__dict__, "model_type": "qwen3_5_moe_text",
                                            "moe_intermediate_size": 30}), 4, 0)
