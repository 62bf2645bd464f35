"""Faults for the conformance suite, the tests and the benchmarks: ``Unreadable``, a stand-in
tensor whose bytes cannot be read once an update is under way (its name, shape and dtype pass
every check before it; copying it fails); ``kill_replica``, a real engine's death, and
``kill_process``, the same from anywhere (an engine's own process, at a chosen point of a call)."""

import os
import signal
import time
from typing import Any

import torch

from rollgen.processes import running


class Unreadable(torch.Tensor):
    """``tensor.as_subclass(Unreadable)``: every copy from it raises ``RuntimeError``."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.Tensor.copy_, torch._foreach_copy_):
            raise RuntimeError("injected fault: this tensor cannot be read")
        return super().__torch_function__(func, types, args, kwargs or {})


def kill_replica(gen: Any, index: int) -> None:
    """SIGKILL data-parallel replica ``index``'s engine process (a ``RayGeneration``'s: its
    actor) and wait until it is gone: the engine death a fleet must survive."""
    kill_process(gen.engines.info(index)["pid"])


def kill_process(pid: int) -> None:
    """SIGKILL process ``pid`` (of this machine) and wait until it is gone."""
    os.kill(pid, signal.SIGKILL)
    while running(pid):
        time.sleep(0.01)
