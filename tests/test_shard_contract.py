"""The shard engine contract, run against the MLX engine and the fault injector (faults off)."""

from inference_engine.shard.worker.mlx_engine import MlxShardEngine
from tests.fixtures.fault_config import FaultConfig
from tests.fixtures.fault_injection import FaultInjectingEngine
from tests.shard_contract import ShardEngineContract


def _mlx(model, layers, **limits):
    return MlxShardEngine(model, layers, block=4, max_rollback=4, **limits)


class TestMlxShardEngine(ShardEngineContract):
    def make_engine(self, model, layers, **limits):
        return _mlx(model, layers, **limits)


class TestFaultInjectingEngineFaultsOff(ShardEngineContract):
    def make_engine(self, model, layers, **limits):
        return FaultInjectingEngine(_mlx(model, layers, **limits), FaultConfig())
