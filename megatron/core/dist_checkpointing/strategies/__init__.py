"""Storage strategies: torch.distributed.checkpoint-backed piece I/O and fully parallel work distribution."""
