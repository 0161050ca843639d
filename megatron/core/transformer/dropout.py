"""Dropout on activations lives in :mod:`megatron.core.fusions.dropout` (the fused ops draw their
masks from the same RNG streams); these names stay importable from here."""

from megatron.core.fusions.dropout import dropout, sharded_rng_context

__all__ = ["dropout", "sharded_rng_context"]
