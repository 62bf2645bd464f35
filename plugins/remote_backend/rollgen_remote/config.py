"""The remote backend's config: the server to reach (``remote_cfg``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from typing_extensions import NotRequired, TypedDict

from rollgen.spec import EngineSubDict, GenerationConfig


class RemoteCfg(TypedDict):
    """Where the server is. ``api_key`` None: ``ROLLGEN_API_KEY`` from the environment (keep
    keys off command lines and out of config files others read)."""

    url: str
    api_key: NotRequired[Annotated[str | None, Field(default=None)]]
    #: One request's longest wait for its answer.
    timeout_s: NotRequired[Annotated[float, Field(gt=0, default=600.0)]]
    #: Requests in flight at once (the client's connection pool).
    max_connections: NotRequired[Annotated[int, Field(gt=0, default=64)]]


class RemoteConfig(GenerationConfig):
    """``model_name`` is a local folder of the served model's config and tokenizer (its weights
    are not read): what the client validates prompts and names stop reasons with."""

    remote_cfg: EngineSubDict[RemoteCfg]
