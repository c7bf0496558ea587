"""The engine pool `artlike serve` asks for: `--engines N` local engines plus each `--engine-url`.

Local engine i gets its own port, log file (engine.log, engine-1.log, ...), and its share of the cores
(CPU) or GPUs (CUDA) from `placement`. Remote engines get the key given for them (`--engine-key`, one for
all or one per URL in order).
"""

from __future__ import annotations

import dataclasses
import logging
import urllib.parse
from pathlib import Path

from ..hosts import is_loopback_name
from ..settings import ScaleOutSettings
from .client import EngineClient
from .launch import EngineConfig, free_port
from .placement import devices_per_engine, split_cpus, split_gpus, visible_gpus
from .policy import PolicyEngines, probe_tolerance
from .pool import EngineMember, EnginePool
from .remote import RemoteEngine
from .supervisor import EngineSupervisor

logger = logging.getLogger(__name__)


def local_engine_configs(scale_out: ScaleOutSettings, base: EngineConfig) -> list[EngineConfig]:
    """`base` (engine 0's config) copied for each of `scale_out.engines` local engines and then each of
    `scale_out.policy_engines` policy engines, each placed on its own cores or GPUs. One engine keeps `base` as
    it is (all cores, every visible GPU)."""
    count = scale_out.local_engines
    if count <= 1:
        return [dataclasses.replace(base, policy=scale_out.policy_engines == 1)] if count == 1 else []
    configs = []
    if base.device == "cpu":
        placements: list[dict[str, object]] = [{"cpu_ids": group} for group in split_cpus(base.cpu_ids, count)]
    else:
        groups = split_gpus(visible_gpus(), count, devices_per_engine(base.extra_args))
        placements = [{"extra_env": (*base.extra_env, ("CUDA_VISIBLE_DEVICES", ",".join(group)))}
                      for group in groups]
    for index, placement in enumerate(placements):
        port = base.port if index == 0 else free_port()
        log_path = base.log_path if index == 0 else base.log_path.with_name(f"engine-{index}.log")
        configs.append(dataclasses.replace(base, port=port, log_path=log_path, policy=index >= scale_out.engines,
                                           **placement))  # type: ignore[arg-type]
    return configs


def remote_keys(urls: tuple[str, ...], keys: tuple[str, ...]) -> list[str | None]:
    """The key for each URL: none, one for all, or one each (in order)."""
    if not keys:
        return [None] * len(urls)
    if len(keys) == 1:
        return [keys[0]] * len(urls)
    if len(keys) != len(urls):
        raise ValueError(f"give one --engine-key for all --engine-url, or one per URL ({len(urls)}), not {len(keys)}")
    return list(keys)


def travels_in_clear(url: str) -> bool:
    """Whether requests to an `--engine-url` leave this machine unencrypted (plain http to another host)."""
    parsed = urllib.parse.urlsplit(url)
    return parsed.scheme == "http" and not is_loopback_name((parsed.hostname or "").rstrip("."))


def build_engine_pool(scale_out: ScaleOutSettings, base: EngineConfig, *, api_key: str | None) -> EnginePool:
    """The pool of `scale_out`'s engines around `base` (engine 0's config: the model, its name and dtype);
    `api_key` is the local engines' key (None: a random one per start)."""
    members: list[EngineMember] = []
    policy_members: list[EngineMember] = []
    for index, config in enumerate(local_engine_configs(scale_out, base)):
        client = EngineClient(config.base_url)  # one connection pool per engine: the proxy, admin calls, health
        runner = EngineSupervisor(config, client=client, api_key=api_key)
        if config.policy:
            policy_members.append(EngineMember(id=f"policy-{len(policy_members)}", kind="policy", runner=runner,
                                               client=client))
        else:
            members.append(EngineMember(id=f"local-{index}", kind="local", runner=runner, client=client))
    for index, (url, key) in enumerate(zip(scale_out.engine_urls, remote_keys(scale_out.engine_urls,
                                                                              scale_out.engine_keys), strict=True)):
        if travels_in_clear(url):
            logger.warning("engine %s is reached over plain http: the engine key and the adapter paths sent to it "
                           "travel in the clear; give an https:// URL (a TLS proxy in front of vLLM) unless the "
                           "network between the machines is trusted", url)
        client = EngineClient(url)
        if key is not None:
            client.set_api_key(key)
        members.append(EngineMember(id=f"remote-{index}", kind="remote",
                                    runner=RemoteEngine(client, base.served_model_name), client=client))
    if not policy_members:
        return EnginePool(members)
    pool = EnginePool(members)
    pool.policy = PolicyEngines(policy_members, base_model_id=base.served_model_name,
                                model_dir=Path(base.model_path), reference=pool.token_logprobs,  # services.py: leased
                                tolerance=probe_tolerance(base.dtype), model=scale_out.policy_model)
    return pool
