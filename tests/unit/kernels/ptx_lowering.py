"""Run as a script (a process without TRITON_INTERPRET, so the kernels import as compiled JIT functions): lowers
every Triton kernel of megatron_vlm.kernels.triton for an sm90 target to PTX and prints one line per specialisation,
"ok <module>.<kernel>"; exits 3 when this Triton has no compiler API this script knows, 4 on a kernel it has no
specialisation for (a new kernel: add it to _CONSTS). Used by test_triton_ptx.py."""
from __future__ import annotations

import sys


def lower(kernel, signature: dict, constexprs: dict) -> str:
    import triton._C.libtriton as lt
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    names = kernel.arg_names
    src = ASTSource(fn=kernel, signature={n: ("constexpr" if n in constexprs else signature.get(n, "i32")) for n in names},
                    constexprs={(names.index(n),): v for n, v in constexprs.items() if n in names})
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    opts = backend.parse_options({})
    ctx = lt.ir.context()
    lt.ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    module = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), ctx)
    stages: dict = {}
    backend.add_stages(stages, opts, src.language)
    meta: dict = {}
    for name in ("ttir", "ttgir", "llir", "ptx"):
        module = stages[name](module, meta)
    return module


# the kernels' pointer arguments by name, and their element types (everything else: an int32 scalar)
_INDEX = {"CU_Q", "CU_K", "SEQLENS", "TABLE", "PREFIX_ROWS", "PREFIX_LENS", "ROW_MAP", "TILE_EXPERT", "TILE_ROW",
          "GROUP_START", "GROUP_END", "LABELS", "I0", "I1"}
_FP32 = {"LSE", "DELTA", "MEAN", "RSTD", "MID_O", "MID_LSE", "DW_PARTIAL", "DB_PARTIAL", "LOGP", "ENT", "GLOGP", "GENT",
         "WEIGHTS", "DWEIGHTS", "COS", "SIN", "LOGITS", "DZ", "PARAM", "GRAD"}
_BF16 = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "X", "W", "B", "Y", "R", "S", "G", "U", "DY", "DX", "DG", "DU",
         "DS_IN", "P", "DP", "OUT", "DOUT", "DB", "KC", "VC", "EXP_AVG", "EXP_AVG_SQ"}
_SCALAR_DIMS = {"moe": {"N", "K", "H"}}  # single letters that are sizes there, not tensors
_FLOATS = {"eps", "qk_scale", "sm_scale", "inv_temp", "scale_log2", "decay", "step_size", "beta1", "beta2",
           "inv_sqrt_bc2"}
# one specialisation per kernel (the shapes of the 3B decode / SFT step), plus the flags worth compiling both ways
_CONSTS = {
    "_adamw_bf16_moments_kernel": dict(BLOCK=1024),
    "_attention_fwd_kernel": dict(GROUP=8, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, HAS_KPM=False,
                                  DOT_PRECISION="default", UPCAST_DOT=False),
    "_attention_bwd_kernel": dict(GROUP=8, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, HAS_KPM=False,
                                  DOT_PRECISION="default", UPCAST_DOT=False),
    "_attention_bwd_dq_kernel": dict(GROUP=8, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, HAS_KPM=False,
                                     DOT_PRECISION="default", UPCAST_DOT=False),
    "_decode_attention_split_kernel": dict(GROUP=8, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64, ONE_SPLIT=False,
                                           IEEE=False, SHARED=True),
    "_decode_attention_merge_kernel": dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=16),
    "_kv_write_kernel": dict(HEAD_DIM=128, BLOCK_H=2, BLOCK_D=128),
    "_layer_norm_fwd_kernel": dict(BLOCK=2048, HAS_BIAS=True, HAS_WEIGHT=True),
    "_layer_norm_bwd_kernel": dict(BLOCK=2048, HAS_WEIGHT=True),
    "_grouped_mm_fwd_kernel": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, INPUT_PRECISION=None),
    "_grouped_mm_dw_kernel": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, INPUT_PRECISION=None),
    "_moe_unpermute_fwd_kernel": dict(BLOCK_H=2048, HAS_WEIGHTS=True, TOPK=8),
    "_moe_unpermute_bwd_kernel": dict(BLOCK_H=2048, HAS_WEIGHTS=True, NEED_DWEIGHTS=True, TOPK=8),
    "_rms_norm_fwd_kernel": dict(BLOCK=2048, HAS_RESIDUAL=True),
    "_rms_norm_bwd_kernel": dict(BLOCK=2048, HAS_DS_IN=True),
    "_rotary_fwd_kernel": dict(HEAD_DIM=128, ROT_DIM=128, BLOCK_H=8, BLOCK_D=128, INTERLEAVED=False),
    "_rotary_bwd_kernel": dict(HEAD_DIM=128, ROT_DIM=128, BLOCK_H=8, BLOCK_D=128, INTERLEAVED=False),
    "_swiglu_fwd_kernel": dict(BLOCK=1024),
    "_swiglu_bwd_kernel": dict(BLOCK=1024),
    "_token_logprobs_fwd_kernel": dict(BLOCK_V=4096, WITH_ENTROPY=True),
    "_token_logprobs_bwd_kernel": dict(BLOCK_V=4096, WITH_ENTROPY=True),
}
_ALSO = {"_decode_attention_split_kernel": [dict(ONE_SPLIT=True, SHARED=False), dict(IEEE=True)],
         "_attention_fwd_kernel": [dict(HAS_KPM=True), dict(DOT_PRECISION="ieee", UPCAST_DOT=True)]}
MODULES = ("adamw", "attention", "decode_attention", "kv_cache_write", "layer_norm", "moe", "rms_norm", "rotary", "swiglu",
           "token_logprobs")


def _signature(module: str, kernel) -> dict:
    sig = {}
    for p in kernel.params:
        n = p.name
        if p.is_constexpr:
            continue
        if n in _FLOATS:
            sig[n] = "fp32"
        elif n in _SCALAR_DIMS.get(module, ()) or not (n in _INDEX or n in _FP32 or n in _BF16 or n == "KPM"):
            sig[n] = "i32"
        elif n == "KPM":
            sig[n] = "*i8"
        else:
            sig[n] = "*i32" if n in _INDEX else "*fp32" if n in _FP32 else "*bf16"
    return sig


def main() -> None:
    try:
        import triton._C.libtriton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
        from triton.compiler.compiler import make_backend  # noqa: F401
        from triton.runtime.jit import JITFunction
    except ImportError as e:
        print(f"no compiler API: {e}")
        sys.exit(3)
    import importlib

    for module in MODULES:
        mod = importlib.import_module(f"megatron_vlm.kernels.triton.{module}")
        for name, kernel in sorted(vars(mod).items()):
            if not (isinstance(kernel, JITFunction) and name.startswith("_") and name.endswith("_kernel")):
                continue
            if name not in _CONSTS:
                print(f"unknown kernel {module}.{name}: add its specialisation to _CONSTS")
                sys.exit(4)
            for extra in [{}] + _ALSO.get(name, []):
                consts = {**_CONSTS[name], **extra}
                assert ".entry" in lower(kernel, _signature(module, kernel), consts)
                print(f"ok {module}.{name} {extra or ''}".rstrip())


if __name__ == "__main__":
    main()
