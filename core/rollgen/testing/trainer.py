"""A trainer in a process of its own, for tests of refit over a weight-sync group:
``python -m rollgen.testing.trainer UPDATES_JSON DTYPE DEVICE`` (the spec's JSON on its stdin:
it holds the group's secret, which a command line would show every user) joins the group as its
sender (its tensors on DEVICE: ``cpu`` or ``cuda:N``), writing "port N" to its stdout (where it
listens: the spec's port may be 0), then broadcasts each update in turn, writing "ok" or the
RefitError's first line after each."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Sequence

import torch

from rollgen.errors import RefitError
from rollgen.refit.transports.collective import SyncGroupSpec, WeightSender
from rollgen.testing.reference import load_reference_model

#: An update: the weights of a model folder, less the tensor named second (None: complete).
Update = tuple[str, str | None]


class Trainer:
    """The trainer process of ``start_trainer``."""

    def __init__(self, spec: SyncGroupSpec, updates: Sequence[Update], dtype: str, device: str) -> None:
        args = [json.dumps(list(updates)), dtype, device]
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        assert self.process.stdin is not None  # a pipe
        self.process.stdin.write(json.dumps(dataclasses.asdict(spec)))
        self.process.stdin.close()
        port = self.result()
        if not port.startswith("port "):
            self.kill()
            raise RuntimeError(f"the trainer process did not start (it said {port!r}); see its stderr")
        #: The spec with the port the trainer listens on: the generation's ``init_weight_sync``'s.
        self.spec = dataclasses.replace(spec, port=int(port.split()[1]))

    def result(self) -> str:
        """What the next update gave: "ok" or "RefitError: ..." ("" if the process ended)."""
        assert self.process.stdout is not None  # a pipe: set in __init__
        return self.process.stdout.readline().strip()

    def wait(self, timeout_s: float = 60.0) -> int:
        return self.process.wait(timeout_s)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def start_trainer(spec: SyncGroupSpec, updates: Sequence[Update], dtype: str, device: str = "cpu") -> Trainer:
    """A trainer process that joins ``spec`` as its sender and sends ``updates`` in turn, from
    ``device``."""
    return Trainer(spec, updates, dtype, device)


def send_updates(
    spec: SyncGroupSpec, updates: Sequence[Update], dtype: torch.dtype, device: torch.device
) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sender = WeightSender(spec, device)
    _tell(f"port {sender.spec.port}")
    sender.connect()
    for model_dir, drop in updates:
        state = dict(load_reference_model(model_dir, torch.float32).to(device).state_dict())
        state.pop(drop or "", None)
        try:
            sender.send(state, dtype=dtype, bucket_bytes=64 << 10)
            _tell("ok")
        except RefitError as exc:
            _tell(f"RefitError: {str(exc).splitlines()[0]}")
    sender.close()


def _tell(line: str) -> None:
    """One line of this process's protocol with the suite: its stdout, which ``Trainer`` reads."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    updates_json, dtype_name, device_name = sys.argv[1:4]
    send_updates(
        SyncGroupSpec(**json.loads(sys.stdin.read())),
        [tuple(u) for u in json.loads(updates_json)],
        getattr(torch, dtype_name),
        torch.device(device_name),
    )
