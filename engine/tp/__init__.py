"""Tensor parallelism across processes: one engine replica over N devices of a node.

Rank 0 is the process that owns the LLMEngine (scheduler, block manager, sampler). It
starts N-1 rank workers through a launcher (engine.tp.launcher: local processes by
default; deployments.tp_launcher places Ray actors in the replica's placement group), and
every step broadcasts to them what they need to run the same forward: the step's chunks
with their token ids and only the block-table entries that changed (engine.tp.messages),
over a gloo CPU group separate from the model's collectives (engine.tp.channel). All ranks
run the forward on their shard (row-parallel layers all-reduce over NCCL on CUDA, gloo on
CPU); the LM head gathers logits on rank 0, which samples. A STOP message ends the workers.

Faults: a dead rank fails the next collective (its sockets close) or shows in
``check()``; a hung one trips the collectives' timeout (``distributed_timeout_s``). Either
way the engine reports EngineDeadError and the launcher kills what is left.
"""
