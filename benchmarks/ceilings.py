"""The device's two ceilings, measured: a large bf16 matrix product's FLOP/s and a
device-to-device copy's bandwidth (bytes read plus bytes written).

MFU and the modeled step time divide by datasheet peaks; these say what the card
in hand actually reaches, so a figure can be read against both. Random data
(a product of zeros runs faster than real data), medians of several timed calls
after a warm-up, each call a chain of products or copies inside one program so
that dispatch stays out of the time.

    python -m benchmarks.ceilings [--size 8192] [--copy-gib 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from benchmarks.measure import peak_flops
from benchmarks.report import environment

CHAIN = 10  # products or copies per timed call


def _median_seconds(fn: Callable[[jax.Array], jax.Array], x: jax.Array, calls: int) -> float:
    jax.block_until_ready(fn(x))  # compile and warm up
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / CHAIN


def matmul_flops(n: int, calls: int = 10) -> float:
    """FLOP/s of an ``n x n x n`` bf16 product with float32 accumulation, on random data."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16) / jnp.sqrt(n).astype(jnp.bfloat16)
    chain = jax.jit(lambda x: jax.lax.fori_loop(0, CHAIN, lambda _, y: y @ b, x))
    return 2 * n ** 3 / _median_seconds(chain, a, calls)


def narrow_product(n: int, dtype: str) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """A random ``n x n`` operand of ``dtype`` ("int8" or "fp8", E4M3) and the product that
    multiplies it by a fixed random matrix (int8: int32 accumulation; FP8: a bf16 result) and
    narrows the result back to ``dtype``, spread like the operand, so that a chain of them
    never meets zeros (which run faster than data)."""
    key_a, key_b = jax.random.key(3), jax.random.key(4)
    if dtype == "int8":
        a = jax.random.randint(key_a, (n, n), -127, 128, jnp.int32).astype(jnp.int8)
        b = jax.random.randint(key_b, (n, n), -127, 128, jnp.int32).astype(jnp.int8)
        # Entries of a @ b spread about 73^2 sqrt(n) (uniform int8 entries spread about 73): shifted
        # to spread about 64 again.
        shift = max(1, round(math.log2(73 * 73 * math.sqrt(n) / 64)))

        def product(x):
            y = jax.lax.dot(x, b, preferred_element_type=jnp.int32)
            return jnp.clip(jax.lax.shift_right_arithmetic(y, shift), -127, 127).astype(jnp.int8)
        return a, product
    a = jax.random.normal(key_a, (n, n), jnp.float32).astype(jnp.float8_e4m3fn)
    b = (jax.random.normal(key_b, (n, n), jnp.float32) / jnp.sqrt(n)).astype(jnp.float8_e4m3fn)
    return a, lambda x: jax.lax.dot(x, b, preferred_element_type=jnp.bfloat16).astype(jnp.float8_e4m3fn)


def narrow_matmul_ops(n: int, dtype: str, calls: int = 10) -> float:
    """Operations per second of a chain of :func:`narrow_product` (the narrowing pass is in the
    time: a train step's int8 and FP8 GEMMs pay a like one to quantize)."""
    a, product = narrow_product(n, dtype)
    chain = jax.jit(lambda x: jax.lax.fori_loop(0, CHAIN, lambda _, y: product(y), x))
    return 2 * n ** 3 / _median_seconds(chain, a, calls)


def copy_bandwidth(gib: float, calls: int = 10) -> float:
    """Bytes per second read plus written by an elementwise pass over ``gib`` GiB of float32."""
    n = int(gib * 2 ** 30) // 4
    x = jax.random.normal(jax.random.key(2), (n,), jnp.float32)
    chain = jax.jit(lambda v: jax.lax.fori_loop(0, CHAIN, lambda _, y: y * 1.0001, v))
    return 2 * 4 * n / _median_seconds(chain, x, calls)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ceilings", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=8192, help="the matrices' side (default 8192)")
    p.add_argument("--copy-gib", type=float, default=2.0, help="the copied array's size in GiB (default 2)")
    p.add_argument("--narrow", nargs="*", default=[], choices=("int8", "fp8"),
                   help="also time int8 and/or FP8 products of the same size")
    p.add_argument("--out", help="write ceilings.json there")
    args = p.parse_args(argv)
    device = jax.devices()[0]
    flops, bandwidth = matmul_flops(args.size), copy_bandwidth(args.copy_gib)
    narrow = {d: narrow_matmul_ops(args.size, d) for d in args.narrow}
    peak = peak_flops(device, "half")
    result = {"environment": environment(), "matmul": {"n": args.size, "flops_per_second": flops,
                                                       "datasheet_dense_bf16": peak},
              "narrow_matmul": {d: {"n": args.size, "ops_per_second": v, "vs_bf16": v / flops}
                                for d, v in narrow.items()},
              "copy": {"gib": args.copy_gib, "bytes_per_second": bandwidth}}
    share = f" ({100 * flops / peak:.0f}% of the datasheet's {peak / 1e12:.0f})" if peak else ""
    print(f"{device.device_kind}: bf16 {args.size}^3 product {flops / 1e12:.1f} TFLOP/s{share}; "
          f"copy {bandwidth / 1e12:.2f} TB/s (read + written)")
    for d, v in narrow.items():
        print(f"{device.device_kind}: {d} {args.size}^3 product, narrowed back each time: {v / 1e12:.1f} "
              f"TOP/s, {v / flops:.2f}x bf16")
    if args.out:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(args.out) / "ceilings.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
