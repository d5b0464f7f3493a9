"""Executing weight-transfer plans: trainer FSDP shards -> live vLLM parameters, point to point.

  registry.py      open_group(transport, ...): the transports by name, and the TransferLink they give
  gloo.py          a gloo process group spanning trainer ranks and vLLM workers, digest handshake
  ucx.py           the same over UCX (optional: ucxx)
  execute.py       messages of a plan for one rank; pack, send, receive, unpack (torch only)
  trainer.py       the trainer side: send from local FSDP shards, never full_tensor()
  vllm_engine.py   the vLLM side: a WeightTransferEngine ("hpcrl") in vLLM's registry, and its init info
                   (the worker extension that registers it in vLLM's workers: hpcrl.inference.vllm_worker)

The plan both ends execute is hpcrl.plan.for_config.plan_for_config's; the groups form on the signed
rendezvous store and compare the plan's digest there (hpcrl.rendezvous).

Ranks in the transfer group: trainer rank t is t; inference (replica j, TP rank r) is
trainer_world_size + j * tensor_parallel + r.
"""
