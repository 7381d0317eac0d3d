"""One copy of the weights across FSDP2 training and tensor-parallel vLLM: pure planning, tested on CPU.

`tp_layout` says which slice of which HF weight vLLM's tensor-parallel rank r holds and whether FSDP2's shard of
that weight on the same rank is that slice; `shard_placement` builds the `shard_placement_fn` for FSDP2's
`fully_shard` that makes them coincide and reports the weights that keep a copy of their own; `mesh_shape` lays the
ranks out so that the FSDP2 shard group is the vLLM tensor-parallel group (HSDP across groups). Nothing here needs a
GPU or vLLM.
"""
