"""The inference group: one vLLM engine per replica, serving rollouts and receiving weights."""
