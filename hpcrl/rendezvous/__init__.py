"""Where process groups meet, and what they leave listening: below the trainer and the weight transfer.

  store.py    a torch.distributed.Store whose table one server keeps, over requests signed with the
              run's secret (StoreServer, BusStore)
  meet.py     serving that store (the head, `hpcrl run`, tests), a rank's client of it, the
              per-group prefix every transport forms on, and the plan-digest comparison
  listen.py   where gloo listens (loopback when a group shares one machine) and the sealing of
              every gloo listener once its group formed

The trainer's own process group (trainer/group.py), every transport (transfer/gloo.py, ucx.py,
nccl.py) and vLLM's processes (inference/vllm_llm.py) form through it; it needs only the bus's
secret and ZeroMQ authentication (hpcrl.bus).
"""
