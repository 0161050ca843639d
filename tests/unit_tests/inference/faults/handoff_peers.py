"""Handoff peers in processes of their own, for the handoff fault tests and the soak test.

* :class:`PrefillPeer` — a :class:`PrefillSide` over NIXL in a child process, driven over a
  pipe: prefill prompts (returns their records), release / abandon pins, expect readers, read
  its :meth:`~PrefillSide.storage_stats`.
* :class:`DecodePeer` — a :class:`DecodeSide` over NIXL in a child process: hands out its
  reader descriptors, imports records, reports its words and storage.
* :class:`PrefillWorkerPeer` — the real :class:`PrefillWorker` serving a
  :class:`HandoffChannel` in a child process (the serving path of the example).
* :class:`DisaggregatedReplicaPeer` — a decode engine replica in a child process: a
  :class:`DisaggregatedEngine` over a prefill worker's channel behind an
  :class:`EngineEndpoint` of a coordinator (the decode process of the example).

Each peer can be stopped (SIGSTOP), continued (SIGCONT) and killed (SIGKILL) between
commands. A pull from a stopped peer stays pending only when UCX needs the peer's own progress
to answer it: :func:`make_pulls_need_the_peer` selects UCX's TCP transport (call it before any
NIXL agent exists in this process, and before starting peers); then "kill a prefill peer
mid-transfer" is: stop it, let the decode side post its pull, kill it.

Children are forked on CPU hosts (fast: they inherit this process's imports and the one-rank
collection passed as ``pg``) and spawned where CUDA is up (they make their own one-rank world).
Start peers before this process creates its own NIXL agents or ZeroMQ sockets. Every wait is
bounded: a peer that does not answer fails the test.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.inference.coordinator.auth import ControlPlaneKeys, Role, launch_keys
from megatron.core.inference.handoff.metadata import HandoffRecord
from megatron.core.inference.sampling import SamplingParams
from megatron.core.process_groups import ProcessGroupCollection, RankLayout

ANSWER_TIMEOUT_S = 60.0


def make_pulls_need_the_peer() -> None:
    """UCX over TCP only: a NIXL read completes only while its source process runs, so a pull
    from a stopped peer stays pending (on CPU hosts; CUDA hosts add ``cuda_copy``)."""
    os.environ["UCX_TLS"] = "tcp,cuda_copy" if torch.cuda.is_available() else "tcp"


def _collection(pg: ProcessGroupCollection | None) -> ProcessGroupCollection:
    """A forked child uses the parent's one-rank world; a spawned one makes its own."""
    if pg is not None:
        return pg
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return ProcessGroupCollection.from_layout(RankLayout())


class _Child:
    """A child process running ``target(conn, pg, *args)``: forked with ``os.fork`` on CPU hosts
    (a test's rank is a daemonic multiprocessing process, which may not start multiprocessing
    children), spawned by multiprocessing where CUDA is up (a torchrun rank)."""

    def __init__(self, target, conn, parent_conn, pg, args):
        self._process = None
        if torch.cuda.is_available():
            self._process = mp.get_context("spawn").Process(target=target, args=(conn, None, *args), daemon=True)
            self._process.start()
            self.pid = self._process.pid
            return
        self.pid = os.fork()
        if self.pid == 0:  # the child
            try:
                parent_conn.close()  # so that the pipe reads EOF once the parent is gone
                target(conn, pg, *args)
            finally:
                os._exit(0)

    def is_alive(self) -> bool:
        if self._process is not None:
            return self._process.is_alive()
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

    def kill(self) -> None:
        """SIGKILL and wait until the process is gone."""
        os.kill(self.pid, signal.SIGKILL)
        if self._process is not None:
            self._process.join(ANSWER_TIMEOUT_S)
        else:
            os.waitpid(self.pid, 0)
        assert not self.is_alive(), f"peer {self.pid} survived SIGKILL"


class _Peer:
    """A child process answering ``(command, argument)`` pairs over a pipe."""

    def __init__(self, target, *args, pg: ProcessGroupCollection | None = None):
        self._conn, child = mp.Pipe()
        self.process = _Child(target, child, self._conn, pg, args)
        child.close()
        self.hello = self._answer()

    @property
    def pid(self) -> int:
        return self.process.pid

    def ask(self, command: str, argument: Any = None) -> Any:
        self._conn.send((command, argument))
        return self._answer()

    def _answer(self) -> Any:
        if not self._conn.poll(ANSWER_TIMEOUT_S):
            raise AssertionError(f"peer {self.pid} did not answer within {ANSWER_TIMEOUT_S:g}s")
        ok, value = self._conn.recv()
        if not ok:
            raise AssertionError(f"peer {self.pid} failed:\n{value}")
        return value

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL and wait until the process is gone."""
        self.process.kill()

    def close(self) -> None:
        if self.process.is_alive():
            self.kill()
        self._conn.close()


def _serve_commands(conn, handlers: dict, idle=None) -> None:
    """Answer commands until ``close``; ``idle`` runs between them (about every 2 ms)."""
    import traceback

    try:
        while True:
            if conn.poll(0.002):
                command, argument = conn.recv()
                if command == "close":
                    break
                try:
                    conn.send((True, handlers[command](argument)))
                except Exception:  # noqa: BLE001 - the parent reports it
                    conn.send((False, traceback.format_exc()))
            if idle is not None:
                idle()
    finally:
        os._exit(0)  # skip teardown: inherited process groups must not be destroyed here


def _prefill_main(conn, pg, kind: str, engine_overrides: dict, pin_timeout_s: float) -> None:
    from megatron.core.inference.handoff.prefill_side import PrefillSide
    from megatron.core.inference.handoff.transport import NixlTransport
    from tests.unit_tests.inference.handoff.common import build_engine, build_model

    pg = _collection(pg)
    engine = build_engine(build_model(kind, pg), pg, prefix_caching=False, **engine_overrides)
    side = PrefillSide(engine, NixlTransport(f"prefill-peer-{os.getpid()}"), pin_timeout_s=pin_timeout_s)

    def prefill(argument):
        requests, params = argument
        for request_id, prompt in requests.items():
            side.add_request(request_id, prompt, params)
        records = {}
        while side.has_work():
            records |= {r.request_id: r.to_dict() for r in side.step().records}
        return records

    conn.send((True, os.getpid()))
    _serve_commands(
        conn,
        {
            "prefill": prefill,
            "release": side.release,
            "abandon": side.abandon,
            "expect_readers": lambda peers: side.transport.expect_readers(peers),
            "stats": lambda _: side.storage_stats(),
        },
        idle=lambda: (side.transport.serve(), side.expire_pins()),
    )


class PrefillPeer(_Peer):
    """A prefill side (``gpt`` or ``hybrid`` test model, NIXL) in a child process."""

    def __init__(self, kind: str = "gpt", *, pg=None, pin_timeout_s: float = 60.0, **engine_overrides):
        super().__init__(_prefill_main, kind, engine_overrides, pin_timeout_s, pg=pg)

    def prefill(self, requests: dict[str, list[int]], params: SamplingParams) -> dict[str, HandoffRecord]:
        """Prefill ``{request_id: prompt}`` to the first token; the records of the pins."""
        records = self.ask("prefill", (requests, params))
        return {request_id: HandoffRecord.from_dict(data) for request_id, data in records.items()}

    def deliver(self, words: list[tuple[str, str]]) -> None:
        """Hand the decode side's words (``release`` / ``abandon``) to the pins."""
        for word, request_id in words:
            self.ask(word, request_id)

    def stats(self) -> dict:
        return self.ask("stats")


def _decode_main(conn, pg, kind: str, engine_overrides: dict) -> None:
    from megatron.core.inference.handoff.decode_side import DecodeSide
    from megatron.core.inference.handoff.transport import NixlTransport
    from tests.unit_tests.inference.engines.common import collect
    from tests.unit_tests.inference.handoff.common import build_engine, build_model

    pg = _collection(pg)
    decode = DecodeSide(
        build_engine(build_model(kind, pg), pg, **engine_overrides), NixlTransport(f"decode-peer-{os.getpid()}")
    )
    results: dict = {}

    def import_records(argument):
        """Submit records and step until every request ended; returns the results and words."""
        records, params = argument
        for data in records:
            record = HandoffRecord.from_dict(data)
            decode.submit(record.request_id, record, params)
        while decode.has_unfinished_requests():
            collect(results, decode.step())
        return dict(results=results, words=decode.take_words())

    def submit_only(argument):
        records, params = argument
        for data in records:
            record = HandoffRecord.from_dict(data)
            decode.submit(record.request_id, record, params)

    conn.send((True, decode.readers))
    _serve_commands(
        conn,
        {
            "import": import_records,
            "submit": submit_only,
            "stats": lambda _: decode.storage_stats(),
        },
    )


class DecodePeer(_Peer):
    """A decode side (test model, NIXL, prefix caching on) in a child process; ``readers`` are
    its descriptors, for :meth:`~HandoffTransport.expect_readers` on a prefill side."""

    def __init__(self, kind: str = "gpt", *, pg=None, **engine_overrides):
        super().__init__(_decode_main, kind, engine_overrides, pg=pg)
        self.readers = self.hello

    def import_records(self, records: list[HandoffRecord], params: SamplingParams) -> dict:
        """Import ``records`` to completion; ``{"results": ..., "words": [...]}``."""
        return self.ask("import", ([r.to_dict() for r in records], params))

    def submit(self, records: list[HandoffRecord], params: SamplingParams) -> None:
        """Queue ``records`` without stepping (nothing is pulled until a later import)."""
        self.ask("submit", ([r.to_dict() for r in records], params))


def _worker_main(conn, pg, kind: str, engine_overrides: dict, model_overrides: dict, keys) -> None:
    from megatron.core.inference.handoff.prefill_side import PrefillSide
    from megatron.core.inference.handoff.serving import HandoffChannel, PrefillWorker
    from megatron.core.inference.handoff.transport import NixlTransport
    from tests.unit_tests.inference.handoff.common import build_engine, build_model

    try:
        pg = _collection(pg)
        engine = build_engine(build_model(kind, pg, **model_overrides), pg, prefix_caching=False, **engine_overrides)
        channel = HandoffChannel("tcp://127.0.0.1:0", bind=True, keys=keys)
        worker = PrefillWorker(PrefillSide(engine, NixlTransport(f"prefill-worker-{os.getpid()}")), channel)
        conn.send((True, channel.address))
        threading.Thread(target=_exit_when_closed, args=(conn,), daemon=True).start()
        worker.run()
        channel.close()
    finally:
        os._exit(0)


def _exit_when_closed(conn) -> None:
    try:
        conn.recv()
    finally:
        os._exit(0)


class PrefillWorkerPeer(_Peer):
    """The serving path's prefill worker in a child process; ``address`` is its channel's,
    authenticated by the engine key pair of ``keys`` (None: this process's launch keys)."""

    def __init__(
        self,
        kind: str = "gpt",
        *,
        pg=None,
        model_overrides: dict | None = None,
        keys: ControlPlaneKeys | None = None,
        **engine_overrides,
    ):
        keys = (keys if keys is not None else launch_keys()).for_role(Role.ENGINE)
        super().__init__(_worker_main, kind, engine_overrides, model_overrides or {}, keys, pg=pg)
        self.address = self.hello


def _replica_main(conn, pg, kind: str, engine_overrides: dict, model_overrides: dict) -> None:
    from megatron.core.inference.coordinator import ControlPlaneKeys, EngineEndpoint
    from megatron.core.inference.handoff.decode_side import DecodeSide
    from megatron.core.inference.handoff.serving import DisaggregatedEngine, HandoffChannel
    from megatron.core.inference.handoff.transport import NixlTransport
    from tests.unit_tests.inference.handoff.common import baseline, build_engine, build_model

    pg = _collection(pg)
    engine = build_engine(build_model(kind, pg, **model_overrides), pg, **engine_overrides)
    decode = DecodeSide(engine, NixlTransport(f"decode-replica-{os.getpid()}"))
    before = baseline(engine)
    serving: dict = {}

    def serve(argument):
        """Serve the coordinator and prefill worker named in ``argument`` from a thread."""
        keys = ControlPlaneKeys.load(argument["keys_file"])
        channel = HandoffChannel(argument["prefill_address"], bind=False, keys=keys)
        disaggregated = DisaggregatedEngine(decode, channel, prefill_timeout_s=argument["prefill_timeout_s"])
        endpoint = EngineEndpoint(
            disaggregated, argument["coordinator_address"], engine_id=argument["engine_id"], keys=keys
        )
        serving.update(endpoint=endpoint, thread=threading.Thread(target=endpoint.run, daemon=True))
        serving["thread"].start()

    def retire(_):
        """Stop serving (in-flight requests end first), then step until the quarantine is
        reclaimed; whether the engine is back to its idle block counts and the storage is idle."""
        serving["endpoint"].request_stop()
        serving["thread"].join(ANSWER_TIMEOUT_S)
        assert not serving["thread"].is_alive(), "the endpoint did not stop"
        wait_until(lambda: not decode.quarantined, "the quarantine to be reclaimed", poll=decode.step)
        return dict(blocks_back=baseline(engine) == before, storage=decode.storage_stats())

    conn.send((True, os.getpid()))
    _serve_commands(conn, {"serve": serve, "retire": retire, "stats": lambda _: decode.storage_stats()})


class DisaggregatedReplicaPeer(_Peer):
    """A decode replica (test model, NIXL) in a child process: :meth:`serve` connects it to a
    coordinator and a prefill worker; :meth:`retire` takes it out of service and reports."""

    def __init__(self, kind: str = "gpt", *, pg=None, model_overrides: dict | None = None, **engine_overrides):
        super().__init__(_replica_main, kind, engine_overrides, model_overrides or {}, pg=pg)

    def serve(
        self,
        coordinator_address: str,
        keys_file: str,
        prefill_address: str,
        *,
        engine_id: str,
        prefill_timeout_s: float,
    ) -> None:
        """``keys_file``: control-plane keys holding the engine key pair (``ControlPlaneKeys.save``),
        for the coordinator and the prefill worker's channel."""
        self.ask(
            "serve",
            dict(
                coordinator_address=coordinator_address,
                keys_file=keys_file,
                prefill_address=prefill_address,
                engine_id=engine_id,
                prefill_timeout_s=prefill_timeout_s,
            ),
        )

    def retire(self) -> dict:
        """Stop serving; ``{"blocks_back": bool, "storage": storage_stats}`` once reclaimed."""
        return self.ask("retire")


def wait_until(condition, what: str, timeout_s: float = ANSWER_TIMEOUT_S, poll=None) -> None:
    """Run ``poll`` (if any) until ``condition()`` holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:g}s")
        if poll is not None:
            poll()
        else:
            time.sleep(0.005)
