"""The one place where jax version differences of Pallas Mosaic GPU are handled.

Supported: jax 0.10.x (CPU CI, GPU interpret mode) and 0.11.x (the H200 machine).

What differs, and how it is handled here:
- ``plgpu.kernel``: the output type keyword is ``out_type`` in 0.10.2 and 0.11.x; very old versions
  only know ``out_shape``. ``kernel()`` below passes whichever the installed version takes.
- Lowering semantics: 0.10 defaults to ``LoweringSemantics.Lane``, 0.11 to ``Warpgroup``. Every
  kernel here is written for ``Warpgroup`` semantics and asks for it explicitly through
  ``compiler_params()`` so both versions lower the same program.
- GPU interpret mode (run Mosaic GPU kernels on CPU): ``InterpretGPUParams`` is private
  (``jax._src.pallas.mosaic_gpu.interpret``). ``interpret_params()`` imports it and raises
  ``InterpretUnavailable`` (a RuntimeError with a clear message) if it moved; tests turn that into a
  skip.
- ``pl.pallas_call(..., compiler_params=plgpu.CompilerParams())`` does not lower on 0.11.2, so
  nothing here uses it: all kernels are ``plgpu.kernel``.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


class InterpretUnavailable(RuntimeError):
  """GPU interpret mode (private jax API) is not importable in this jax version."""


def _kernel_out_kw() -> str:
  try:
    params = inspect.signature(plgpu.kernel).parameters
  except (TypeError, ValueError):  # pragma: no cover
    return "out_type"
  return "out_type" if "out_type" in params else "out_shape"


_OUT_KW = _kernel_out_kw()


def _mesh_has_kernel_name() -> bool:
  try:
    import dataclasses as _dc
    return "kernel_name" in {f.name for f in _dc.fields(plgpu.Mesh)}
  except Exception:  # pragma: no cover
    return False


_HAS_KERNEL_NAME = _mesh_has_kernel_name()


def kernel(body, *, out_type, scratch_types=None, interpret: Any = None, name: str | None = None,
           **kw):
  """``plgpu.kernel`` with the version's spelling of the output-type keyword (and the kernel
  name where the version supports naming it)."""
  kwargs = dict(kw)
  if name is not None and _HAS_KERNEL_NAME:
    kwargs["kernel_name"] = name
  kwargs[_OUT_KW] = out_type
  if scratch_types is not None:
    kwargs["scratch_types" if "scratch_types" in inspect.signature(plgpu.kernel).parameters
           else "scratch_shapes"] = scratch_types
  if interpret is not None and interpret is not False:
    kwargs["interpret"] = interpret
  return plgpu.kernel(body, **kwargs)


def compiler_params(**kw) -> plgpu.CompilerParams:
  """CompilerParams with Warpgroup lowering semantics (0.11's default, not 0.10's)."""
  kw.setdefault("lowering_semantics", plgpu.LoweringSemantics.Warpgroup)
  return plgpu.CompilerParams(**kw)


def _manual_axis_type(like):
  try:
    return getattr(jax.typeof(like), "mat", None)
  except Exception:  # pragma: no cover (not a jax value)
    return None


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
  """A ``pl.pallas_call`` output type that varies over shard_map's manual axes as `like` does
  (``shard_map(check_vma=True)`` requires it; outside shard_map the type is empty)."""
  mat = _manual_axis_type(like)
  if mat is not None:
    try:
      return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
    except TypeError:  # a jax without the keyword
      pass
  return jax.ShapeDtypeStruct(shape, dtype)


def varying_axes(x) -> frozenset:
  """The shard_map manual axes `x` varies over (empty outside shard_map)."""
  mat = _manual_axis_type(x)
  return frozenset(getattr(mat, "varying", ()) or ())


# ----------------------------------------------------------------------------- interpret mode

def _interpret_module():
  try:
    from jax._src.pallas.mosaic_gpu.interpret import params as p  # type: ignore
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb  # type: ignore
  except Exception as e:  # ImportError, AttributeError, ...
    raise InterpretUnavailable(
        f"Mosaic GPU interpret mode is unavailable in jax {jax.__version__}: the private module "
        f"jax._src.pallas.mosaic_gpu.interpret moved or changed ({type(e).__name__}: {e}). "
        "Update pallas_kernels/_compat.py.") from e
  if not hasattr(p, "InterpretGPUParams"):
    raise InterpretUnavailable(
        f"jax {jax.__version__}: InterpretGPUParams not found in "
        "jax._src.pallas.mosaic_gpu.interpret.params; update pallas_kernels/_compat.py.")
  return p, cb


def interpret_available() -> bool:
  try:
    _interpret_module()
    return True
  except InterpretUnavailable:
    return False


def interpret_params(detect_races: bool = True, **kw):
  """An ``InterpretGPUParams`` for running kernels on CPU.

  Out-of-bounds reads return the uninitialized value (NaN) instead of raising: on the GPU the TMA
  unit fills them (zeros); the kernels here only read out of bounds along the row/column
  dimensions of tiles whose extra rows/columns are never stored, so NaN there is harmless and a NaN
  that leaks into a stored element fails the tests.
  """
  p, _ = _interpret_module()
  kw.setdefault("out_of_bounds_reads", "uninitialized")
  return p.InterpretGPUParams(detect_races=detect_races, **kw)


def code_transforms(k: int, bits: int, step: int = 128) -> tuple:
  """The SMEM transforms of a [rows, step] tile of `bits`-bit weight codes from a K-long
  contraction: the widest swizzle whose tile width divides K (TMA's tiled source must be whole
  tiles: gpt-oss' 2880 takes 64-code tiles)."""
  width = step if k % step == 0 else 64
  swz = plgpu.find_swizzle(width * bits)
  return plgpu.TilingTransform((8, swz * 8 // bits)), plgpu.SwizzleTransform(swz)


def zero_filled(params):
  """params reading zeros past an array, as TMA does, for a kernel whose tiles reach past its
  operands' ends on purpose (sizes its tiles do not divide); its scratch then starts zeroed
  too, not poisoned."""
  return dataclasses.replace(params, uninitialized_memory="zero")


def races_found() -> bool:
  """Whether the race detector of the last interpreted kernel(s) found a race."""
  _, cb = _interpret_module()
  try:
    races = cb.get_races()
  except AssertionError:
    return False
  return bool(getattr(races, "races_found", False))


def reset_interpret_state() -> None:
  """Must be called after an exception inside an interpreted kernel."""
  _, cb = _interpret_module()
  cb.reset_gpu_interpret_mode_state()


def num_sms(default: int = 132) -> int:
  """Number of SMs of the default device (132 on H100/H200 SXM)."""
  try:
    mesh = jax.sharding.get_abstract_mesh()
    ad = getattr(mesh, "abstract_device", None)
    if ad is not None and getattr(ad, "num_cores", None):
      return int(ad.num_cores)
  except Exception:
    pass
  try:
    dev = jax.devices()[0]
    if dev.platform == "gpu":
      return int(dev.core_count)
  except Exception:
    pass
  return default


def device_kind() -> str:
  try:
    return jax.devices()[0].device_kind
  except Exception:  # pragma: no cover
    return "unknown"


def launch_params(interpret: Any) -> tuple[Any, int]:
  """(interpret params or None, persistent grid size) for a kernel launch.

  `interpret`: False (real GPU: one CTA per SM), True (default GPU interpret params) or an
  InterpretGPUParams. Interpret mode simulates a single block.
  """
  if not interpret:
    return None, num_sms()
  return (interpret if not isinstance(interpret, bool) else interpret_params()), 1


def smem_transforms(minor: int, itemsize: int) -> tuple:
  """The (tiling, swizzle) transforms of an SMEM tile whose minor dimension holds `minor`
  elements of `itemsize` bytes: the widest swizzle that row fits, tiles of 8 rows."""
  swizzle = plgpu.find_swizzle(minor * itemsize * 8)
  return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def check_union_aliases(*members) -> None:
  """Raise unless each ref -- the members of one `plgpu.RefUnion`, as the kernel body receives
  them -- starts at the union's first byte. Mosaic GPU lays every alias group out from offset 0
  (jax 0.10 / 0.11) but does not promise it; the kernels that view one buffer in two shapes
  (decode_wq's wide slots) rely on it, so a jax that moved a member fails at trace time."""
  for ref in members:
    transforms = getattr(ref, "transforms", ())
    offset = getattr(transforms[0], "offset", None) if transforms else None
    if offset != 0:
      raise NotImplementedError(
          f"a RefUnion member starts at byte {offset}, not 0, in this jax "
          f"({jax.__version__}): the two views of one ring would not alias")


def layout_cast(interpret: Any):
  """plgpu.layout_cast, or the identity in interpret mode (which has no rule for it and no
  layouts to cast)."""
  return (lambda x, _layout: x) if interpret else plgpu.layout_cast
