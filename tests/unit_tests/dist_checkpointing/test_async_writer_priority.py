"""The background checkpoint writer yields the CPU to training: its thread and the I/O threads
it starts run at nice 19 (and, when asked, only on the given CPUs); the training thread keeps
its priority and CPUs."""

import os
import threading

from megatron.core.dist_checkpointing.async_save import WRITER_NICE, AsyncSaver
from megatron.core.dist_checkpointing.strategies.stream_io import StreamIO


def _placement() -> tuple[int, set[int]]:
    tid = threading.get_native_id()
    return os.getpriority(os.PRIO_PROCESS, tid), os.sched_getaffinity(tid)


def test_the_writer_and_its_io_threads_run_niced_on_the_cpus_given():
    training = _placement()
    cpu = max(os.sched_getaffinity(0))
    seen = {}

    def job(group):
        seen["writer"] = _placement()
        with StreamIO() as io:  # the threads that issue the writes
            seen["io"] = io.submit(_placement).result()

    saver = AsyncSaver(writer_cpus={cpu})
    try:
        saver.submit(job, "a probe")
        saver.wait()
    finally:
        saver.close()
    assert WRITER_NICE == 19
    assert seen["writer"] == seen["io"] == (max(19, training[0]), {cpu})
    assert _placement() == training
