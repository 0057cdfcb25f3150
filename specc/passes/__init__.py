"""Passes over the op graph, run in this order by `specc.compiler`:

resolve      pick an implementation for every op (native, te, flash, unfused)
parallelize  infer layouts and insert the boundaries consumers need
optimize     let implementations absorb boundaries; drop conversions that cancel
"""
