"""Transport security shared by the RuntimeService server, the shard workers and clients.

TLS and mTLS with grpcio's own credentials, bearer tokens checked by a server
interceptor, and the start-up rule that a non-loopback address is served only with TLS
and authentication. No MLX here: the launcher parses these flags before it re-executes.
"""
