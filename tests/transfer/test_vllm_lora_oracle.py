"""The LoRA oracle is vLLM itself: PEFT adapters (made by peft on the tiny Llama, A and B non-zero) go from trainer
ranks holding FSDP2 Shard(0) rows (sizes 2, 3, 1, 2: uneven chunks) into vLLM's LoRA slots through the LoRA
plan, one policy version each (tests/transfer/lora_oracle_driver.py, hpcrl's VllmEngine with [lora], rank 4 in
slots of vLLM's max_lora_rank 8, alpha 8). After each sync every LoRA slot tensor of the version is bitwise equal to
vLLM's own loading of the same PEFT directory, greedy generation equal, and unlike the base model's: it fails if
the adapter is not sent (veRL #7495: rollouts silently on the initial policy). Versions stay resident and
unchanged while newer ones arrive (a request started on one finishes on it), at most 3 (max_policy_lag + 1), the
oldest evicted. Versions 0-3, as a run syncs them (adapter ids 1-4). TP 1 in CI: 170-220 s on the loaded 2-core
machine (one engine start of 30-75 s, four adapters made by peft, four syncs with their trainer processes and the
generations compared); TP 2 extended (its engine start alone 100 s).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("peft")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
# The dense oracle's subprocess runner (kills its session on timeout) and its session's tiny models.
from test_vllm_oracle import run_driver, tiny_models  # noqa: E402, F401 - tiny_models: a fixture, shared

DRIVER = REPO / "tests" / "transfer" / "lora_oracle_driver.py"
pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.extended)], ids=["tp1", "tp2"])
def test_synced_adapters_equal_vllm_own_loading_of_the_peft_directory_bitwise_and_in_generation(
        tiny_models, tmp_path, tp):  # noqa: F811 - tiny_models: the dense oracle's session fixture, imported above
    events = run_driver([str(tiny_models / "tiny-llama"), "--preset", "tiny-llama", "--tp", str(tp), "--fsdp", "2,3,1,2",
                         "--work", str(tmp_path)], timeout=380, driver=DRIVER)
    updates = [e for e in events if e["event"] == "update"]
    assert [u["version"] for u in updates] == [0, 1, 2, 3]  # version 0 first, as a run syncs its initial adapter
    for u in updates:
        assert [t[1] for t in u["trainers"]] == ["ok"] * u["fsdp"], u["trainers"]
        sent = sum(t[2] for t in u["trainers"])
        assert sent == u["plan_bytes"] == sum(r["bytes"] for r in u["last"])  # the adapter only, 1.00x
        assert len(u["digests"]) == tp
        # The veRL #7495 failure (the adapter never sent) would leave the base model's tokens here.
        assert u["generation"] != u["generation_base"]
        assert u["generation"] == u["generation_lora_request"]  # generate uses the newest version
    for u in updates[:2]:  # vLLM's own loading of the same PEFT directory, beside the resident versions
        assert u["digests"] == u["digests_reference"]
        assert u["generation"] == u["generation_reference"]
        assert u["logprobs_equal"]  # the mismatch probe's logprobs come from the synced version too
    # A version's slot is never written while it is resident; the oldest is evicted past max_policy_lag + 1.
    assert [u["resident"] for u in updates] == [[0], [0, 1], [0, 1, 2], [1, 2, 3]]
    for u in updates:
        assert all(e == {"digests_equal": True, "generation_equal": True} for e in u["earlier"].values()), u["earlier"]
        assert sorted(map(int, u["earlier"])) == [v for v in u["resident"] if v != u["version"]]
