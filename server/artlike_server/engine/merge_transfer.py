"""vLLM weight-transfer backend `artlike_merge`: the policy engine folds a LoRA adapter into its own weights.

vLLM 0.32's RL weight-update API (`/start_weight_update`, `/update_weights`, `/finish_weight_update`,
served in dev mode behind artlike's engine key) takes a pluggable backend through
`WeightTransferEngineFactory.register_engine`; `vllm_plugin.register()` registers this one. An update names
an adapter directory on the engine's filesystem (`{"adapter_path": ".../steps/7"}`, or null for the base
weights); the engine reads its own base checkpoint, adds `scaling · B @ A` where the adapter has one, and
loads the result through vLLM's layerwise reload, which redoes each layer's post-load processing (CPU
GEMM packing included). Nothing crosses the wire but a path, so the trainer writes no merged checkpoint.

The adapter is read and checked against the checkpoint before a single weight is touched: a bad adapter
fails the update and the engine keeps serving what it had. Runs inside vLLM: torch is fine here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from artlike_server.engine.adapter_merge import merged_weights, read_adapter

logger = logging.getLogger("vllm.plugins.artlike_merge")


@dataclass
class MergeInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the adapter comes by path."""


@dataclass
class MergeUpdateInfo(WeightTransferUpdateInfo):
    adapter_path: str | None = None  # None: back to the base model's own weights


class AdapterMergeTransfer(WeightTransferEngine[MergeInitInfo, MergeUpdateInfo]):
    init_info_cls = MergeInitInfo
    update_info_cls = MergeUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: MergeInitInfo) -> None:
        pass

    # The whole reload happens in `receive_weights`, after the adapter was checked: starting vLLM's
    # layerwise reload moves the layers to the meta device, and a refusal after that would leave them there.
    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: MergeUpdateInfo) -> None:
        started = time.perf_counter()
        model_dir = Path(self.model_config.model)
        deltas = read_adapter(Path(update_info.adapter_path), model_dir) if update_info.adapter_path else {}
        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(merged_weights(model_dir, deltas))  # type: ignore[operator]  # vLLM models define it
        finally:
            finalize_layerwise_reload(self.model, self.model_config)  # type: ignore[no-untyped-call]
        logger.info("merged %s into the weights (%d layers) in %.2f s",
                    update_info.adapter_path or "nothing (base weights)", len(deltas), time.perf_counter() - started)

    def shutdown(self) -> None:
        pass
