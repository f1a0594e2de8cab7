"""Parallel options: validated at the config and CLI boundary, never silently ignored."""

from __future__ import annotations

import pytest

from pagoda.config import EngineConfig
from pagoda.entrypoints.cli import build_parser, config_from_args


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"data_parallel_size": -1}, "data_parallel_size"),
    ({"tensor_parallel_size": 3, "nnodes": 2, "distributed_init_method": "tcp://h:1"}, "multiple of nnodes"),
    ({"tensor_parallel_size": 2, "nnodes": 2}, "rendezvous"),
    ({"node_rank": 1}, "node_rank"),
    ({"data_parallel_size": 2, "distributed_init_method": "tcp://h:1"}, "data-parallel"),
    ({"distributed_timeout": 0}, "distributed_timeout"),
    ({"threads_per_rank": 0}, "threads_per_rank"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "slurm"}, "mp or ray"),
    ({"data_parallel_size": 2, "data_parallel_backend": "threads"}, "mp or ray"),
    ({"distributed_executor_backend": "ray"}, "needs --tensor-parallel-size > 1"),
    ({"data_parallel_backend": "ray"}, "needs --data-parallel-size > 1"),
    ({"tensor_parallel_size": 2, "ray_address": "10.0.0.1:6379"}, "--ray-address needs"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "ray", "nnodes": 2,
      "distributed_init_method": "tcp://h:1"}, "Ray places the ranks"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "ray",
      "distributed_init_method": "tcp://h:1"}, "Ray places the ranks"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "ray", "device": "cuda"}, "CPU only"),
    ({"data_parallel_size": 2, "data_parallel_backend": "ray", "device": "cuda"}, "CPU only"),
    ({"data_parallel_size": 2, "data_parallel_backend": "ray", "ray_address": "ray://h:10001"}, "Ray Client"),
])
def test_invalid_parallel_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("mode", ["int8", "q4", "gguf", "bf16"])
def test_tensor_parallelism_takes_every_quantized_mode(mode):
    c = EngineConfig(tensor_parallel_size=2, quantization=mode)
    assert (c.tensor_parallel_size, c.quantization, c.resolved_kv_cache_dtype) == (2, mode, "float16")


def _config(argv: list[str]) -> EngineConfig:
    args = build_parser().parse_args(argv)
    return config_from_args(args)


def test_cli_master_addr_becomes_tcp_init_method():
    c = _config(["serve", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                 "--master-addr", "10.0.0.1", "--master-port", "29500"])
    assert (c.tensor_parallel_size, c.nnodes, c.node_rank) == (2, 2, 1)
    assert c.distributed_init_method == "tcp://10.0.0.1:29500"


def test_cli_rendezvous_options_conflict_or_incomplete():
    with pytest.raises(ValueError, match="not both"):
        _config(["serve", "--distributed-init-method", "tcp://a:1", "--master-addr", "b", "--master-port", "2"])
    with pytest.raises(ValueError, match="go together"):
        _config(["serve", "--master-addr", "b"])


def test_cli_data_parallel_is_for_serve():
    assert _config(["serve", "-dp", "2"]).data_parallel_size == 2
    with pytest.raises(ValueError, match="serve"):
        _config(["generate", "--data-parallel-size", "2"])


def test_ray_backends_name_the_extra_when_ray_is_missing(monkeypatch):
    import sys

    from pagoda.executor.ray_executor import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)   # as if not installed
    for kwargs in ({"tensor_parallel_size": 2, "distributed_executor_backend": "ray"},
                   {"data_parallel_size": 2, "data_parallel_backend": "ray"}):
        with pytest.raises(ImportError, match=r"pip install 'pagoda\[ray\]'"):
            EngineConfig(**kwargs)
    with pytest.raises(ImportError, match=r"pagoda\[ray\]"):
        import_ray()


def test_cli_ray_backends():
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (pip install 'pagoda[ray]')")
    c = _config(["serve", "-tp", "2", "-dp", "2", "--distributed-executor-backend", "ray",
                 "--data-parallel-backend", "ray", "--ray-address", "10.0.0.1:6379"])
    assert (c.distributed_executor_backend, c.data_parallel_backend, c.ray_address) == ("ray", "ray", "10.0.0.1:6379")
    assert _config(["serve", "-tp", "2"]).distributed_executor_backend == "mp"
    from pagoda.engine.dp_client import DataParallelLLM

    with pytest.raises(ValueError, match="multiprocess=False"):
        DataParallelLLM(EngineConfig(data_parallel_size=2, data_parallel_backend="ray"), multiprocess=False)
