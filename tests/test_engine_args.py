"""vLLM's engine arguments as users give them, Prorsa's platform-fitted defaults under them, what simulated engines
take from them, and the pieces of multi-node and data-parallel serving that need no engine (side-channel host and
ports, per-rank stats, the rank a trajectory goes to, admission by measured KV)."""

from __future__ import annotations

import argparse
import os
import socket
from types import SimpleNamespace

import pytest

from services.engine_agent.__main__ import extend, make_backend
from services.engine_agent.backends.sim_backend import SimBackend
from services.engine_agent.backends.vllm_backend import VllmBackend
from services.engine_agent.backends.vllm_engine import VllmEngine
from services.engine_agent.backends.vllm_launch import (
    VllmEngineConfig,
    _engine_env,
    engine_kwargs,
    prorsa_defaults,
)
from services.engine_agent.backends.vllm_stats import EngineStatsBox
from services.engine_agent.engine_args import (
    EngineArgError,
    load_engine_args,
    merge_engine_args,
    parse_engine_args,
    parse_engine_args_text,
    sim_ignored,
    sim_overrides,
)
from services.engine_agent.kv_host import (
    KvHostError,
    choose_nixl_host,
    free_port_block,
    is_loopback,
    nats_hosts,
)
from services.engine_agent.measured_capacity import PreemptionGate, measured_held
from services.engine_agent.pull_capacity import HeldWork
from services.runtime.model_profiles import load_profile


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        (["max_model_len=262144"], {"max_model_len": 262144}),
        (["max-model-len=8192", "max_model_len=9000"], {"max_model_len": 9000}),  # the later one wins
        (
            ["enforce_eager=false", "gpu_memory_utilization=0.85"],
            {"enforce_eager": False, "gpu_memory_utilization": 0.85},
        ),
        (["dtype=bfloat16"], {"dtype": "bfloat16"}),  # not JSON: a string
        (['compilation_config={"level": 3}'], {"compilation_config": {"level": 3}}),
    ],
)
def test_engine_args_parse_as_json_else_string(items: list[str], expected: dict) -> None:
    assert parse_engine_args(items) == expected


@pytest.mark.parametrize("bad", ["max_model_len", "=3", "1abc=2", "a b=1"])
def test_a_malformed_engine_arg_is_named(bad: str) -> None:
    with pytest.raises(EngineArgError, match="engine argument"):
        parse_engine_args([bad])


def test_engine_args_file_json_or_lines_and_the_command_line_wins(tmp_path) -> None:
    lines = tmp_path / "engine.args"
    lines.write_text("# a GPU layout\ntensor_parallel_size=4\n\nmax-num-seqs=256\n")
    assert load_engine_args(str(lines), ["max_num_seqs=128"]) == {
        "tensor_parallel_size": 4,
        "max_num_seqs": 128,
    }
    js = tmp_path / "engine.json"
    js.write_text('{"data_parallel_size": 2, "enable_expert_parallel": true}')
    assert load_engine_args(str(js), []) == {"data_parallel_size": 2, "enable_expert_parallel": True}
    with pytest.raises(EngineArgError, match="line 2"):
        parse_engine_args_text("a=1\nnot-a-pair\n", "f")
    with pytest.raises(EngineArgError, match="one object"):
        parse_engine_args_text("[1, 2]", "f")
    with pytest.raises(EngineArgError, match="cannot read"):
        load_engine_args(str(tmp_path / "missing"), [])


def test_the_user_wins_and_nested_configs_merge() -> None:
    defaults = {
        "enforce_eager": True,
        "kv_transfer_config": {"kv_role": "kv_both", "kv_connector_extra_config": {"kv_lease_duration": 120}},
    }
    user = {
        "enforce_eager": False,
        "kv_transfer_config": {"kv_connector_extra_config": {"backends": ["UCX"]}},
    }
    merged = merge_engine_args(defaults, user)
    assert merged["enforce_eager"] is False
    assert merged["kv_transfer_config"] == {
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kv_lease_duration": 120, "backends": ["UCX"]},
    }
    assert defaults["kv_transfer_config"]["kv_connector_extra_config"] == {
        "kv_lease_duration": 120
    }  # not aliased


def test_prorsa_defaults_fit_the_platform() -> None:
    config = VllmEngineConfig(model_path="m", engine_id="e")
    cpu, gpu = prorsa_defaults(config, is_cpu=True), prorsa_defaults(config, is_cpu=False)
    # CPU: eager (no graph capture), a fixed KV size and 4,096 tokens.
    assert (
        cpu["enforce_eager"] is True
        and cpu["kv_cache_memory_bytes"] == 512 << 20
        and cpu["max_model_len"] == 4096
    )
    # GPU: CUDA graphs, memory profiling and the model's own length stay vLLM's.
    assert not {"enforce_eager", "kv_cache_memory_bytes", "max_model_len"} & set(gpu)
    assert gpu["kv_transfer_config"]["kv_role"] == "kv_both" and gpu["skip_tokenizer_init"] is True
    # The user's engine arguments win over every default, on either platform.
    user = VllmEngineConfig(
        model_path="m", engine_id="e", extra_engine_args={"max_model_len": 12288, "enforce_eager": False}
    )
    assert (
        engine_kwargs(user, True)["max_model_len"] == 12288
        and engine_kwargs(user, True)["enforce_eager"] is False
    )
    with pytest.raises(EngineArgError, match="tensor_parallel_size"):
        engine_kwargs(
            VllmEngineConfig(model_path="m", engine_id="e", extra_engine_args={"tensor_parallel_size": 0}),
            False,
        )


@pytest.mark.parametrize(
    ("is_cpu", "extra", "in_process"),
    [(True, {}, "0"), (True, {"tensor_parallel_size": 2}, None), (False, {}, None)],
)
def test_engine_env_keeps_cpu_workarounds_on_one_cpu_worker(
    is_cpu: bool, extra: dict, in_process: str | None
) -> None:
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env = _engine_env(
        VllmEngineConfig(
            model_path="m", engine_id="e", nixl_port=5777, nixl_host="10.0.0.5", extra_engine_args=extra
        ),
        is_cpu,
    )
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5777" and env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.5"
    assert env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == in_process
    assert ("OMP_NUM_THREADS" in env) == is_cpu and ("VLLM_CPU_KVCACHE_SPACE" in env) == is_cpu


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    extend(p)
    p.add_argument("--instance-id")
    return p.parse_args(list(argv))


def test_simulated_engines_honour_the_engine_args_that_apply(tmp_path) -> None:
    f = tmp_path / "args"
    f.write_text("max_num_seqs=32\nmax_num_batched_tokens=4096\ngpu_memory_utilization=0.9\n")
    args = _args(
        "--backend",
        "sim",
        "--profile",
        "deepseek-v3.2",
        "--engine-args-file",
        str(f),
        "--engine-arg",
        "max_model_len=262144",
    )
    backend = make_backend(args, "e0")
    assert isinstance(backend, SimBackend)
    ranks = load_profile("deepseek-v3.2").dp_ranks
    assert backend.max_model_len == 262144
    assert backend.profile.max_batch == 32 * ranks  # per rank, as vLLM counts max_num_seqs
    assert backend.profile.mixed_chunk_tokens == 4096 and backend.profile.prefill_batch_tokens == 4096 * ranks
    assert sim_ignored({"max_model_len": 1, "gpu_memory_utilization": 0.9}) == ["gpu_memory_utilization"]
    assert sim_overrides({}, 4) == (None, {})
    with pytest.raises(SystemExit, match="max_num_seqs"):
        make_backend(_args("--backend", "sim", "--engine-arg", "max_num_seqs=-1"), "e0")


def test_nixl_host_is_routable_and_loopback_is_refused_with_a_remote_server() -> None:
    assert nats_hosts("nats://a:4222,nats://10.1.2.3:4223") == ["a", "10.1.2.3"]
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("10.1.2.3")
    local = "nats://127.0.0.1:4222"
    assert choose_nixl_host(None, local) == "127.0.0.1"
    remote = "nats://192.0.2.10:4222"  # TEST-NET-1: another host (routed by the default route, never reached)
    try:
        facing = choose_nixl_host(None, remote)
    except KvHostError:
        pytest.skip(
            "no route off this host (no default route): the routable-host choice cannot be shown here"
        )
    assert not is_loopback(facing)
    with pytest.raises(KvHostError, match="loopback"):
        choose_nixl_host("127.0.0.1", remote)
    assert choose_nixl_host("10.9.8.7", remote) == "10.9.8.7"
    # This machine's own address is not "another host": loopback is allowed when given, but by default the
    # routable address is announced (engines on other nodes may join this node's NATS server).
    assert choose_nixl_host("127.0.0.1", f"nats://{facing}:4222") == "127.0.0.1"
    assert choose_nixl_host(None, f"nats://{facing}:4222") == facing


def test_a_port_block_serves_every_data_parallel_rank() -> None:
    base = free_port_block(4)
    assert base > 0 and base + 4 <= 65536
    for port in range(base, base + 4):
        with socket.socket() as s:
            s.bind(("", port))  # the assertion: every port of the block is free (a taken one raises OSError)


def test_per_rank_stats_are_kept_apart_and_summed() -> None:
    box = EngineStatsBox()

    def sched(running: int, waiting: int, kv: float) -> SimpleNamespace:
        return SimpleNamespace(
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            kv_cache_usage=kv,
            prefix_cache_stats=SimpleNamespace(queries=10, hits=5),
        )

    box.record(sched(3, 1, 0.5), None, engine_idx=0)
    box.record(sched(5, 0, 0.25), None, engine_idx=1)
    box.record(
        sched(4, 2, 0.75),
        SimpleNamespace(num_prompt_tokens=1, num_generation_tokens=2, num_preempted_reqs=1),
        engine_idx=0,
    )
    s = box.snapshot(unfinished=9, kv_capacity_tokens=2000, max_batch=16, start_s=1.0, dp_size=2)
    assert (s.running, s.waiting) == (9, 2)  # rank 0's latest (4, 2) + rank 1's (5, 0): nothing overwritten
    assert s.kv_usage == pytest.approx(0.5)  # (0.75 + 0.25) / 2 ranks of equal size
    assert [r.rank for r in s.per_rank] == [0, 1] and s.preemptions == 1 and s.prefix_query_tokens == 30


def test_a_trajectory_keeps_its_data_parallel_rank() -> None:
    engine = VllmEngine(VllmEngineConfig(model_path="m", engine_id="e"))
    assert engine.dp_rank_for("traj-1") is None  # one rank: vLLM's own choice
    engine.dp_size = 4
    ranks = {engine.dp_rank_for(f"traj-{i}") for i in range(64)}
    assert ranks == {0, 1, 2, 3}  # spread over every rank
    assert all(engine.dp_rank_for(f"t{i}") == engine.dp_rank_for(f"t{i}") for i in range(10))


def test_measured_kv_admission_and_the_preemption_gate() -> None:
    held = HeldWork(prefill_jobs=1, prefill_tokens=10, decode_jobs=3, kv_reserved_tokens=999_999)
    assert measured_held(held, kv_used_tokens=5000, pending_context_tokens=700) == HeldWork(1, 10, 3, 5700)
    gate = PreemptionGate(hold_s=2.0)
    assert gate.open(0, 0.0)
    assert not gate.open(3, 1.0)  # a preemption: closed for 2 s
    assert not gate.open(3, 2.5) and gate.open(3, 3.1)


def test_per_role_engine_args_say_which_switches_restart() -> None:
    args = _args(
        "--backend", "vllm", "--model", "/m", "--role", "prefill", "--engine-arg", "tensor_parallel_size=2",
        "--role-engine-arg", "decode:data_parallel_size=2", "--role-engine-arg", "decode:tensor_parallel_size=1",
    )  # fmt: skip
    backend = make_backend(args, "e0", "nats://127.0.0.1:4222")
    assert isinstance(backend, VllmBackend)
    assert backend.engine.config.extra_engine_args == {"tensor_parallel_size": 2}
    assert backend.role_overrides["decode"] == {
        "extra_engine_args": {"tensor_parallel_size": 1, "data_parallel_size": 2}
    }
    # Prefill and mixed share the engine-wide layout (in place); decode has its own (a restart).
    assert backend.restart_roles() == ("decode",)
    assert backend.stats().restart_roles == ("decode",)
    with pytest.raises(SystemExit, match="ROLE:K=V"):
        make_backend(_args("--backend", "vllm", "--model", "/m", "--role-engine-arg", "fast:x=1"), "e0")
