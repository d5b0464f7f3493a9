"""Nodes of the local cluster as separate hosts: each slurmd of tools/local_slurm.sh in its own network,
UTS and mount namespace (issue 16). Real srun jobs show each task's hostname, address and loopback.

Run only where the cluster is namespaced (root with `ip netns` and `unshare`); skipped, saying so, where
tools/local_slurm.sh fell back to nodes sharing localhost.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from throwaway_cluster import run_script, throwaway_settings

pytestmark = [pytest.mark.slurm]



def _network(conf: Path) -> tuple[int, dict[str, str]] | None:
    """The cluster index C and {node: address} of a namespaced cluster's slurm.conf; None if it shares localhost."""
    text = conf.read_text()
    mark = re.search(r"^# hpcrl-local-slurm netns (\d+)$", text, re.M)
    if not mark:
        return None
    return int(mark.group(1)), dict(re.findall(r"^NodeName=(\S+) .*NodeAddr=(\S+)", text, re.M))


@pytest.fixture(scope="module")
def namespaced(local_slurm: dict[str, str]) -> tuple[dict[str, str], int, dict[str, str]]:
    """The client environment, C and {node: address} of the suite's cluster; skips if its nodes share localhost."""
    network = _network(Path(local_slurm["SLURM_CONF"]))
    if network is None:
        pytest.skip("the local Slurm cluster's nodes share localhost (tools/local_slurm.sh found no network "
                    "namespaces here, or HPCRL_LOCAL_SLURM_NETNS=0): no per-node hostname or loopback to test")
    return local_slurm, *network


def _srun_json(env: dict[str, str], script: str, *args: str, nodes: int = 2) -> list[dict]:
    """Run `script` with this Python as one task on each of `nodes` nodes; each task prints one JSON line."""
    done = subprocess.run(["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
                           sys.executable, "-c", script, *args],
                          env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == nodes, done.stdout + done.stderr
    return sorted(rows, key=lambda row: row["procid"])


IDENTITY = r"""
import json, os, socket, sys
bridge, names = sys.argv[1], sys.argv[2].split(",")
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((bridge, 9))  # no packet sent: the kernel picks the source address toward the bridge
print(json.dumps({"procid": int(os.environ["SLURM_PROCID"]), "slurmd_node": os.environ["SLURMD_NODENAME"],
                  "hostname": socket.gethostname(), "address": probe.getsockname()[0],
                  "resolved": {name: socket.gethostbyname(name) for name in names}}), flush=True)
"""


@pytest.mark.timeout(120)
def test_every_task_has_its_nodes_hostname_and_address(namespaced):
    env, index, nodes = namespaced
    rows = _srun_json(env, IDENTITY, f"198.18.{index}.254", ",".join(nodes))
    assert len({row["slurmd_node"] for row in rows}) == 2
    for row in rows:
        node = row["slurmd_node"]
        assert row["hostname"] == node
        assert row["address"] == nodes[node] == f"198.18.{index}.{node.removeprefix('n')}"
        assert row["resolved"] == nodes  # every node's name resolves, on every node, to its own cluster's address


ISOLATION = r"""
import json, os, socket, sys, threading, time
from pathlib import Path
rendezvous, result = Path(sys.argv[1]), Path(sys.argv[2])
procid, node = int(os.environ["SLURM_PROCID"]), os.environ["SLURMD_NODENAME"]

def serve(server, token):
    while True:
        conn, _ = server.accept()
        conn.sendall(token)
        conn.close()

def fetch(host, port):
    try:
        with socket.create_connection((host, port), timeout=5) as conn:
            return conn.recv(64).decode()
    except OSError as error:
        return type(error).__name__

if procid == 0:
    address = socket.gethostbyname(node)
    loopback, own = socket.create_server(("127.0.0.1", 0)), socket.create_server((address, 0))
    for server, token in ((loopback, b"loopback of " + node.encode()), (own, b"address of " + node.encode())):
        threading.Thread(target=serve, args=(server, token), daemon=True).start()
    ports = {"node": node, "loopback": loopback.getsockname()[1], "own": own.getsockname()[1]}
    rendezvous.with_suffix(".tmp").write_text(json.dumps(ports))
    rendezvous.with_suffix(".tmp").rename(rendezvous)
    local = fetch("127.0.0.1", ports["loopback"])  # the loopback server is there, for this node
    deadline = time.monotonic() + 60
    while not result.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps({"procid": 0, "node": node, "own_loopback": local}), flush=True)
else:
    deadline = time.monotonic() + 60
    while not rendezvous.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    ports = json.loads(rendezvous.read_text())
    row = {"procid": procid, "node": node, "server_node": ports["node"],
           "loopback": fetch("127.0.0.1", ports["loopback"]),
           "by_name": fetch(ports["node"], ports["own"])}
    result.write_text("done")
    print(json.dumps(row), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_port_on_one_nodes_loopback_is_unreachable_from_another_node(namespaced, tmp_path: Path):
    env, _, _ = namespaced
    first, second = _srun_json(env, ISOLATION, str(tmp_path / "ports.json"), str(tmp_path / "done"))
    server = first["node"]
    assert second["node"] != server and second["server_node"] == server
    assert first["own_loopback"] == f"loopback of {server}"
    # 127.0.0.1 on the other node is that node's own loopback, where nothing listens on the port ...
    assert second["loopback"] == "ConnectionRefusedError"
    # ... while the server bound on the first node's address answers under the node's name.
    assert second["by_name"] == f"address of {server}"


def _leftovers(index: int) -> list[str]:
    """Namespaces, links and /etc/hosts lines of cluster index `index` still on this host."""
    found = [f"netns {line.split()[0]}" for line in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()
        if re.match(rf"hpcrl{index}n\d+$", line.split()[0])]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10, check=True).stdout
    found += [f"link {name}" for name in re.findall(rf"^\d+: (hpcrl{index}(?:n\d+|br))[@:]", links, re.M)]
    hosts = Path("/etc/hosts").read_text().splitlines()
    found += [f"/etc/hosts: {line}" for line in hosts
              if line.startswith(f"198.18.{index}.") or line.startswith(f"# hpcrl-local-slurm {index} ")]
    return found


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_down_leaves_no_namespace_link_or_hosts_entry_behind(namespaced):
    env, suite_index, _ = namespaced
    directory, settings = throwaway_settings("hpcrl-ns-", 46817, **{"HPCRL_LOCAL_SLURM_NETNS": "1"})

    def script(command: str) -> subprocess.CompletedProcess[str]:
        return run_script(settings, command, timeout=120)

    try:
        first = script("up")
        assert first.returncode == 0, first.stderr
        again = script("up")  # idempotent, with the same line for tools/test.sh to eval
        assert again.returncode == 0 and again.stdout == first.stdout == f"export SLURM_CONF={directory}/slurm.conf\n"
        network = _network(directory / "slurm.conf")
        assert network is not None, first.stderr
        index, nodes = network
        assert index != suite_index and set(nodes) == {"n1", "n2"}
        assert len(_leftovers(index)) == 2 + 3 + 4, _leftovers(index)  # 2 namespaces, 2 veths + bridge, 2 hosts + 2 markers
        status = script("status")
        assert f"n2 198.18.{index}.2 netns hpcrl{index}n2 link up" in status.stdout, status.stdout

        down = script("down")
        assert down.returncode == 0, down.stderr
        assert _leftovers(index) == []
        assert script("down").returncode == 0  # again, with nothing left: still fine
        suite_hosts = Path("/etc/hosts").read_text()
        assert f"# hpcrl-local-slurm {suite_index} begin" in suite_hosts  # the suite's cluster kept its names
    finally:
        script("down")
        shutil.rmtree(directory, ignore_errors=True)
