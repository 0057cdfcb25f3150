"""CPU-only accelerators: what makes CPU training fast and that a GPU run never uses.

- `shared_memory`: the shared-memory transport, all-reduce, all-gather and reduce-scatter for
  gloo ranks that share one host, through a /dev/shm segment per group instead of gloo's loopback
  sockets (`ProcessGroups.initialize(transport=...)`).
- `host_memory`: glibc's malloc knobs, so a step's freed activations stay mapped for the next one
  (`specc train --host-memory`).
"""
