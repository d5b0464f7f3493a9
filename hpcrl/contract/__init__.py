"""The typed contract of the control bus: every endpoint the head calls and a group's task serves.

    endpoints.py  each endpoint: group, name, request type, reply type, idempotence; encode and check
    fields.py     type hint <-> msgpack value: the checks that name the bad field
    calls.py      GroupClient (the head's typed calls) and serve_endpoints (a role's typed handlers)

It sits just above env (below roles and rl): its messages hold the engines' own plain types
(hpcrl.data Prompt, inference Completion, reward Sample/RewardResult, env EnvRequest/EnvReply, trainer
TrainBatch), so a field is declared once, in the type that owns it, and both the caller
(hpcrl.rl.ports) and the callee (hpcrl.roles) import the one declaration. Those types are plain
dataclasses importing neither torch nor vLLM, and the bus below carries their maps as msgpack.
"""
