"""The registry of algorithms: one line per algorithm, loaded without torch."""

from __future__ import annotations

import pytest
from import_helpers import modules_imported_by

from hpcrl.algorithms import ALGORITHMS, load_algorithm
from hpcrl.errors import ConfigError


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_each_registered_module_defines_the_algorithm_of_its_name(name: str):
    algorithm = load_algorithm(name)
    assert algorithm.name == name
    assert callable(algorithm.select) and callable(algorithm.loss) and callable(algorithm.more_prompts)


def test_loading_an_unknown_algorithm_is_a_config_error_naming_the_known_ones():
    with pytest.raises(ConfigError, match="unknown algorithm 'ppo'; the known algorithms are grpo, dapo, gspo, dr_grpo"):
        load_algorithm("ppo")


@pytest.mark.timeout(60)
def test_the_registry_and_every_algorithm_module_load_without_torch():
    code = "from hpcrl.algorithms import ALGORITHMS, load_algorithm; [load_algorithm(n).defaults for n in ALGORITHMS]"
    assert modules_imported_by(code, ("torch",)) == []


def test_how_many_generate_rounds_a_batch_takes_is_the_algorithms_answer_not_a_flag_the_controller_reads():
    from hpcrl.algorithms import algorithm_options

    dapo = algorithm_options(name="dapo", max_sampling_rounds=3)
    assert load_algorithm("dapo").max_rounds(dapo) == 3
    assert load_algorithm("dapo").max_rounds(algorithm_options(name="dapo", dynamic_sampling=False)) == 1
    for name in ("grpo", "gspo", "dr_grpo", "reinforce_pp"):
        assert load_algorithm(name).max_rounds(algorithm_options(name=name)) == 1
