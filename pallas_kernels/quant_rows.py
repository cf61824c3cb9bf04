"""Dynamic activation quantization of rows, in one kernel: per row (``dynamic_token``) or per
group of g columns (``dynamic_group``), into fp8 e4m3 or int8 with f32 scales -- what
jmoe.quant.activations.quantize_activations computes for those formats, the same values (it
calls this kernel on a GPU for prepare's tokens; jmoe.kernels.moe for the intermediate
between the 8-bit GEMMs).

XLA runs that function as a reduction and a separate convert, which reads the rows twice from
HBM: the requantization of qwen3-30b-a3b's intermediate between the 8-bit GEMMs at 4096 tokens
(32768 rows x 768, bf16) took 19.5 + 33.3 µs on an H100 (2026-12-07). Here a program takes
ROWS rows (any R: the last block is shifted back inside the array): per row, a first loop over
column chunks takes max |x|, a second reads the chunks again (from L2: a program's rows are a
few tens of KB) and writes the codes; per group, one loop, each chunk a group.

Pallas on the Triton lowering, as jmoe.kernels.route (``available()`` says whether it imports:
it is deprecated from jax 0.11); ``supports()`` says which shapes it takes, the callers keep
the XLA form for the rest.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jmoe.kernels import _compat
from jmoe.kernels import route as _route
from jmoe.quant.weights import QMAX, e8m0_scale

ROWS = 16        # rows per program (fewer where R is smaller)
MAX_CHUNK = 512  # columns per load of the per-row form: a [16, 512] step (32 KB of bf16)
CODE_TYPES = ("float8_e4m3fn", "int8")


def _round_half_even(v: jax.Array) -> jax.Array:
  """jnp.round's rounding (half to even) from floor, which the Triton lowering has (it has no
  rounding op; the add-and-subtract-2^23 trick is folded away by XLA's simplifier in interpret
  mode). For |v| <= 2^22: r - v is exact, so a tie is seen exactly."""
  r = jnp.floor(v + 0.5)
  odd = r - 2.0 * jnp.floor(r * 0.5) != 0.0
  return jnp.where((r - v == 0.5) & odd, r - 1.0, r)


def available() -> bool:
  """Whether the Pallas Triton lowering imports (route's kernels use the same)."""
  return _route.available()


def _chunk(width: int) -> int:
  """The per-row form's columns per load: the largest power of two dividing width, <= 512."""
  return min(width & -width, MAX_CHUNK)


def supports(rows: int, width: int, qdtype, group: int | None = None) -> bool:
  """Whether quantize_rows takes [rows, width] into qdtype (per row, or per `group` columns):
  e4m3 or int8 codes, a chunk of at least 16 columns (per row) or a power-of-two group of 16 to
  512 dividing width."""
  if jnp.dtype(qdtype).name not in CODE_TYPES or rows < 1:
    return False
  if group is None:
    return _chunk(width) >= 16
  return 16 <= group <= MAX_CHUNK and group & (group - 1) == 0 and width % group == 0


def scheme_form(quant) -> tuple[str, int | None, bool] | None:
  """A QuantConfig's activation format as quantize_rows' (qdtype, group, pow2), or None where
  its scales are not per row / per group (static, per tensor, unquantized)."""
  if quant is None or quant.act_scale not in ("dynamic_token", "dynamic_group"):
    return None
  group = quant.act_group_size if quant.act_scale == "dynamic_group" else None
  return quant.act_dtype, group, quant.scale_dtype == "float8_e8m0fnu"


def scheme_supports(rows: int, width: int, quant) -> bool:
  """Whether quantize_scheme takes [rows, width] under quant (scheme_form and supports)."""
  form = scheme_form(quant)
  return form is not None and supports(rows, width, form[0], form[1])


def quantize_scheme(x: jax.Array, quant, *, interpret: Any = False
                    ) -> tuple[jax.Array, jax.Array]:
  """quantize_rows in quant's activation format (scheme_form): x [R, W] -> (q, scale) as
  jmoe.quant.activations.quantize_activations makes them."""
  qdtype, group, pow2 = scheme_form(quant)
  return quantize_rows(x, qdtype, group=group, pow2=pow2, interpret=interpret)


def quantize_rows(x: jax.Array, qdtype, *, group: int | None = None, pow2: bool = False,
                  interpret: Any = False) -> tuple[jax.Array, jax.Array]:
  """x [R, W] (bf16 / f16 / f32) -> (q [R, W] qdtype, scale [R, 1] f32 per row, or [R, W / group]
  per group of `group` columns), scale = max |x| / qmax (1 where that is 0; pow2: the power of
  two OCP MX takes, jmoe.quant.weights.e8m0_scale), q = clip(x / scale, +-qmax) (int8: rounded
  half to even): quantize_activations' dynamic_token / dynamic_group.
  """
  r, w = x.shape
  qname = jnp.dtype(qdtype).name
  if not supports(r, w, qdtype, group):
    raise ValueError(f"quantize_rows: x {x.shape} into {qname} per "
                     f"{'row' if group is None else f'{group} columns'} is not supported "
                     "(quant_rows.supports)")
  qmax = QMAX[qname]
  is_int = qname == "int8"
  # rows per program: ROWS, or the largest power of two <= R; a last block that would pass R
  # is shifted back to end at R (its first rows are also the previous block's: both programs
  # write the same values there), so no load or store leaves the array
  rows = min(ROWS, 1 << (r.bit_length() - 1))
  n_blocks = -(-r // rows)
  c = _chunk(w) if group is None else group
  nc = w // c
  f32 = jnp.float32

  def codes(v, scale):
    v = v / scale[:, None]
    if is_int:
      v = _round_half_even(v)
    return jnp.clip(v, -qmax, qmax).astype(qdtype)

  def scale_of(amax):
    return e8m0_scale(amax, qmax) if pow2 else jnp.where(amax > 0.0, amax / qmax, 1.0)

  def cols(i):
    return pl.ds(pl.multiple_of(i * c, c), c)

  def body(x_ref, q_ref, s_ref):
    blk = pl.ds(jnp.minimum(pl.program_id(0) * rows, r - rows), rows)
    if group is None:
      def amax_step(i, m):
        return jnp.maximum(m, jnp.max(jnp.abs(x_ref[blk, cols(i)].astype(f32)), axis=1))

      scale = scale_of(lax.fori_loop(0, nc, amax_step, jnp.zeros((rows,), f32)))

      def code_step(i, carry):
        q_ref[blk, cols(i)] = codes(x_ref[blk, cols(i)].astype(f32), scale)
        return carry

      lax.fori_loop(0, nc, code_step, 0)
      s_ref[blk, :] = scale[:, None]
    else:
      def group_step(i, carry):
        v = x_ref[blk, cols(i)].astype(f32)
        scale = scale_of(jnp.max(jnp.abs(v), axis=1))
        q_ref[blk, cols(i)] = codes(v, scale)
        s_ref[blk, pl.ds(i, 1)] = scale[:, None]
        return carry

      lax.fori_loop(0, nc, group_step, 0)

  ns = 1 if group is None else nc
  from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  call = pl.pallas_call(
      body,
      out_shape=(_compat.out_struct((r, w), qdtype, x), _compat.out_struct((r, ns), f32, x)),
      grid=(n_blocks,),
      in_specs=[any_spec],
      out_specs=(any_spec, any_spec),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
      interpret=bool(interpret),
      name="jmoe_quant_rows" if group is None else "jmoe_quant_groups",
  )
  return call(x)
