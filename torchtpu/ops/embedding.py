"""Embedding lookups and their gradients: `embedding`, `embedding_renorm`, `_embedding_bag`
(sum, mean and max bags; per-sample weights; `include_last_offset`; `padding_idx`) and the
backward ops autograd calls for them.

A bag reduction is a linear map of the weight once the bag of every index is known: gather the
rows, scale each by a coefficient (its per-sample weight, 0 for `padding_idx`, 1/bag size for
mean), sum each bag. The backward ops are that map's adjoint (`views.transpose_view`), so the
forward and backward bag arithmetic is written once. Low-precision weights reduce in float32, as
PyTorch's CPU kernels accumulate. A row index out of range is an error reported as a
device-side check (see `indexing.py`); the forward ops check, the backward ops see the same
indices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.ops import registry, views
from torchtpu.ops.indexing import READ, STRICT, WRITE, check_range

aten = torch.ops.aten

SUM, MEAN, MAX = 0, 1, 2


def _opmath(dtype):
    return jnp.float32 if np.dtype(dtype).itemsize < 4 else dtype


def _rows(weight, indices):
    return weight.at[indices].get(**READ, **STRICT)


@registry.register(aten.embedding.default)
def embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if indices.size:
        check_range(ctx, indices, weight.shape[0], "the embedding's rows")
    return _rows(weight, indices)


def _index_counts(indices, num_weights: int):
    """How often each row index occurs (for `scale_grad_by_freq`)."""
    return jnp.zeros(num_weights, jnp.int64).at[indices].add(1, **WRITE, **STRICT)


@registry.register(aten.embedding_dense_backward.default)
def embedding_dense_backward(ctx, grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    indices = indices.reshape(-1)
    grad = grad_output.reshape(indices.shape[0], -1).astype(_opmath(grad_output.dtype))
    coefficient = (indices != padding_idx).astype(grad.dtype)
    if scale_grad_by_freq:
        coefficient = coefficient / _index_counts(indices, num_weights)[indices]
    grad_weight = jnp.zeros((num_weights, grad.shape[1]), grad.dtype)
    return grad_weight.at[indices].add(grad * coefficient[:, None], **WRITE, **STRICT)


@registry.register(aten.embedding_renorm.default)
def embedding_renorm(ctx, weight, indices, max_norm, norm_type):
    """Rows that `indices` reference and whose `norm_type`-norm exceeds `max_norm` are scaled
    to norm `max_norm` (PyTorch's 1e-7 guard included)."""
    rows = weight.astype(_opmath(weight.dtype))
    norms = jnp.linalg.norm(rows, ord=norm_type, axis=1)
    referenced = jnp.zeros(weight.shape[0], bool).at[indices.reshape(-1)].set(True, **WRITE, **STRICT)
    scale = jnp.where(referenced & (norms > max_norm), max_norm / (norms + 1e-7), 1.0)
    return rows * scale[:, None].astype(rows.dtype)


# --- bags --------------------------------------------------------------------------------------------


def _bag_of_each_index(offsets, count: int):
    """`offset2bag`: the bag of every index, in CSR terms -- bag b holds indices
    [offsets[b], offsets[b + 1]); the last bag runs to the end of `indices`, unless
    `include_last_offset` makes the last offset its end, and the indices past it belong to no bag
    (their bag number is the bag count, which every segment reduction drops)."""
    starts = jnp.zeros(count, jnp.int64).at[offsets].add(1, **WRITE)
    return jnp.cumsum(starts) - 1


def _segment_sum(values, bags, num_bags: int):
    return jax.ops.segment_sum(values, bags, num_segments=num_bags, indices_are_sorted=True)


def _coefficients(indices, bags, num_bags: int, mode: int, per_sample_weights, padding_idx: int, dtype):
    """Each index's weight in its bag's sum, and each bag's size (indices that count)."""
    counted = indices != padding_idx
    bag_size = _segment_sum(counted.astype(jnp.int64), bags, num_bags)
    coefficient = counted.astype(dtype)
    if per_sample_weights is not None:
        coefficient = coefficient * per_sample_weights.astype(dtype)
    if mode == MEAN:
        coefficient = coefficient / jnp.maximum(bag_size, 1)[bags].astype(dtype)
    return coefficient, bag_size


def _bag_sums(weight, indices, bags, num_bags: int, coefficient):
    """The linear map weight -> per-bag weighted sums of the referenced rows."""
    return _segment_sum(_rows(weight, indices) * coefficient[:, None], bags, num_bags)


def _bag_max(rows, indices, bags, num_bags: int, counted):
    """Per-bag, per-column maximum and the row index holding it (the first in bag order; 0 for
    an empty bag, as PyTorch's CPU kernel)."""
    if rows.shape[0] == 0:
        shape = (num_bags, rows.shape[1])
        return jnp.zeros(shape, rows.dtype), jnp.zeros(shape, jnp.int64)
    masked = jnp.where(counted[:, None], rows, -jnp.inf)
    best = jax.ops.segment_max(masked, bags, num_segments=num_bags, indices_are_sorted=True)
    position = jnp.arange(rows.shape[0])[:, None]
    holds = counted[:, None] & (masked == best[bags])
    first = jax.ops.segment_min(
        jnp.where(holds, position, rows.shape[0]), bags, num_segments=num_bags, indices_are_sorted=True
    )
    present = first < rows.shape[0]
    argmax = jnp.where(present, indices[jnp.minimum(first, rows.shape[0] - 1)], 0)
    return jnp.where(present, best, 0), argmax


def _pad_to(values, length: int):
    """PyTorch's meta kernel sizes `bag_size` by `offsets` even with `include_last_offset`."""
    return jnp.pad(values, (0, length - values.shape[0]))


@registry.register(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(ctx, weight, indices, offsets, scale_grad_by_freq=False, mode=SUM, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """(output, offset2bag, bag_size, max_indices), shaped as PyTorch's meta kernel says."""
    num_bags = ctx.out_shape(0)[0]
    if indices.size:
        check_range(ctx, indices, weight.shape[0], "the embedding's rows")
    dtype = _opmath(weight.dtype)
    bags = _bag_of_each_index(offsets, indices.shape[0])
    coefficient, bag_size = _coefficients(indices, bags, num_bags, mode, per_sample_weights,
                                          padding_idx, dtype)
    if mode == MAX:
        output, max_indices = _bag_max(_rows(weight, indices).astype(dtype), indices, bags,
                                       num_bags, indices != padding_idx)
    else:
        output = _bag_sums(weight.astype(dtype), indices, bags, num_bags, coefficient)
        max_indices = jnp.zeros(ctx.out_shape(3), jnp.int64)
    return output, bags, _pad_to(bag_size, ctx.out_shape(2)[0]), max_indices


def _dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights: int,
                    scale_grad_by_freq: bool, mode: int, per_sample_weights, padding_idx: int,
                    out_dtype):
    dtype = _opmath(grad.dtype)
    grad = grad.astype(dtype)
    num_bags, dim = grad.shape
    shape = (num_weights, dim)
    if mode == MAX:
        columns = jnp.broadcast_to(jnp.arange(dim), maximum_indices.shape)
        present = (bag_size[:num_bags] > 0)[:, None]
        grad_weight = jnp.zeros(shape, dtype).at[maximum_indices, columns].add(
            jnp.where(present, grad, 0), **WRITE, **STRICT)
        return grad_weight.astype(out_dtype)
    coefficient, _ = _coefficients(indices, offset2bag, num_bags, mode, per_sample_weights,
                                   padding_idx, dtype)
    if scale_grad_by_freq:
        coefficient = coefficient / _index_counts(indices, num_weights)[indices].astype(dtype)

    def bag_sums(weight):
        return _bag_sums(weight, indices, offset2bag, num_bags, coefficient)

    return views.transpose_view(bag_sums, shape, dtype, grad).astype(out_dtype)


@registry.register(aten._embedding_bag_dense_backward.default)
def embedding_bag_dense_backward(ctx, grad, indices, offset2bag, bag_size, maximum_indices,
                                 num_weights, scale_grad_by_freq, mode, per_sample_weights,
                                 padding_idx=-1):
    return _dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                           scale_grad_by_freq, mode, per_sample_weights, padding_idx, ctx.out_dtype())


@registry.register(aten._embedding_bag_backward.default)
def embedding_bag_backward(ctx, grad, indices, offsets, offset2bag, bag_size, maximum_indices,
                           num_weights, scale_grad_by_freq, mode, sparse, per_sample_weights,
                           padding_idx=-1):
    if sparse:
        raise ValueError(
            "embedding_bag(sparse=True): sparse gradients are not supported on tpu (the device has dense "
            "layouts only); use sparse=False, or embeddings.SparseCoreEmbeddingBagCollection, whose tables "
            "are updated in the backward pass, only in the rows a batch looked up"
        )
    return _dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                           scale_grad_by_freq, mode, per_sample_weights, padding_idx, ctx.out_dtype())


@registry.register(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(ctx, grad, weight, indices, offsets, offset2bag, mode,
                                              padding_idx=-1):
    """The adjoint of the (linear) map per-sample weights -> bag sums."""
    if mode != SUM:
        raise ValueError(f"embedding_bag: per_sample_weights need mode 'sum', got mode {mode}")
    dtype = _opmath(grad.dtype)
    num_bags = grad.shape[0]
    rows = weight.astype(dtype)
    counted = (indices != padding_idx).astype(dtype)

    def bag_sums(per_sample_weights):
        return _bag_sums(rows, indices, offset2bag, num_bags, counted * per_sample_weights)

    return views.transpose_view(bag_sums, indices.shape, dtype, grad.astype(dtype)).astype(ctx.out_dtype())
