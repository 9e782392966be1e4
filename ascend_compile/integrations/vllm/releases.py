"""Which vLLM releases the integration supports, and the check of the installed one.

The binder reads vLLM internals that change between releases: its op schemas, the forward
context's attention metadata and the layers' KV-cache layouts (docs/vllm.md, "vLLM 0.23 and 0.33").
A backend using vLLM's own forward context (`dynamo_backend.backend`) therefore refuses, at
start-up, a vLLM outside `SUPPORTED`. The installed release is read from vLLM's package metadata,
without importing vLLM.
"""
from __future__ import annotations

#: The vLLM releases (major.minor) whose op schemas, metadata, forward context and KV-cache layouts this
#: package was written against and tested on (docs/vllm.md, "vLLM 0.23 and 0.33").
SUPPORTED = ("0.23", "0.33")


def installed_version() -> str:
    """The installed vLLM release (read from its package metadata, without importing it)."""
    from importlib.metadata import version

    return version("vllm")


def check_version() -> None:
    """Raise `RuntimeError` unless the installed vLLM is a `SUPPORTED` release (by major.minor)."""
    version = installed_version()
    if ".".join(version.split(".")[:2]) not in SUPPORTED:
        raise RuntimeError(
            f"vllm {version}: ascend_compile.integrations.vllm supports vLLM {', '.join(v + '.x' for v in SUPPORTED)} "
            f"(it reads the forward context's attention metadata and KV caches, internals that change between "
            f"releases); install a supported version"
        )
