"""Pipeline parallelism: point-to-point exchange and forward-backward schedules."""

from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

__all__ = ["get_forward_backward_func"]
