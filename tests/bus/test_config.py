"""BusConfig refuses settings that would break the bus, naming the key and the fix."""

from __future__ import annotations

import pytest

from hpcrl.bus import BusConfig
from hpcrl.errors import ConfigError


def test_a_heartbeat_timeout_under_two_intervals_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"bus\.heartbeat_timeout.*under two heartbeat intervals"):
        BusConfig(heartbeat_interval=1.0, heartbeat_timeout=1.5)


@pytest.mark.parametrize("spin", [-1e-6, 0.5])
def test_a_reply_spin_outside_zero_to_a_tenth_of_a_second_is_refused_with_the_fix(spin):
    with pytest.raises(ConfigError, match=r"bus\.reply_spin.*between 0 and 0\.1 s.*or 0 to never spin"):
        BusConfig(reply_spin=spin)


def test_reply_spin_zero_turns_the_busy_poll_off_and_is_accepted():
    assert BusConfig(reply_spin=0).reply_spin == 0


def test_the_heads_message_limit_holds_twice_a_batchs_largest_reply_and_never_drops_under_16_mib():
    import msgpack

    from hpcrl.bus.config import MIN_MESSAGE_BYTES, message_limit_for

    # The largest message a head receives: a replica's generate reply for a whole batch, with large
    # token ids (5 msgpack bytes each), float64 logprobs and 4 bytes of text a token.
    sequences, prompt, completion = 256, 512, 1536
    reply = {"id": 1, "ok": True, "r": [
        {"prompt_id": f"task-{i:06d}", "index": i % 8, "prompt_token_ids": [151_000 + j for j in range(prompt)],
         "token_ids": [151_000 + j for j in range(completion)], "logprobs": [-1.0 / (j + 3) for j in range(completion)],
         "text": "tok " * completion, "finish_reason": "length", "weight_version": 12} for i in range(sequences)]}
    size = len(msgpack.packb(reply, use_bin_type=True))
    limit = message_limit_for(sequences=sequences, tokens_per_sequence=prompt + completion)
    assert 2 * size <= limit < 8 * size  # ~15 bytes a token here; 48 leave room for long tokens of text
    assert message_limit_for(sequences=64, tokens_per_sequence=768) == MIN_MESSAGE_BYTES == 16 << 20


def test_a_receive_queue_under_one_message_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"bus\.receive_queue"):
        BusConfig(receive_queue=0)
