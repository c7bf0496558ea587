"""The routing policy (engine/routing.py) and where local engines are placed (engine/placement.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from artlike_server.engine.launch import EngineConfig
from artlike_server.engine.placement import (
    PlacementError,
    devices_per_engine,
    split_cpus,
    split_gpus,
    visible_gpus,
)
from artlike_server.engine.pool_setup import local_engine_configs, remote_keys
from artlike_server.engine.routing import AffinityTable, Load, choose, least_loaded, spill_to_lora
from artlike_server.settings import ScaleOutSettings


def test_least_loaded_prefers_fewest_in_flight_then_fewest_served_then_first() -> None:
    a, b, c = Load("a", outstanding=2, served=5), Load("b", outstanding=1, served=9), Load("c", outstanding=1, served=3)
    assert least_loaded([a, b, c]) is c
    assert least_loaded([Load("x"), Load("y")]).id == "x"  # type: ignore[union-attr]
    assert least_loaded([]) is None


def test_an_idle_pool_spreads_requests_without_keys() -> None:
    loads, table = [Load("e0"), Load("e1")], AffinityTable()
    picked = []
    for _ in range(6):
        load = choose(loads, table, None)
        assert load is not None
        load.served += 1
        picked.append(load.id)
    assert picked == ["e0", "e1"] * 3 and len(table) == 0  # keyless requests leave no affinity behind


def test_a_trajectory_stays_on_its_engine_even_when_that_engine_is_busier() -> None:
    e0, e1 = Load("e0"), Load("e1")
    table = AffinityTable()
    assert choose([e0, e1], table, "traj-a") is e0
    e0.outstanding = 5  # busy, yet the trajectory's prefix is cached there
    assert choose([e0, e1], table, "traj-a") is e0
    assert choose([e0, e1], table, "traj-b") is e1  # a new trajectory goes to the idle engine


def test_a_trajectory_moves_when_its_engine_leaves_the_candidates() -> None:
    e0, e1 = Load("e0"), Load("e1")
    table = AffinityTable()
    choose([e0, e1], table, "t")
    assert choose([e1], table, "t") is e1 and table.owner("t") == "e1"  # re-homed, and stays there
    assert choose([e0, e1], table, "t") is e1
    table.forget_engine("e1")
    assert table.owner("t") is None


def test_the_affinity_table_forgets_the_least_recently_used_keys() -> None:
    table = AffinityTable(max_keys=2)
    table.assign("a", "e0")
    table.assign("b", "e1")
    table.assign("a", "e1")  # refreshes a
    table.assign("c", "e0")
    assert (table.owner("a"), table.owner("b"), table.owner("c")) == ("e1", None, "e0")


def test_cores_are_split_into_contiguous_near_equal_groups() -> None:
    assert split_cpus([3, 0, 1, 2], 2) == [(0, 1), (2, 3)]
    assert split_cpus([0, 1, 2, 3, 4, 5, 6], 3) == [(0, 1, 2), (3, 4), (5, 6)]
    assert split_cpus([0, 1], 2) == [(0,), (1,)]
    with pytest.raises(PlacementError, match="2 engines need at least 2 cores"):
        split_cpus([0], 2)


def test_gpus_per_engine_come_from_the_parallel_sizes_passed_to_vllm() -> None:
    assert devices_per_engine([]) == 1
    assert devices_per_engine(["--tensor-parallel-size", "2", "--max-num-seqs", "8"]) == 2
    assert devices_per_engine(["-tp", "2", "--pipeline-parallel-size=2"]) == 4
    assert devices_per_engine(["--data-parallel-size", "2", "--tensor-parallel-size=2"]) == 4
    with pytest.raises(PlacementError, match="needs a number"):
        devices_per_engine(["--tensor-parallel-size", "two"])
    assert split_gpus(["0", "1", "2", "3"], 2, 2) == [("0", "1"), ("2", "3")]
    assert split_gpus(["4", "5", "6"], 3, 1) == [("4",), ("5",), ("6",)]
    with pytest.raises(PlacementError, match="need 4 GPUs; 3 are visible"):
        split_gpus(["0", "1", "2"], 2, 2)
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def _settings(tmp_path: Path, **changes: object) -> ScaleOutSettings:
    return ScaleOutSettings(**changes)  # type: ignore[arg-type]


def _base(tmp_path: Path, **changes: object) -> EngineConfig:
    return EngineConfig(model_path=tmp_path, served_model_name="base", port=8123, log_path=tmp_path / "engine.log",
                        **changes)  # type: ignore[arg-type]


def test_each_local_engine_gets_its_own_port_log_and_cores(tmp_path: Path) -> None:
    configs = local_engine_configs(_settings(tmp_path, engines=2), _base(tmp_path, cpu_ids=(0, 1, 2, 3)))
    assert [c.cpu_ids for c in configs] == [(0, 1), (2, 3)]
    assert configs[0].port == 8123 and configs[1].port != 8123
    assert [c.log_path.name for c in configs] == ["engine.log", "engine-1.log"]
    one = local_engine_configs(_settings(tmp_path, engines=1), _base(tmp_path))
    assert one == [_base(tmp_path)]  # one engine: all cores, as before
    assert local_engine_configs(_settings(tmp_path, engines=0), _base(tmp_path)) == []


def test_each_local_cuda_engine_sees_only_its_own_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    base = _base(tmp_path, device="cuda", extra_args=("--tensor-parallel-size", "2"))
    configs = local_engine_configs(_settings(tmp_path, engines=2), base)
    assert [dict(c.extra_env)["CUDA_VISIBLE_DEVICES"] for c in configs] == ["0,1", "2,3"]


def test_remote_keys_are_none_one_for_all_or_one_each() -> None:
    urls = ("http://a:8000", "http://b:8000")
    assert remote_keys(urls, ()) == [None, None]
    assert remote_keys(urls, ("k",)) == ["k", "k"]
    assert remote_keys(urls, ("k1", "k2")) == ["k1", "k2"]
    with pytest.raises(ValueError, match="one per URL"):
        remote_keys(urls, ("k1", "k2", "k3"))


def test_the_policy_engine_spills_over_to_an_idle_lora_engine_only_under_load() -> None:
    assert not spill_to_lora(Load("policy", outstanding=8), Load("lora", outstanding=0))  # below a batch
    assert spill_to_lora(Load("policy", outstanding=40), Load("lora", outstanding=0))
    assert not spill_to_lora(Load("policy", outstanding=40), Load("lora", outstanding=20))  # 40 < 2·21
    assert spill_to_lora(Load("policy", outstanding=42), Load("lora", outstanding=20))
    assert not spill_to_lora(Load("policy", outstanding=1000), None)  # no LoRA engine serving
