"""Pure-torch references of every op: the CPU path, and the oracle every kernel is tested against."""
