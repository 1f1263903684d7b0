"""Run as a script (a process without TRITON_INTERPRET, so the kernels import as compiled JIT functions): lowers
the named Triton kernels for an sm90 target to PTX and prints one line per kernel variant, "ok <name>", or exits 3
when this Triton has no compiler API this script knows. Used by test_triton_ptx.py."""
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


def main() -> None:
    try:
        import triton._C.libtriton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
        from triton.compiler.compiler import make_backend  # noqa: F401
    except ImportError as e:
        print(f"no compiler API: {e}")
        sys.exit(3)
    from megatron_vlm.kernels.triton import decode_attention as DA
    from megatron_vlm.kernels.triton import kv_cache_write as KW
    from megatron_vlm.kernels.triton import rotary as RO

    bf16 = "*bf16"
    split = {"Q": bf16, "K": bf16, "V": bf16, "O": bf16, "MID_O": "*fp32", "MID_LSE": "*fp32", "SEQLENS": "*i32",
             "TABLE": "*i32", "PREFIX_ROWS": "*i32", "PREFIX_LENS": "*i32", "scale_log2": "fp32"}
    for shared in (False, True):
        for one in (False, True):
            ptx = lower(DA._decode_attention_split_kernel, split, dict(
                GROUP=8, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64, ONE_SPLIT=one, IEEE=False, SHARED=shared))
            assert ".entry" in ptx
            print(f"ok decode_attention_split shared={shared} one_split={one}")
    merge = {"O": bf16, "MID_O": "*fp32", "MID_LSE": "*fp32"}
    assert ".entry" in lower(DA._decode_attention_merge_kernel, merge, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=16))
    print("ok decode_attention_merge")
    kv = {"K": bf16, "V": bf16, "KC": bf16, "VC": bf16, "I0": "*i64", "I1": "*i64"}
    kv.update({n: "i64" for n in KW._kv_write_kernel.arg_names if n.startswith("s")})
    assert ".entry" in lower(KW._kv_write_kernel, kv, dict(HEAD_DIM=128, BLOCK_H=2, BLOCK_D=128))
    print("ok kv_cache_write")
    rot = {"X": bf16, "COS": "*fp32", "SIN": "*fp32", "Y": bf16}
    assert ".entry" in lower(RO._rotary_fwd_kernel, rot, dict(HEAD_DIM=128, ROT_DIM=128, BLOCK_H=8, BLOCK_D=128,
                                                                 INTERLEAVED=False))
    print("ok rotary")


if __name__ == "__main__":
    main()
