"""Layer-range shard workers: one model computed by a route of processes.

- `protocol/`: what crosses the wire, shared by both ends: typed data, error codes and
  their gRPC status mapping, frame building and checking, the tensor codec (CRC32C).
- `worker/`: the `shard-worker` process: the ShardRuntime servicer, its fail-closed
  session streams and route table, and the engines behind them (`MlxShardEngine` runs a
  span of the model's layers through the model's own `forward`).
- `client/`: the server's side: `ShardPipeline` drives a route, `ShardRoute` runs it on
  its own loop, `RouteBackend` makes it the engine's backend, `WorkerSupervisor` spawns
  and restarts workers (`serve --spawn-shards`).
"""
