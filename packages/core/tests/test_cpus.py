"""Whole-process pinning: every thread a process already has, and whatever it starts later,
ends up on the given cores. Pinning runs in a child process so this one keeps its cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from offbeat.core.cpus import machine_cpus, pin_process, share_of

CHILD = """
import json, os, subprocess, sys, threading, time
from offbeat.core.cpus import machine_cpus, pin_process, process_tree_cpus, thread_cpus

stop = threading.Event()
before = threading.Thread(target=stop.wait)  # a thread that exists before pinning
before.start()
cores = machine_cpus()
pin_process([int(sys.argv[1])])
after = threading.Thread(target=stop.wait)  # and one started afterwards
after.start()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
time.sleep(0.2)
tree = process_tree_cpus(os.getpid())
print(json.dumps({
    "threads": sorted(sorted(c) for c in thread_cpus(os.getpid()).values()),
    "tree": {str(pid): [name, sorted(c)] for pid, (name, c) in tree.items()},
    "child": child.pid,
    "machine": machine_cpus(),
    "cores_before": cores,
}))
child.kill()
stop.set()
"""


def test_pin_process_confines_existing_threads_and_new_children():
    core = max(os.sched_getaffinity(0))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(core)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    got = json.loads(out.stdout)
    assert len(got["threads"]) >= 3  # main, the thread from before, the one from after
    assert all(cpus == [core] for cpus in got["threads"])
    assert str(got["child"]) in got["tree"]
    assert all(cpus == [core] for _name, cpus in got["tree"].values())
    # What the machine offers is still known after pinning (configs validate against it).
    assert got["machine"] == got["cores_before"]


def test_pin_process_refuses_cores_this_machine_lacks():
    with pytest.raises(ValueError, match=r"cores \[4096\] are not usable"):
        pin_process([4096])
    with pytest.raises(ValueError, match="no cores"):
        pin_process([])
    assert set(machine_cpus()) == os.sched_getaffinity(0)  # nothing was pinned


@pytest.mark.parametrize(
    "cpus, parts, expected",
    [
        ([0, 1], 1, [[0, 1]]),
        ([0, 1], 2, [[0], [1]]),
        ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),
        ([4, 5, 6, 7], 4, [[4], [5], [6], [7]]),
        ([0], 2, [[0], [0]]),  # fewer cores than parts: they share
    ],
)
def test_share_of_splits_contiguously(cpus, parts, expected):
    assert [share_of(cpus, parts, i) for i in range(parts)] == expected


def test_share_of_rejects_a_bad_index():
    with pytest.raises(ValueError):
        share_of([0, 1], 2, 2)
