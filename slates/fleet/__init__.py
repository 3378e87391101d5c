"""Many hosts: the replicated ledger's pure protocol and its drivers (DESIGN.md section 7).

Pure machines (records in, messages and results out, time passed in):
`config` (the configuration as an input), `messages` (records and their
msgpack form), `ledger` (version values, chunks, recomputation), `holder`
(the acceptor), `owner` with `flight`, `copies`, `recovery` and `results`
(the proposer, its durability knowledge, failover and saved results),
`fencing` (whether a host may still make versions of a green it owns), and
`node` (one host's machines); `replica` maps a real green's versions (tree
records and chunks) onto those machines' values.  The deterministic simulator: `sim` (entry
point, `python -m slates.fleet.sim`), `world`, `council`, `simclients` and
`invariants`; `scripted` is a hand-scripted network for scenario tests.

Drivers (thin, real I/O): `pki` (the fleet CA and host enrolment, with the
cryptography package), `quic` (mutual-TLS QUIC between enrolled hosts,
aioquic's sans-I/O connection driven from trio), `etcd` (the configuration
group through etcd's v3 JSON gateway) and `serf` (membership and failure
verdicts from Debian's serf agent).  The fleet link (`link`, with
`link_rules`, `link_forward`, `link_client`, and `link_replicate` +
`link_tree` for replication, durability waits, takeover and recovery of
real greens, `link_fence` for the fence table its shards read,
`link_identity` for the submission identities that travel with versions,
`link_lease` for the lease and the fence table's upkeep, `link_register` for the
registration of greens, `link_membership` for serf and takeovers,
`link_process` for its lock, state file and anchor watch, `link_requests`
for fleet.sock's answers, `link_routing`, `link_local`, `link_remote` and
`link_submit` for remote work volumes)
is the process that joins a host to the fleet.
"""
