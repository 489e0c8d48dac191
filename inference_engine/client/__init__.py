"""The command-line client (`python -m inference_engine chat|generate`): grpc, protobuf and the stubs only."""
