"""Splash attention: the Pallas TPU flash-attention kernel, with segment ids, for the BERT encoder.

``model.attention_impl="splash"`` routes self-attention through
``jax.experimental.pallas.ops.tpu.splash_attention``: a full (non-causal) mask per head, and the
[batch, seq] *segment ids* in place of the additive bias. Tokens attend only to tokens with the same
id, so padding is id 0, a plain sequence is id 1, and packed sequences are ids 1..n.

Numerics and behaviour (jax 0.10.2 kernel, read from its source):

* The kernel computes ``q @ k.T`` without scaling, so ``1/sqrt(head_dim)`` is applied to ``q`` first
  (in the compute dtype, exactly as the ``xla`` path does). Logits, softmax statistics and the
  ``p @ v`` accumulation are float32 inside the kernel; the output has the dtype of ``q``.
* Padding rows are never fully masked: a padding query (id 0) attends to the padding keys (id 0),
  never to real tokens, and real queries never see padding keys. Outputs at padding positions
  therefore differ from the ``xla`` path (where a padding query attends to the real tokens) but are
  finite, and they never reach a real position or a loss. (A row with *no* allowed key, impossible
  for self-attention with shared ids, gets the mean of ``v`` over all keys and finite but
  meaningless ``dq``/``dk``: the kernel's running max starts at its mask value, so ``exp(0) = 1``
  everywhere.)
* Sequence length must be a multiple of 128 (the TPU lane width: the kernel tiles segment ids and
  key blocks in 128-lane chunks and needs block sizes that divide the sequence). Blocks are the
  largest of 512/256/128 dividing the sequence; anything else is a clear error.
* No attention dropout: like ``dot_product``, the model falls back to the explicit einsum path when
  ``attention_dropout > 0`` in training, so on TPU use ``attention_dropout=0`` to get the kernel.
* The kernel is a Mosaic TPU kernel. On any other backend it raises unless interpret mode is asked
  for, with ``interpret=True`` or the environment variable ``BERTJAX_SPLASH_INTERPRET=1`` (the
  Pallas interpreter: same numerics, orders of magnitude slower; for tests and debugging, never
  silently).
* Under a mesh (``jax.set_mesh``) the kernel runs inside ``jax.shard_map``: batch split as the
  logical rule ``batch`` says (data+fsdp), heads as ``act_heads`` says (tensor); the sequence and
  head_dim are never split (a mesh axis that does not divide its dimension is dropped: that shard is
  then computed redundantly). Without a mesh, on one device, or with no logical rules in scope, the
  kernel is called directly, and on a multi-device mesh XLA then has to gather its operands.
"""

from __future__ import annotations

import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from bertjax.layers.splash_cost import kernel_costs, priced
from bertjax.sharding import fit_spec

Array = jax.Array

INTERPRET_ENV = "BERTJAX_SPLASH_INTERPRET"
LANES = 128  # TPU lane width: the kernel's smallest key/query block
_BLOCKS = (512, 256, 128)  # tried largest first
# Logical axis names of q/k/v/ctx (the same as modeling.BATCH_LENGTH_HEADS_KV).
LOGICAL_AXES = ("batch", "length", "act_heads", "kv")


def segment_ids_from_mask(input_mask: Array, pack_ids: Array | None = None) -> Array:
    """Segment ids [batch, seq] int32 for the kernel: 0 at padding, else 1 (or the pack id).

    ``input_mask`` [batch, seq] is 1 at real tokens and 0 at padding. With ``pack_ids``
    [batch, seq] (packed rows: 1..n per sequence, 0 = padding) those are the ids and
    ``input_mask`` is not read, as in ``modeling.attention_bias``. A 3-D [batch, q, k] mask
    cannot be expressed as segment ids and is an error. (Not BERT's token-type "segment_ids".)
    """
    if pack_ids is not None:
        return pack_ids.astype(jnp.int32)
    if input_mask.ndim != 2:
        raise ValueError(
            f"attention_impl='splash' needs a [batch, seq] attention mask (segment ids), got shape "
            f"{input_mask.shape}; use attention_impl='xla' for a [batch, q, k] mask"
        )
    return (input_mask > 0).astype(jnp.int32)


def block_size(seq_len: int) -> int:
    """The kernel's query/key block for a sequence: the largest of 512/256/128 that divides it."""
    for block in _BLOCKS:
        if seq_len % block == 0:
            return block
    raise ValueError(
        f"attention_impl='splash' needs a sequence length that is a multiple of {LANES} (the TPU "
        f"lane width the kernel tiles keys and segment ids by), got {seq_len}; pad the batch to "
        f"a multiple of {LANES} or use attention_impl='xla'/'dot_product'"
    )


def resolve_interpret(interpret: bool | None, platform: str | None = None) -> bool:
    """Whether to run the kernel in the Pallas interpreter: as asked, else only when the environment
    asks for it (``BERTJAX_SPLASH_INTERPRET=1``); a non-TPU backend without either is an error.

    ``platform`` is that of the devices the step runs on (the mesh in scope: compile-only TPU
    devices of ``bertjax compile --topology`` on a CPU host), else JAX's default backend."""
    if interpret is not None:
        return interpret
    if os.environ.get(INTERPRET_ENV, "0") not in ("", "0"):
        return True
    backend = platform or jax.default_backend()
    if backend != "tpu":
        raise RuntimeError(
            f"attention_impl='splash' needs a TPU (JAX backend is {backend!r}; the kernel is a "
            f"Mosaic TPU kernel): use 'dot_product' or 'cudnn' on GPU, 'xla' on CPU, or set "
            f"{INTERPRET_ENV}=1 to run it in the (slow) Pallas interpreter for tests"
        )
    return False


def _splash():
    """The Pallas splash module, imported on first use (``import bertjax`` needs no Pallas)."""
    from jax.experimental.pallas.ops.tpu import splash_attention

    return splash_attention


def _make_kernel(num_heads: int, seq_len: int, interpret: bool, half_window: int = 0):
    """A single-device splash MHA kernel for [heads, seq, head_dim] inputs.

    ``half_window`` > 0 makes it a two-sided sliding window (|i - j| <= half_window): a LocalMask,
    whose key blocks outside the band the kernel skips. The mask metadata is built with NumPy and
    turned into arrays in whatever trace is current (see :func:`_kernel` for the cached one).
    """
    splash = _splash()
    block = block_size(seq_len)
    blocks = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    shape = (seq_len, seq_len)
    if half_window:
        one = splash.LocalMask(shape, (half_window, half_window), 0)
    else:
        one = splash.FullMask(shape)
    mask = splash.MultiHeadMask([one] * num_heads)
    return splash.make_splash_mha_single_device(mask, block_sizes=blocks, interpret=interpret)


@functools.lru_cache(maxsize=32)
def _kernel(num_heads: int, seq_len: int, interpret: bool, half_window: int = 0):
    """:func:`_make_kernel`, made once per (local) head count and sequence length and reused by
    every layer and every trace: it is made under ``ensure_compile_time_eval`` so that its arrays
    are constants, not tracers of the trace that happened to make it (which a later trace would
    see as leaked). That runs on the devices in scope, so it needs devices that can execute."""
    with jax.ensure_compile_time_eval():
        return _make_kernel(num_heads, seq_len, interpret, half_window)


def _local_attention(
    q: Array,
    k: Array,
    v: Array,
    segment_ids: Array,
    *,
    interpret: bool,
    half_window: int,
    cached: bool = True,
) -> Array:
    """The kernel on one device's shard: q (already scaled)/k/v [batch, seq, heads, head_dim].

    ``cached=False`` makes the kernel inside the current trace (its mask arrays are constants of
    this program only): for compile-only devices (a simulated TPU slice), which cannot run the
    eager ops the cached kernel is made with."""
    _, seq_len, num_heads, head_dim = q.shape
    make = _kernel if cached else _make_kernel
    kernel = make(num_heads, seq_len, interpret, half_window)

    def call(q1, k1, v1, ids):  # [heads, seq, head_dim] x3, ids [seq]
        return kernel(q1, k1, v1, segment_ids=_splash().SegmentIds(q=ids, kv=ids))

    # XLA's cost model sees the kernel's declared cost (bertjax.layers.splash_cost)
    costs = kernel_costs(
        num_heads, seq_len, head_dim, str(q.dtype), block_size(seq_len), half_window
    )
    one_example = priced(call, costs)

    def heads_first(x):  # [batch, seq, heads, head_dim] -> [batch, heads, seq, head_dim]
        return jnp.swapaxes(x, 1, 2)

    out = jax.vmap(one_example)(heads_first(q), heads_first(k), heads_first(v), segment_ids)
    return jnp.swapaxes(out, 1, 2)  # [batch, seq, heads, head_dim]


def _mesh_spec(shape: tuple[int, ...], mesh, logical_axes) -> PartitionSpec | None:
    """The shard_map spec of q/k/v under ``mesh`` and the current logical rules: batch and heads as
    the rules say (axes that do not divide the dimension dropped), sequence and head_dim whole.
    None when nothing would be split (then the kernel is called directly)."""
    rule = tuple(nn.logical_to_mesh_axes(logical_axes))
    rule += (None,) * (4 - len(rule))

    def on_mesh(axes):
        axes = axes if isinstance(axes, tuple) else (axes,)
        kept = tuple(a for a in axes if a is not None and a in mesh.axis_names)
        return kept or None

    spec = fit_spec(PartitionSpec(on_mesh(rule[0]), None, on_mesh(rule[2]), None), shape, mesh)
    if all(axes is None for axes in spec):
        return None
    return spec


def splash_attention(
    q: Array,
    k: Array,
    v: Array,
    segment_ids: Array,
    *,
    interpret: bool | None = None,
    logical_axes: tuple[str, ...] = LOGICAL_AXES,
    local_window: int = 0,
) -> Array:
    """Softmax attention of q/k/v [batch, seq, heads, head_dim] -> [batch, seq, heads, head_dim].

    ``segment_ids`` [batch, seq] int: a query attends only to keys with the same id (0 = padding, 1
    for a plain sequence, 1..n for packed sequences). ``q`` is scaled by ``1/sqrt(head_dim)`` here;
    the softmax is float32 inside the kernel. ``interpret``: None = TPU kernel on TPU, interpreter
    only when ``BERTJAX_SPLASH_INTERPRET=1``, else an error (see :func:`resolve_interpret`).
    Under a multi-device ``jax.set_mesh`` the kernel runs per device in ``jax.shard_map`` on the
    batch/head shard given by the logical rules for ``logical_axes``.
    """
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"splash_attention: q/k/v must share a [batch, seq, heads, head_dim] shape, got "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    if segment_ids.shape != q.shape[:2]:
        raise ValueError(
            f"splash_attention: segment_ids must be [batch, seq] = {q.shape[:2]}, got "
            f"{segment_ids.shape}"
        )
    block_size(q.shape[1])  # a clear error before the kernel's own
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    platform = getattr(device, "platform", None)
    interpret = resolve_interpret(interpret, platform)
    scale = jnp.asarray(1.0 / jnp.sqrt(q.shape[-1]), q.dtype)
    q = q * scale
    segment_ids = segment_ids.astype(jnp.int32)
    # Devices of another platform than this process's backend are compile-only (bertjax compile
    # --topology): no eager op runs on them, so the kernel is made inside this trace.
    cached = platform in (None, jax.default_backend())
    local = functools.partial(
        _local_attention, interpret=interpret, half_window=local_window // 2, cached=cached
    )

    spec = None if mesh.empty or mesh.size == 1 else _mesh_spec(q.shape, mesh, logical_axes)
    with jax.named_scope("splash_attention"):
        if spec is None:
            return local(q, k, v, segment_ids)
        ids_spec = PartitionSpec(spec[0], None)  # [batch, seq]
        # check_vma=False: the kernel's pallas_call declares its outputs without varying-manual-
        # axes types, which the VMA checker rejects (jax 0.10.2); every output is per-shard anyway.
        sharded = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(spec, spec, spec, ids_spec),
            out_specs=spec,
            check_vma=False,
        )
        return sharded(q, k, v, segment_ids)
