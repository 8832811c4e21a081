"""The engine: what a merge run means, whatever executes it.

- :mod:`.plan`: the merges due after a local step, grouped into sets of disjoint
  pairs, their mixing weights and their bytes on the wire (pure functions of the
  policy, the schedule and the seed);
- :mod:`.state`: the workers' training state (parameters, optimiser state, supports,
  counters) as stacked rows;
- :mod:`.run`: the study's data and model (:class:`Setup`), the local steps, the round
  loop and the round-end judge, and the result of a run.

A backend (:mod:`evomerge.backends`) supplies only where the rows live and how
tensors move between workers.
"""
