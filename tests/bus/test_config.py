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
