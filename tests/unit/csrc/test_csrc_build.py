"""The extension builds from CMakeLists.txt with its CUDA sources disabled (into a temporary folder,
loaded in a fresh process), and the package runs in pure Python without it (one warning)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

_USE_BUILT = r"""
import importlib.util, json, sys, glob
import numpy as np, torch
so = glob.glob(sys.argv[1] + "/megatron_vlm/_C*.so")[0]
spec = importlib.util.spec_from_file_location("megatron_vlm._C", so)
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
sys.modules["megatron_vlm._C"] = mod
from megatron_vlm import _ext
from megatron_vlm.data.packing import first_fit_pack
from megatron_vlm.kernels.csrc import moe as csrc_moe
from megatron_vlm.kernels.reference.moe import moe_permute
assert _ext.load() is mod, _ext.unavailable_reason()
rng = np.random.default_rng(0)
lengths, order = rng.integers(1, 100, 500), rng.permutation(500)
got = _ext.first_fit_pack(lengths, order, 128)
with _ext.python_only():
    want = first_fit_pack(lengths, order, 128)
ids = torch.randint(0, 8, (64, 2))
same = all(torch.equal(a, b) for a, b in zip(csrc_moe.moe_permute(torch.randn(64, 3).abs() * 0 + 1, ids, num_experts=8),
                                               moe_permute(torch.ones(64, 3), ids, num_experts=8)))
print(json.dumps({"with_cuda": mod.with_cuda, "pack_equal": got == want, "permute_equal": same}))
"""


@pytest.mark.slow
@pytest.mark.heavy
def test_build_without_cuda_sources(tmp_path):
    env = dict(os.environ, MEGATRON_VLM_NO_CUDA="1", MEGATRON_VLM_REQUIRE_EXT="1",
               MEGATRON_VLM_BUILD_DIR=str(tmp_path / "cmake"))
    env.pop("MEGATRON_VLM_NO_EXT", None)
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                            "--build-temp", str(tmp_path / "temp")],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    cache = (tmp_path / "cmake" / "CMakeCache.txt").read_text()
    assert "MEGATRON_VLM_WITH_CUDA:BOOL=OFF" in cache
    run = subprocess.run([sys.executable, "-c", _USE_BUILT, str(tmp_path / "lib")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"with_cuda": 0, "pack_equal": True,
                                                                "permute_equal": True}


_FALLBACK = r"""
import json, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import numpy as np, torch
    from megatron_vlm import kernels, _ext
    from megatron_vlm.data.packing import first_fit_pack
    from megatron_vlm.models.common.mrope_index import get_mrope_position_ids
    packs = first_fit_pack(np.array([3, 5, 2, 7]), np.arange(4), 8)
    pos, _ = get_mrope_position_ids(torch.tensor([[1, 2, 3]]), image_token_id=9, video_token_id=10,
                                    spatial_merge_size=2, tokens_per_second=2.0)
    _, w, ids = kernels.moe_topk_gating(torch.randn(4, 8), 2)
    _, row_map, counts = kernels.moe_permute(torch.randn(4, 3), ids, num_experts=8)
    chosen = [kernels.DEFAULT_REGISTRY.choose(op, "cpu", torch.float32) for op in ("moe_permute", "moe_topk_gating")]
ours = [str(w.message) for w in caught if "megatron_vlm._C" in str(w.message)]
print(json.dumps({"packs": [[int(i) for i in p] for p in packs], "pos": pos[0, 0].tolist(), "warnings": ours, "chosen": chosen,
                  "counts": int(counts.sum())}))
"""


def test_pure_python_fallback_without_extension():
    env = dict(os.environ, MEGATRON_VLM_NO_EXT="1")
    run = subprocess.run([sys.executable, "-c", _FALLBACK], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["packs"] == [[0, 1], [2], [3]] and out["pos"] == [0, 1, 2] and out["counts"] == 8
    assert out["chosen"] == ["torch", "torch"]
    assert len(out["warnings"]) == 1 and "MEGATRON_VLM_NO_EXT" in out["warnings"][0], out["warnings"]
