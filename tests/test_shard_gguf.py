"""Shard workers given a `.gguf` file: a head/middle/tail route of a tiny quantized Gemma 3 GGUF (local and
global layers, K-quant and legacy blocks) is bitwise the single process serving the same file."""

import subprocess

import numpy as np

from inference_engine.config import default_cache_dir
from inference_engine.model.loader import model_fingerprint
from inference_engine.served_model import load_served_model
from inference_engine.shard.client.pipeline import ShardPipeline
from inference_engine.execution.kv_cache import CacheGeometry
from tests.family_gguf import write_family_gguf
from tests.shard_helpers import ref_block, reference, running_workers, spawn_worker

SINK, WINDOW, ROLLBACK = 2, 12, 4
# Three blocks: local (window 8), global, local; K-quants on the down projections (256 columns).
TYPES = {**{f"model.layers.{i}.mlp.down_proj.weight": kind for i, kind in enumerate(["Q4_K", "Q6_K", "Q5_K"])},
         "model.layers.0.self_attn.q_proj.weight": "Q8_0", "model.layers.1.mlp.up_proj.weight": "Q4_1",
         "model.layers.2.self_attn.v_proj.weight": "Q5_0"}


async def test_a_three_worker_route_serves_a_gguf_bitwise_as_one_process(tmp_path):
    path = tmp_path / "gemma.gguf"
    write_family_gguf("gemma3_text", path, TYPES, layers=3)
    # The default --weights of both: what one process serves for this file (its note says which weights).
    served = load_served_model(str(path), "q4_1", default_cache_dir())
    fingerprint = model_fingerprint(served.loaded.model)
    procs = [spawn_worker(f"{i}:{i + 1}", "--model", str(path), rollback=ROLLBACK, stderr=subprocess.PIPE)
             for i in range(3)]
    with running_workers(procs) as (_, addresses):
        async with ShardPipeline(addresses) as route:
            caps = route.capabilities
            assert [str(c.layers) for c in caps] == ["0:1", "1:2", "2:3"]
            assert {(c.model_name, c.model_fingerprint) for c in caps} == {("gemma.gguf", fingerprint)}
            geometry = await route.open("g", SINK, WINDOW, max_block=min(8, route.max_block))
            assert geometry == CacheGeometry(SINK, WINDOW, min(8, route.max_block), ROLLBACK)
            ref = reference(served.loaded, geometry)
            tokens = np.random.default_rng(3).integers(0, 256, 60).tolist()
            position = 0
            # A prefill past the local window, decode rows, a block over the tile, a draft of 6 keeping 2.
            for n, keep in [(10, None), (1, None), (1, None), (11, None), (6, 2), (1, None), (9, None), (1, None)]:
                block = tokens[position : position + n]
                got = await route.forward("g", block, all_logits=True)
                want = ref_block(ref, block, True, keep=keep)
                assert got.shape == want.shape and got.tobytes() == want.tobytes(), (position, n)
                if keep is not None:
                    assert await route.trim("g", n - keep) == position + keep
                position += n if keep is None else keep
            assert position > SINK + WINDOW  # the global layer's ring wrapped, the local ones slid past 8
            assert await route.layer_digests("g") == ref.executor.layer_digests()
            assert await route.release("g")
