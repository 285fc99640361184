"""EngineConfig validation: each bad value is refused with a message naming the flag."""

import pytest

from services.engine.config import EngineConfig


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"moe_cache_size": 4, "moe_cache_rate": 0.5}, "mutually exclusive"),
        ({"moe_cache_rate": 0.5, "moe_cache_auto": True}, "mutually exclusive"),
        ({"moe_cache_size": 0}, "--moe-cache-size"),
        ({"moe_cache_rate": 1.5}, "--moe-cache-rate"),
        ({"moe_hybrid_max_fetch": -2}, "--moe-hybrid-max-fetch"),
        ({"moe_cpu_threads": -1}, "--moe-cpu-threads"),
        ({"moe_prefetch": -1}, "--moe-prefetch"),
        ({"gpu_memory_limit": 0}, "--gpu-memory-limit"),
        ({"max_seq_len": 0}, "--max-seq-len"),
        ({"moe_backend": "magic"}, "magic"),
        ({"moe_cache_policy": "fifo"}, "fifo"),
        ({"moe_cache_lfu_cap": 1}, "--moe-cache-lfu-cap"),
        ({"moe_cache_lfu_cap": 1025}, "--moe-cache-lfu-cap"),
        ({"moe_cache_policy": "lfu", "moe_prefetch": 1}, "--moe-cache-policy lfu does not combine with --moe-prefetch"),
        ({"batch_invariant": True, "moe_backend": "cpu"}, "--batch-invariant needs --moe-backend resident or"),
        ({"batch_invariant": True, "moe_backend": "hybrid"}, "--batch-invariant needs --moe-backend resident or"),
        ({"batch_invariant": True, "moe_backend": "auto"}, "--batch-invariant needs --moe-backend resident or"),
        ({"batch_invariant": True, "dtype": "bfloat16"}, "--batch-invariant on --device cpu needs --dtype float32"),
    ],
)
def test_bad_config_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        EngineConfig(model="demo", **kwargs)


def test_good_config():
    cfg = EngineConfig(model="demo", moe_backend="hybrid", moe_cache_rate=0.25, moe_hybrid_max_fetch=0)
    assert cfg.moe_backend.value == "hybrid"


def test_batch_invariant_is_off_by_default_and_turns_the_prefix_cache_off():
    assert not EngineConfig(model="demo").batch_invariant
    for backend in ("resident", "offload"):
        cfg = EngineConfig(model="demo", device="cuda", dtype="bfloat16", moe_backend=backend, batch_invariant=True)
        assert cfg.batch_invariant and not cfg.prefix_cache
    assert not EngineConfig(model="demo", batch_invariant=True).prefix_cache  # CPU, float32


def test_the_cli_refuses_batch_invariant_with_a_cpu_share_in_one_line(capsys):
    import argparse

    from services.common.settings import add_dataclass_arguments, config_or_exit

    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, EngineConfig)
    with pytest.raises(SystemExit) as exit_:
        config_or_exit("tandem serve", EngineConfig,
                       parser.parse_args(["--model", "demo", "--moe-backend", "hybrid", "--batch-invariant"]))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("tandem serve: --batch-invariant")
    assert "--batch-invariant" in parser.format_help()


def test_the_cache_policy_defaults_to_lfu_but_lru_under_the_prefetch():
    """Unset, the policy is lfu (fewer misses, runs 35-37); with --moe-prefetch lru, whose order keeps the
    prefetch's slots safe; given, it is kept."""
    assert EngineConfig(model="demo").moe_cache_policy.value == "lfu"
    assert EngineConfig(model="demo", moe_prefetch=2).moe_cache_policy.value == "lru"
    assert EngineConfig(model="demo", moe_cache_policy="lru").moe_cache_policy.value == "lru"


def test_the_lfu_cap_bound_is_the_kernels():
    """The config's bound (it loads without torch) is the kernels' USE_CAP, the default."""
    from kernels.ensure_experts_ref import USE_CAP
    from services.engine.config import LFU_CAP_MAX

    assert LFU_CAP_MAX == USE_CAP == EngineConfig(model="demo").moe_cache_lfu_cap


@pytest.mark.parametrize("device, backend, running", [("cuda", "resident", 32), ("cuda", "hybrid", 8),
                                                      ("cuda", "offload", 8), ("cpu", "resident", 8)])
def test_running_requests_default_to_a_gpu_servers_width_on_resident_cuda(device, backend, running):
    assert EngineConfig(model="demo", device=device, moe_backend=backend).max_running_requests == running
    assert EngineConfig(model="demo", device=device, moe_backend=backend, max_running_requests=3).max_running_requests == 3
