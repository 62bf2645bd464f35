"""Stand-ins for faults no real tensor produces on demand, for the conformance suite and the
tests: ``Unreadable``, a tensor whose bytes cannot be read once an update is under way (its
name, shape and dtype pass every check before it; copying it fails)."""

from typing import Any

import torch


class Unreadable(torch.Tensor):
    """``tensor.as_subclass(Unreadable)``: every copy from it raises ``RuntimeError``."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.Tensor.copy_, torch._foreach_copy_):
            raise RuntimeError("injected fault: this tensor cannot be read")
        return super().__torch_function__(func, types, args, kwargs or {})
