"""What a pipeline is made of, and the contracts its parts keep: nodes and their checked arguments, the
graph they form, the failure policy, the executor contract every executor subclasses. The lowest layer
above the leaves: the cache keys, the plan and the runtime stand on it."""
