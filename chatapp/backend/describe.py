"""What the CPU backend will use, told without loading a model or MLX (for --show-config)."""

from __future__ import annotations


def cpu_backend_lines(cpu) -> list[str]:
    """Lines describing the BLAS, the kernels and the route rules for a ``CpuConfig``."""
    from chatapp.backend.blas import probe_blas
    from chatapp.backend.numpy_blas import numpy_blas
    from chatapp.backend.qlinear import NUMPY_MIN_ELEMENTS

    lines = [f"MLX's BLAS: {probe_blas(cpu.blas)}"]
    if cpu.kernels == "off":
        lines.append("kernels: off (cpu.kernels = off): quantised layers run MLX's quantized_matmul, "
                     "decode attention MLX's SDPA")
    else:
        from chatapp.kernels import kernel_info
        from chatapp.kernels.qmatmul import BITS, GROUP_SIZES, K_MULTIPLE

        info = kernel_info()
        if cpu.threads:
            info.threads = cpu.threads
        lines.append(info.summary())
        if info.ok:
            side = int(NUMPY_MIN_ELEMENTS**0.5)
            lines.append(
                f"route: quantised layers (affine, {'/'.join(map(str, BITS))}-bit, "
                f"group {'/'.join(map(str, GROUP_SIZES))}, "
                f"input width a multiple of {K_MULTIPLE}, at least {side}x{side}) -> kernel: packed products up to "
                f"{cpu.kernel_max_tokens} tokens, dequantise + gemm above; others -> "
                f"{'float32 copy' if cpu.dense_weights == 'on' else 'MLX'} "
                "(each layer's route and reason: --verbose, TUI notes)")
            lines.append(f"prefill gemm: {numpy_blas().describe()}")
            lines.append("decode attention: kernel (float32, float16 and quantised KV read in place)"
                         if cpu.fast_attention else "decode attention: MLX SDPA (cpu.fast_attention = false)")
            from chatapp.backend.fused_support import FUSED_MODEL_TYPES

            lines.append(f"fused decode: one native call per token for {'/'.join(FUSED_MODEL_TYPES)} models with "
                         "kernel-readable projections and a segmented cache (prealloc and every policy over it; "
                         "their flushes and evictions in place on the host buffers; every such projection then "
                         "takes the kernel)"
                         if cpu.fused_decode else "fused decode: off (cpu.fused_decode = false)")
            if cpu.fused_decode:
                from chatapp.backend.fused_settings import numerics_line

                lines.append(f"fused decode {numerics_line(cpu.numerics)} (cpu.numerics = {cpu.numerics}"
                             f"{': fast where the CPU has VNNI or AVX2' if cpu.numerics == 'auto' else ''})")
                from chatapp.backend.fused_settings import kv_dtype_line

                lines.append(f"fused decode and prefill {kv_dtype_line(cpu.kv_dtype)} (cpu.kv_dtype = {cpu.kv_dtype}"
                             f"{': float16 where the CPU has F16C' if cpu.kv_dtype == 'auto' else ''}; "
                             "other cache modes and routes read the buffers as they were written)")
    if cpu.dense_weights == "on":
        lines.append("dense_weights = on: every quantised layer keeps a float32 copy (8x the 4-bit bytes)")
    return lines
