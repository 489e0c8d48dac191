"""The reliability battery of issue 15, run against a server through its public gRPC API only.

Sections (each a module, each returning a `SectionReport`):
- `bad_input`: every request field out of bounds, raw corrupt bytes, oversize messages ->
  the documented typed code, reason and field; the session is unchanged afterwards.
- `cancels`: random client cancels and deadlines on appends and generates -> every
  session's history and digest equal a replay of what its client saw.
- `traffic`: N clients x rounds of mixed traffic -> no UNKNOWN/INTERNAL, server RSS flat.
- `shutdown`: SIGTERM mid-stream -> every stream gets its final message, exit status 0.
- `security_checks`: TLS, bearer tokens, mTLS and session ownership.
- `fuzz`: a property-based fuzz (hypothesis) of every request message and of raw bytes.
`battery.run_battery` runs them in order; `scripts/reliability.py` is the command line
(`--quick` is the bounded form the tests run) and writes the JSON under results/reliability/.
"""
