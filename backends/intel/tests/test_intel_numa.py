"""NUMA topology parsing against fixture sysfs trees (1, 2, 4 nodes) and real pinning on this machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvexport.errors import InputError
from kvexport_intel import numa


def make_sysfs(root: Path, nodes: dict[int, str], online: str, offline: str = "") -> Path:
    """A fixture tree shaped like /sys/devices/system: node/nodeN/cpulist, cpu/online, cpu/offline."""
    for n, cpulist in nodes.items():
        (root / "node" / f"node{n}").mkdir(parents=True)
        (root / "node" / f"node{n}" / "cpulist").write_text(cpulist + "\n")
    (root / "node" / "possible").parent.mkdir(parents=True, exist_ok=True)
    (root / "node" / "possible").write_text(f"0-{max(nodes)}\n")  # not a node dir: must be ignored
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "online").write_text(online + "\n")
    (root / "cpu" / "offline").write_text(offline + "\n")
    return root


def test_parse_cpulist() -> None:
    assert numa.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert numa.parse_cpulist("") == []
    assert numa.parse_cpulist("5") == [5]


def test_one_node(tmp_path: Path) -> None:
    t = numa.read_topology(make_sysfs(tmp_path, {0: "0-7"}, "0-7"))
    assert t.from_sysfs and [n.id for n in t.nodes] == [0]
    assert t.nodes[0].cpus == tuple(range(8))
    assert numa.choose_node(t, None, allowed=set(range(8))).id == 0


def test_two_nodes_with_offline_cpus(tmp_path: Path) -> None:
    t = numa.read_topology(make_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"}, "0-5,8-15", offline="6-7"))
    assert t.node(0).cpus == (0, 1, 2, 3, 8, 9, 10, 11)
    assert t.node(1).cpus == (4, 5, 12, 13, 14, 15)
    assert t.node(1).offline_cpus == (6, 7)
    assert t.offline == (6, 7)
    # automatic: the node with most CPUs this process may use (a taskset on node 1's CPUs)
    assert numa.choose_node(t, None, allowed={4, 5, 12}).id == 1
    assert numa.choose_node(t, None, allowed=set(range(16))).id == 0  # 8 online beats 6
    assert numa.node_cpus_for_process(t.node(1), allowed={4, 5, 12}) == [4, 5, 12]


def test_four_nodes_and_errors(tmp_path: Path) -> None:
    t = numa.read_topology(make_sysfs(tmp_path, {0: "0-3", 1: "4-7", 2: "8-11", 3: "12-15"}, "0-11", offline="12-15"))
    assert [n.id for n in t.nodes] == [0, 1, 2, 3]
    assert t.node(2).cpus == (8, 9, 10, 11)
    assert t.node(3).cpus == () and t.node(3).offline_cpus == (12, 13, 14, 15)
    assert numa.choose_node(t, 2, allowed=set(range(16))).id == 2
    with pytest.raises(InputError, match="no online CPUs"):
        numa.choose_node(t, 3, allowed=set(range(16)))
    with pytest.raises(InputError, match="does not exist.*0, 1, 2, 3"):
        numa.choose_node(t, 9, allowed=set(range(16)))
    assert t.to_dict()["nodes"][1] == [4, 5, 6, 7]


def test_no_node_directories_means_one_node(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "online").write_text("0-3\n")
    t = numa.read_topology(tmp_path)
    assert not t.from_sysfs and t.nodes[0].cpus == (0, 1, 2, 3)


def test_this_machine_topology_matches_sysfs() -> None:
    t = numa.read_topology()
    listed = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    assert len(t.nodes) == max(len(listed), 1)
    assert set().union(*(n.cpus for n in t.nodes)) <= set(t.online)


PIN_SCRIPT = """
import json, os, sys
from kvexport_intel import numa, place
topo = numa.read_topology()
node = topo.nodes[0]
done = place(node.id, True)
mode, nodes = numa.memory_policy()
print(json.dumps({"done": done, "affinity": sorted(os.sched_getaffinity(0)), "mode": mode, "nodes": nodes,
                  "tasks": {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')},
                  "node_cpus": list(node.cpus), "node": node.id}))
"""


def test_pinning_for_real_on_this_machines_node() -> None:
    """In a child process (pinning is process-wide): threads pinned to the node's CPUs, memory MPOL_BIND."""
    out = subprocess.run([sys.executable, "-c", PIN_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    expect = sorted(set(r["node_cpus"]) & set(os.sched_getaffinity(0))) or r["node_cpus"]
    assert r["affinity"] == expect
    assert all(cpus == expect for cpus in r["tasks"].values())
    assert r["mode"] == numa.MPOL_BIND and r["nodes"] == [r["node"]]
    assert r["done"]["threads"] == len(expect) and r["done"]["memory_bound"] is True


LOAD_SCRIPT = """
import json, os, sys
import kvexport
from kvexport_intel import numa
engine = kvexport.load(sys.argv[1], numa_node=0)
gen = engine.generate([5, 6, 7], max_new_tokens=4)
print(json.dumps({"numa": engine.session.describe()["numa"], "threads": engine.session.describe()["threads"],
                  "tokens": gen.token_ids, "policy": numa.memory_policy(),
                  "tasks": {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')}}))
"""


def test_engine_load_on_a_named_node_pins_openvinos_threads(intel_artifacts: dict) -> None:
    """Every thread of the process, OpenVINO's workers included, runs on node 0's CPUs after load."""
    pytest.importorskip("openvino")
    _, art = intel_artifacts["llama"]
    out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(art)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    node0 = numa.read_topology().node(0)
    expect = sorted(set(node0.cpus) & set(os.sched_getaffinity(0))) or list(node0.cpus)
    assert r["numa"]["node"] == 0 and r["numa"]["process_pinned"] and r["numa"]["memory_bound"]
    assert r["threads"] == len(expect) and r["tokens"]
    # with ENABLE_CPU_PINNING OpenVINO may bind each stream thread to one core of the node: a subset, never outside
    assert len(r["tasks"]) > 1 and all(cpus and set(cpus) <= set(expect) for cpus in r["tasks"].values()), r["tasks"]
    assert r["policy"] == [numa.MPOL_BIND, [0]]
