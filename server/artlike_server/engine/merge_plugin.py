"""vLLM plugin `artlike_merge`: registers the policy engine's weight-transfer backend (`merge_transfer.py`).

Declared as a `vllm.general_plugins` entry point in pyproject.toml; vLLM calls `register()` in each process
it starts. The backend is registered by module path, so torch-free processes never import it.
"""

from __future__ import annotations

BACKEND = "artlike_merge"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:  # register() may run twice in one process
        WeightTransferEngineFactory.register_engine(
            BACKEND, "artlike_server.engine.merge_transfer", "AdapterMergeTransfer"
        )
