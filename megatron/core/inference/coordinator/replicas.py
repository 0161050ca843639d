"""Data-parallel engine replicas as supervised child process groups.

Replicas share nothing but the coordinator: each one is its own torch.distributed world (its
``ranks_per_replica`` model-parallel ranks) with its own rendezvous store, which the supervisor
hosts on 127.0.0.1, like torchrun's agent does (the ranks join it as clients:
``TORCHELASTIC_USE_AGENT_STORE``). So a replica that dies takes no other replica with it: the
supervisor kills what is left of it (a rank alone would wait forever in a collective), reports
it lost, and starts it again, with a fresh store, after a delay that grows while it keeps
dying young. The ranks of a replica form one process group (``kill -- -PGID`` ends the
replica), and each rank dies with the supervisor (:func:`die_with_parent`, from
``PARENT_PID_ENV``).

Each rank runs ``command`` with torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), ``REPLICA_ENV`` (the replica index)
and, on CUDA, ``CUDA_VISIBLE_DEVICES`` naming the replica's own devices.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from megatron.core.errors import MegatronConfigError

REPLICA_ENV = "MEGATRON_REPLICA_INDEX"
PARENT_PID_ENV = "MEGATRON_PARENT_PID"
# torchrun's variables, removed from the environment the ranks inherit (they start worlds of their own).
_LAUNCHER_VARIABLES = ("GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "NODE_RANK")
STORE_TIMEOUT = timedelta(minutes=10)
LONG_LIFE_S = 60.0  # a replica that lived this long was healthy: its restart delay starts over


class ReplicaDevicesError(MegatronConfigError):
    """Fewer devices are visible than the replicas need."""


@dataclass
class Replica:
    """One replica's current processes (its ranks, in rank order) and restart state."""

    index: int
    processes: list[subprocess.Popen] = field(default_factory=list)
    started_at: float = 0.0
    restart_at: float | None = None  # when a dead replica starts again
    early_deaths: int = 0  # deaths in a row within LONG_LIFE_S of starting
    _store: dist.TCPStore | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    @property
    def alive(self) -> bool:
        return bool(self.processes) and all(p.poll() is None for p in self.processes)


class ReplicaSupervisor:
    """Starts ``num_replicas`` replicas of ``ranks_per_replica`` processes each and keeps them running.

    Call :meth:`poll` regularly from the thread that called :meth:`start` (rank processes die
    with that thread, see the module doc).

    Args:
        command: argv every rank runs.
        num_replicas, ranks_per_replica: the data-parallel size and the model-parallel size.
        env: variables added to the ranks' environment (this process's environment underneath).
        on_lost: called with ``(index, reason)`` when a replica dies (before it is restarted).
        devices: CUDA device ids to share out, ``ranks_per_replica`` per replica; None: CPU.
        restart_delay_s, max_restart_delay_s: the restart delay, doubled per early death up to the max.
    """

    def __init__(
        self,
        command: Sequence[str],
        num_replicas: int,
        ranks_per_replica: int,
        *,
        env: dict[str, str] | None = None,
        on_lost: Callable[[int, str], None] | None = None,
        devices: Sequence[str] | None = None,
        restart_delay_s: float = 1.0,
        max_restart_delay_s: float = 30.0,
    ):
        if devices is not None and len(devices) < num_replicas * ranks_per_replica:
            raise ReplicaDevicesError(
                f"{num_replicas} replicas of {ranks_per_replica} ranks need {num_replicas * ranks_per_replica} "
                f"devices; {len(devices)} are visible"
            )
        self.command = list(command)
        self.ranks_per_replica = ranks_per_replica
        self.env = dict(env or {})
        self.on_lost = on_lost
        self.devices = list(devices) if devices is not None else None
        self.restart_delay_s = restart_delay_s
        self.max_restart_delay_s = max_restart_delay_s
        self.replicas = [Replica(i) for i in range(num_replicas)]
        self.stopping = False

    def start(self) -> None:
        """Start every replica."""
        for replica in self.replicas:
            self._spawn(replica)

    def poll(self) -> list[tuple[int, str]]:
        """Handle replicas that died since the last call (kill their other ranks, report them lost,
        schedule their restart) and restart those whose delay is over; returns ``(index, reason)``
        of the replicas that died."""
        lost = []
        now = time.monotonic()
        for replica in self.replicas:
            if replica.processes and not replica.alive:
                reason = self._reap(replica)
                lost.append((replica.index, reason))
                early = now - replica.started_at < LONG_LIFE_S
                replica.early_deaths = replica.early_deaths + 1 if early else 0
                delay = min(self.max_restart_delay_s, self.restart_delay_s * 2 ** max(0, replica.early_deaths - 1))
                replica.restart_at = now + delay
                print(f"replica {replica.index}: {reason}; restarting in {delay:.0f}s", file=sys.stderr, flush=True)
                if self.on_lost is not None:
                    self.on_lost(replica.index, reason)
            elif not self.stopping and replica.restart_at is not None and now >= replica.restart_at:
                self._spawn(replica)
        return lost

    def kill(self, index: int, signum: int = signal.SIGKILL) -> None:
        """Send ``signum`` to every rank of replica ``index`` (its process group)."""
        replica = self.replicas[index]
        if replica.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(replica.processes[0].pid, signum)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop for good: SIGTERM every rank (they answer their in-flight requests, then exit),
        SIGKILL what is left after ``timeout_s``."""
        self.stopping = True
        for replica in self.replicas:
            self.kill(replica.index, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for replica in self.replicas:
            for process in replica.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(max(0.0, deadline - time.monotonic()))
            self._reap(replica)

    # -- internals -----------------------------------------------------------------------

    def _spawn(self, replica: Replica) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        replica._store = dist.TCPStore(
            "127.0.0.1",
            port,
            self.ranks_per_replica,
            is_master=True,
            timeout=STORE_TIMEOUT,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),  # the store owns (and closes) the socket
        )
        inherited = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
        base = {k: v for k, v in inherited.items() if not k.startswith("TORCHELASTIC")}
        base |= self.env | {
            REPLICA_ENV: str(replica.index),
            PARENT_PID_ENV: str(os.getpid()),
            "WORLD_SIZE": str(self.ranks_per_replica),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_replica),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # join the store above as clients
        }
        if self.devices is not None:
            first = replica.index * self.ranks_per_replica
            base["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices[first : first + self.ranks_per_replica])
        replica.processes = []
        for rank in range(self.ranks_per_replica):
            env = base | {"RANK": str(rank), "LOCAL_RANK": str(rank)}
            group = 0 if rank == 0 else replica.processes[0].pid  # the replica's ranks: one process group
            replica.processes.append(subprocess.Popen(self.command, env=env, process_group=group))
        replica.started_at = time.monotonic()
        replica.restart_at = None
        print(f"replica {replica.index}: started, pids {replica.pids}", file=sys.stderr, flush=True)

    def _reap(self, replica: Replica) -> str:
        """Kill what is left of a replica, wait for it, drop its store; returns why it ended."""
        reasons = [_exit_reason(p) for p in replica.processes if p.poll() is not None]
        self.kill(replica.index, signal.SIGKILL)
        for process in replica.processes:
            process.wait()
        replica.processes = []
        replica._store = None
        return reasons[0] if reasons else "was stopped"


def _exit_reason(process: subprocess.Popen) -> str:
    code = process.returncode
    if code < 0:
        return f"process {process.pid} was killed by {signal.Signals(-code).name}"
    return f"process {process.pid} exited with code {code}"
