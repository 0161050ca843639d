"""The embedding bridge between disjoint and colocated grids, checked sample by sample."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.models.mimo.bridge import BridgeError, EmbeddingBridge
from megatron.core.process_groups import RankLayout
from tests.unit_tests.dist_harness import run_distributed

SHAPE = (3, 2)


def _sample(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i)) + torch.arange(6.0).reshape(SHAPE) / 10


def _disjoint_round_trip():
    """Encoder TP2 on ranks 0-1 (one data shard of 4 samples); language model DP2 on ranks
    2-3 (2 samples each)."""
    bridge = EmbeddingBridge(RankLayout(tp=2), RankLayout(dp=2, rank_offset=2), 2, SHAPE)
    me = dist.get_rank()
    if me < 2:
        sent = torch.stack([_sample(i) for i in range(4)])
        assert bridge.to_language(sent) is None
        return bridge.to_encoder(None)
    received = bridge.to_language(None)
    assert bridge.to_encoder(received * 10) is None
    return received


def test_disjoint_bridge_routes_each_sample_and_scales_gradients():
    results = run_distributed(_disjoint_round_trip, 4)
    for lm_rank, first in ((2, 0), (3, 2)):
        torch.testing.assert_close(results[lm_rank], torch.stack([_sample(first), _sample(first + 1)]))
    expected_grad = torch.stack([_sample(i) for i in range(4)]) * 10 * (1 / 2)  # encoder width 1 / language width 2
    for encoder_rank in (0, 1):
        torch.testing.assert_close(results[encoder_rank], expected_grad)


def _colocated_exchange():
    """Both modules on ranks 0-1: encoder DP2 (1 sample each), language model TP2 (2 samples)."""
    bridge = EmbeddingBridge(RankLayout(dp=2), RankLayout(tp=2), 2, SHAPE)
    me = dist.get_rank()
    received = bridge.to_language(_sample(me).unsqueeze(0))
    grads = bridge.to_encoder(torch.ones(2, *SHAPE) * (me + 1))
    return received, grads


def test_colocated_bridge_gathers_every_shard_and_returns_the_root_gradient():
    results = run_distributed(_colocated_exchange, 2)
    for received, grads in results:
        torch.testing.assert_close(received, torch.stack([_sample(0), _sample(1)]))
        torch.testing.assert_close(grads, torch.ones(1, *SHAPE) * 2.0)  # from TP rank 0 (value 1), x width 2 / 1


def test_uneven_split_and_wrong_shapes_are_rejected():
    with pytest.raises(BridgeError, match="the 3 samples of a micro-step .* must split evenly over the encoder's 2"):
        EmbeddingBridge(RankLayout(dp=2), RankLayout(dp=3, rank_offset=2), 1, SHAPE)

    def wrong_shape():
        bridge = EmbeddingBridge(RankLayout(), RankLayout(), 2, SHAPE)
        bridge.to_language(torch.zeros(2, 3, 5))

    with pytest.raises(
        Exception, match=r"encoder embeddings must have shape \[2, 3, 2\] \(batch first\), got \[2, 3, 5\]"
    ):
        run_distributed(wrong_shape, 1)
