"""Point-to-point activation and gradient exchange between neighbouring pipeline stages.

Works on gloo (CPU) and NCCL (GPU): every exchange posts its isend/irecv operations in one
``batch_isend_irecv`` so paired stages never wait on each other's ordering.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class P2PCommunicator:
    """Sends and receives tensors of a fixed shape to the previous/next stage of ``pp_group``."""

    pp_group: dist.ProcessGroup
    tensor_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def __post_init__(self):
        ranks = dist.get_process_group_ranks(self.pp_group)
        me = dist.get_rank(self.pp_group)
        self.stage, self.num_stages = me, len(ranks)
        self.prev_rank = ranks[me - 1] if me > 0 else None
        self.next_rank = ranks[me + 1] if me < len(ranks) - 1 else None
        # Virtual stages wrap around: the last stage's chunk v feeds the first stage's chunk v + 1.
        self.ring_prev_rank = ranks[me - 1]
        self.ring_next_rank = ranks[(me + 1) % len(ranks)]

    @property
    def is_first_stage(self) -> bool:
        return self.prev_rank is None

    @property
    def is_last_stage(self) -> bool:
        return self.next_rank is None

    def _empty(self, requires_grad: bool) -> torch.Tensor:
        return torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device, requires_grad=requires_grad)

    def _exchange(self, send: list[tuple[torch.Tensor, int]], recv: list[tuple[torch.Tensor, int]]) -> None:
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer, self.pp_group) for t, peer in send]
        ops += [dist.P2POp(dist.irecv, t, peer, self.pp_group) for t, peer in recv]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def post_sends_and_recv(
        self, sends: list[tuple[torch.Tensor, int]], recv_from: int | None
    ) -> tuple[torch.Tensor | None, list[tuple[dist.Work, torch.Tensor]]]:
        """Post ``sends`` ((tensor, global peer rank) pairs) and, unless ``recv_from`` is None,
        one receive from that peer, in one ``batch_isend_irecv``; wait for the receive only.

        Returns the received tensor and the send works: the caller waits for those (and keeps
        the tensors alive) before it reuses them, e.g. at the end of the schedule. Used by the
        interleaved schedule, which sends as soon as a result exists and receives only when a
        pass needs its input, so no rank ever waits with an unsent result.
        """
        sends = [(t.contiguous(), peer) for t, peer in sends]
        ops = [dist.P2POp(dist.isend, t, peer, self.pp_group) for t, peer in sends]
        received = None
        if recv_from is not None:
            received = self._empty(requires_grad=False)
            ops.append(dist.P2POp(dist.irecv, received, recv_from, self.pp_group))
        works = dist.batch_isend_irecv(ops) if ops else []
        if len(works) != len(ops):  # one coalesced work for the whole batch (NCCL)
            for work in works:
                work.wait()
            return received, []
        if recv_from is not None:
            works.pop().wait()
        return received, [(work, t) for work, (t, _) in zip(works, sends, strict=True)]

    def recv_forward(self) -> torch.Tensor | None:
        """Activation from the previous stage (None on the first stage)."""
        if self.is_first_stage:
            return None
        tensor = self._empty(requires_grad=False)
        self._exchange([], [(tensor, self.prev_rank)])
        return tensor.requires_grad_()

    def send_forward(self, output: torch.Tensor | None) -> None:
        if not self.is_last_stage:
            self._exchange([(output.detach(), self.next_rank)], [])

    def recv_backward(self) -> torch.Tensor | None:
        """Gradient of this stage's output from the next stage (None on the last stage)."""
        if self.is_last_stage:
            return None
        grad = self._empty(requires_grad=False)
        self._exchange([], [(grad, self.next_rank)])
        return grad

    def send_backward(self, input_grad: torch.Tensor | None) -> None:
        if not self.is_first_stage:
            self._exchange([(input_grad, self.prev_rank)], [])

    def send_forward_recv_backward(self, output: torch.Tensor | None) -> torch.Tensor | None:
        if self.is_last_stage:
            return None
        grad = self._empty(requires_grad=False)
        self._exchange([(output.detach(), self.next_rank)], [(grad, self.next_rank)])
        return grad

    def send_backward_recv_forward(self, input_grad: torch.Tensor | None) -> torch.Tensor | None:
        if self.is_first_stage:
            return None
        tensor = self._empty(requires_grad=False)
        self._exchange([(input_grad, self.prev_rank)], [(tensor, self.prev_rank)])
        return tensor.requires_grad_()
