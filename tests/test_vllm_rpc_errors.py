"""The vLLM plugin's typed errors across the engine core's RPC (no engine started)."""

import pytest


def test_an_error_returned_by_an_engine_worker_survives_msgspec_and_is_raised_as_itself() -> None:
    """vLLM's engine core sends results with msgspec: an error a worker extension returns
    (``returns_errors``) must get through it and come out as its own rollgen type."""
    msgspec = pytest.importorskip("msgspec")
    from rollgen.errors import RefitError
    from rollgen_vllm.rpc_errors import reraise, returns_errors

    @returns_errors
    def load() -> None:
        raise RefitError("weight update rejected", ["a: missing"], stale=True)

    received = msgspec.msgpack.decode(msgspec.msgpack.encode([returns_errors(lambda: 7)(), load()]))
    with pytest.raises(RefitError, match="weight update rejected") as err:
        reraise(received)
    assert err.value.problems == ["a: missing"] and err.value.stale
    assert reraise([7, None]) == [7, None]
