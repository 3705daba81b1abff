"""How versions move between checkpoints, stores and folders: planning, transfers, publish, pull,
selected tensors, multi-rank parts, retention, mirrors and the fleet ledger."""
