"""Layer-range shard workers: one model computed by a route of processes.

Read in this order:
- `types.py`: the typed data at the engine boundary (layer range, work, output, health).
- `errors.py`: the shard protocol's error codes and the exceptions that carry them.
- `engine.py`: the `ShardEngine` contract; `mlx_engine.py` the real one (layers
  [start, end) on the exact sink-window path); `fault_injection.py` (+ `fault_config.py`) a TEST FIXTURE.
- `tensor_codec.py` and `wire.py`: protobuf <-> numpy / dataclasses (fragments, CRC32C).
- `servicer.py`, `session_stream.py`, `route_table.py`, `engine_thread.py`, `status_codes.py`: the worker's
  grpc.aio ShardRuntime service and its fail-closed stream protocol.
- `worker.py` / `worker_config.py`: the `shard-worker` process.
- `hop_stream.py` and `pipeline.py`: the client, `ShardPipeline`, that drives a route.
- `remote_executor.py`: a verifier's layers on a route (the server's side: replay after failures);
  `supervisor.py`: the workers `serve --spawn-shards` starts and restarts.
"""
