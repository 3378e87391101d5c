"""Many hosts: the replicated ledger's pure protocol and its drivers (DESIGN.md section 7)."""
