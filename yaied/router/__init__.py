"""The router: one EngineManager in front of one or more engines (in-process, local processes,
remote daemons), with the routing policy, call lifecycle and KV-locality bookkeeping.

A regular package (not a namespace one) so that import-linter's graph sees its modules."""
