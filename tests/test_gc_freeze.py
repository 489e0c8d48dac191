"""Start-up objects leave the collector's sight; garbage made later is still collected."""

import subprocess
import sys

CHECK = """
import gc, weakref
from inference_engine.gc_freeze import freeze_startup_objects
kept = [[i] for i in range(50_000)]  # what start-up leaves alive
count = freeze_startup_objects()
assert count >= 50_000 and gc.get_freeze_count() == count, count
assert len(gc.get_objects(generation=2)) < 1_000, len(gc.get_objects(generation=2))  # a full pass walks ~nothing


class Node:
    pass


a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made after start-up: only the collector frees it
gone = weakref.ref(a)
del a, b
gc.collect()
assert gone() is None
print("ok")
"""


def test_freeze_keeps_start_up_objects_out_of_full_collections():
    run = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
